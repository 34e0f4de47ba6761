"""LoRA applied from outside (lt_plugins/lora.py) against PEFT, the reference: an adapter Tandem trains on a random
Hugging Face Qwen3 folder, exported in PEFT's format (lt_plugins/export/adapter.py), loads with
`peft.PeftModel.from_pretrained` and gives the same logits in fp32; the merged weights give them too. Also what
apply_lora freezes, the int8 base and the refusals (one line naming the field)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lt_plugins.errors import TrainingConfigError
from lt_plugins.export.adapter import ADAPTER_CONFIG, adapter_state, peft_config, write_adapter
from lt_plugins.lit_module import load_folder_weights
from lt_plugins.lora import LoraConfig, LoraLinear, apply_lora, merge_state
from shared_model.bundle import read_config
from shared_model.model import CausalLM

sys.path.insert(0, str(Path(__file__).parent))
from finetune_folder import make_hf_folder

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "qwen3-tiny"
    make_hf_folder(out)
    return out


def _tandem(folder: Path, cfg: LoraConfig) -> tuple[CausalLM, list[str]]:
    model = CausalLM(read_config(folder))
    load_folder_weights(model, folder)
    names = apply_lora(model, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval(), names


def _hf(folder: Path):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("full", [False, True], ids=["adapters", "adapters+embeddings+head"])
def test_exported_adapter_loads_in_peft_with_equal_logits(folder: Path, tmp_path: Path, full: bool) -> None:
    cfg = LoraConfig(enabled=True, rank=4, alpha=8.0, targets=("*.q_proj", "*.v_proj", "*.down_proj"),
                     train_embeddings=full, train_lm_head=full)  # fmt: skip
    model, names = _tandem(folder, cfg)
    assert names == [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.v_proj",
                                                                         "mlp.down_proj")]  # fmt: skip
    state = model.state_dict()
    modules = ["model.embed_tokens", "lm_head"] if full else []
    meta = {"config": cfg.to_dict(), "base": str(folder), "full_modules": modules}
    out = write_adapter(tmp_path / "adapter", peft_config(meta, names, modules), adapter_state(state, modules), False)
    written = json.loads((out / ADAPTER_CONFIG).read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 8.0 and written["base_model_name_or_path"] == str(folder)

    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))  # [B, T]
    with torch.no_grad():
        ours = model(ids)  # [B, T, vocab]
        base = _hf(folder)(ids).logits
        theirs = peft.PeftModel.from_pretrained(_hf(folder), out).eval()(ids).logits
    assert (ours - base).abs().max() > 1e-3  # the adapter changes the model ...
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)  # ... exactly as PEFT applies it

    merged = CausalLM(read_config(folder))
    merged.load_state_dict(merge_state(state, cfg.scaling))
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(ids), ours, rtol=1e-4, atol=1e-4)


def test_apply_lora_freezes_the_base_and_starts_as_the_base(folder: Path) -> None:
    import lt_plugins

    assert lt_plugins.apply_lora is apply_lora and lt_plugins.LoraConfig is LoraConfig  # the public entry points
    cfg = LoraConfig(enabled=True, rank=2, alpha=4.0, dropout=0.1)
    model = CausalLM(read_config(folder))
    load_folder_weights(model, folder)
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model.eval()(ids)
    names = apply_lora(model, cfg)
    assert len(names) == 2 * 7 and all(isinstance(model.get_submodule(n), LoraLinear) for n in names)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{x}.weight" for n in names for x in "AB"}
    assert apply_lora(model, cfg) == names  # idempotent: nothing wrapped twice
    assert not isinstance(model.get_submodule(f"{names[0]}.lora_A"), LoraLinear)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), before, rtol=0, atol=0)  # B = 0: the base model, exactly


def test_int8_base_is_close_to_the_base(folder: Path) -> None:
    model = CausalLM(read_config(folder))
    load_folder_weights(model, folder)
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model.eval()(ids)
    apply_lora(model, LoraConfig(enabled=True, base_dtype="int8"))
    q = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert q.weight is None and q.weight_int8.dtype == torch.int8
    with torch.no_grad():
        after = model(ids)
    assert 0 < (after - before).abs().max() < 0.05 * before.abs().max()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"rank": 0}, r"lora\.rank must be an integer >= 1, got 0"),
        ({"alpha": 0.0}, r"lora\.alpha must be a finite number > 0, got 0\.0"),
        ({"alpha": -1.0}, r"lora\.alpha must be"),
        ({"dropout": 1.0}, r"lora\.dropout must be"),
        ({"base_dtype": "int4"}, r"lora\.base_dtype must be one of model, bf16, int8"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs: dict, named: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(TrainingConfigError, match=named):
        LoraConfig(**kwargs)


def test_a_pattern_matching_nothing_is_named_with_module_names(folder: Path) -> None:
    model = CausalLM(read_config(folder))
    with pytest.raises(TrainingConfigError) as info:
        apply_lora(model, LoraConfig(targets=("*.q_proj", "*.qkv_proj")))
    msg = str(info.value)
    assert "\n" not in msg and "lora.targets: pattern '*.qkv_proj' matches no nn.Linear" in msg
    assert "model.layers.0.self_attn.q_proj" in msg
    assert not any(isinstance(m, LoraLinear) for m in model.modules())  # checked before anything is wrapped


def test_the_yaml_section_validates_and_names_the_key() -> None:
    from lt_plugins.config import load_config

    cfg = load_config(None, ["lora.enabled=true", "lora.rank=4", "lora.targets=['*.q_proj']"])
    assert cfg.lora.to_config() == LoraConfig(enabled=True, rank=4, targets=("*.q_proj",))
    with pytest.raises(TrainingConfigError, match=r"lora\.rank must be an integer >= 1, got 0"):
        load_config(None, ["lora.rank=0"])
    with pytest.raises(TrainingConfigError, match=r"lora\.alpha must be a finite number > 0"):
        load_config(None, ["lora.alpha=-2"])
    with pytest.raises(TrainingConfigError, match=r"lora\.base_dtype=int8 needs strategy\.stage <= 2"):
        load_config(None, ["lora.enabled=true", "lora.base_dtype=int8", "strategy.stage=3"])


def test_a_class_path_module_gets_lora_after_its_own_configure_model() -> None:
    """`tandem train` with model.class_path and a lora section: `with_lora` makes the module's configure_model (the
    hook Lightning calls before the optimizer and the strategy's engine exist) end with apply_lora."""
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from user_module_example import BagOfTokens

    from lt_plugins.lit_module import with_lora

    module = with_lora(BagOfTokens(vocab_size=50), LoraConfig(enabled=True, rank=2, targets=("head",)))
    assert is_overridden("configure_model", module)  # Lightning will call it
    assert isinstance(module.head, torch.nn.Linear) and not isinstance(module.head, LoraLinear)
    module.configure_model()
    assert isinstance(module.head, LoraLinear)
    assert {n for n, p in module.named_parameters() if p.requires_grad} == {"head.lora_A.weight", "head.lora_B.weight"}
