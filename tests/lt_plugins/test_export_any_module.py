"""`tandem export` for modules that are not Tandem's (issue 16, item 4).

Two LightningModules are trained 2-3 steps under ZeroStrategy stage 3 with every parameter partitioned
(param_persistence_threshold=0), one process, in a fresh process (DeepSpeed's stage 3 leaves process-wide
patches behind): `EncoderLM` (nn.TransformerEncoder, a tied head, a buffer) and `HFWrapper` (a tiny random
transformers Qwen3 as `self.lm`, its config saved with `save_hyperparameters`). The worker also writes each module's
gathered state dict as the reference. The export must reproduce it tensor for tensor (state-dict), shard it into a
valid index (tiny threshold), and give a Hugging Face folder with the same logits in transformers and in Tandem's
own loader. A plain Lightning `.ckpt` exports the same way; refusals are one line naming the fix.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lt_plugins.cli import export_main
from lt_plugins.errors import CheckpointError
from lt_plugins.export import state_dict as export_sd_mod
from lt_plugins.export.state_dict import export_state_dict
from shared_model.bundle import INDEX_FILE, MANIFEST_FILE, read_source, read_state_dict
from tests.conftest import free_port

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
VOCAB = 64
HF_CONFIG = {
    "model_type": "qwen3",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


class EncoderLM(pl.LightningModule):
    """Embedding → 2 TransformerEncoderLayers → a head tied to the embedding; a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("temperature", torch.tensor(1.5))

    def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
        (x,) = batch  # x: [B, T]
        logits = self.head(self.encoder(self.embed(x))) / self.temperature  # [B, T, vocab]
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class HFWrapper(pl.LightningModule):
    """A tiny random transformers causal LM as `self.lm`; its config in the hyperparameters."""

    def __init__(self, hf_config: dict) -> None:
        super().__init__()
        self.save_hyperparameters()
        import transformers

        config = dict(hf_config)
        self.lm = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(config.pop("model_type"), **config)
        )

    def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
        (x,) = batch
        return self.lm(input_ids=x, labels=x).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader(vocab: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.randint(0, vocab, (12, 16), generator=torch.Generator().manual_seed(0))), 4)


def _trainer(strategy: object, steps: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,  # type: ignore[arg-type]
        precision="32-true",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _worker(out: Path) -> None:
    """Train both modules at stage 3, save checkpoints and the gathered reference state dicts."""
    import deepspeed
    from safetensors.torch import save_file

    from lt_plugins.strategy import ZeroStrategy

    has_hf = importlib.util.find_spec("transformers") is not None  # a test-only dependency
    for name, vocab, steps in (("enc", VOCAB, 3), ("hf", 128, 2))[: 2 if has_hf else 1]:
        pl.seed_everything(0, verbose=False)
        module = EncoderLM() if name == "enc" else HFWrapper(HF_CONFIG)
        trainer = _trainer(ZeroStrategy(stage=3, param_persistence_threshold=0, bucket_size=10_000), steps)
        trainer.fit(module, _loader(vocab))
        trainer.save_checkpoint(out / name, weights_only=False)
        assert all(p.numel() == 0 for p in module.parameters())  # every parameter partitioned (ZeRO-3, threshold 0)
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            assert all(p.numel() > 0 for p in module.parameters())
            ref = {k: v.detach().clone() for k, v in module.state_dict().items()}
        save_file(ref, str(out / f"{name}-ref.safetensors"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("any-module")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _ref(trained: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(trained / f"{name}-ref.safetensors"))


def _assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_zero3_encoder_state_dict_equals_the_gathered_parameters(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sd"
    assert export_main([str(trained / "enc"), str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("tandem export: format auto → state-dict: no model_meta/config.json"), lines
    assert lines[-1] == f"state-dict: {out.resolve()}"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", MANIFEST_FILE]
    _assert_same(read_state_dict(out), _ref(trained, "enc"))
    source = read_source(out)
    assert source is not None and source["format"] == "state-dict" and source["checkpoint"] == "enc"
    assert oct(os.stat(out / "model.safetensors").st_mode & 0o777) == oct(os.stat(out / MANIFEST_FILE).st_mode & 0o777)


def test_a_tiny_shard_threshold_gives_a_valid_index_whose_union_is_the_state_dict(
    trained: Path, tmp_path: Path
) -> None:
    ref = _ref(trained, "enc")
    limit = 8 * 1024
    out = export_state_dict(trained / "enc", tmp_path / "sharded", max_shard_bytes=limit)
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(index["weight_map"]) == sorted(ref)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
    from safetensors import safe_open

    union: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            keys = list(f.keys())
            assert all(index["weight_map"][k] == name for k in keys)
            tensors = {k: f.get_tensor(k) for k in keys}
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        assert len(sizes) == 1 or sum(sizes) <= limit, (name, sizes)  # only a lone tensor may exceed the limit
        assert not set(tensors) & set(union)
        union.update(tensors)
    _assert_same(union, ref)
    # replaced only with --overwrite (the folder carries Tandem's manifest), refused in one line otherwise
    assert export_main([str(trained / "enc"), str(out), "--max-shard-size", "16KiB", "--overwrite"]) == 0
    assert len(set(json.loads((out / INDEX_FILE).read_text())["weight_map"].values())) < n


def test_hf_wrapper_exports_a_folder_transformers_and_tandem_load_with_equal_logits(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    from shared_model.bundle import load_bundle

    out = tmp_path / "hf"
    assert export_main([str(trained / "hf"), str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "format auto → hf: a Hugging Face config in the checkpoint's hyper_parameters['hf_config']" in lines[-2]
    assert lines[-1] == f"hf: {out.resolve()}"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    config = dict(HF_CONFIG)
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    ).eval()
    ref = {k.removeprefix("lm."): v for k, v in _ref(trained, "hf").items()}
    reference.load_state_dict(ref, strict=True)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = load_bundle(out, dtype=torch.float32).model
    with torch.no_grad():
        expected = reference(ids).logits
        assert torch.equal(theirs(ids).logits, expected)
        torch.testing.assert_close(ours(ids), expected, rtol=1e-5, atol=1e-5)
    assert read_source(out)["format"] == "hf"  # type: ignore[index]
    # an explicit attribute works too; a wrong one is one line naming the fix
    assert export_main([str(trained / "hf"), str(tmp_path / "hf2"), "--format", "hf", "--hf-attribute", "lm"]) == 0
    capsys.readouterr()
    assert export_main([str(trained / "hf"), str(tmp_path / "hf3"), "--format", "hf", "--hf-attribute", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no tensor name starts with 'x.'" in err and "--hf-attribute" in err
    assert not (tmp_path / "hf3").exists()


def test_refusals_are_one_line_naming_the_fix(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        ([str(tmp_path / "nope"), str(tmp_path / "o1")], "checkpoint not found"),
        ([str(trained / "enc"), str(tmp_path / "o2"), "--format", "bundle"], "pass --model-meta DIR for a bundle"),
        ([str(trained / "enc"), str(tmp_path / "o3"), "--format", "hf"], "pass --hf-config DIR"),
        ([str(trained / "enc"), str(trained), "--format", "state-dict"], "it contains the checkpoint"),
        ([str(trained / "enc"), str(tmp_path / "o4"), "--max-shard-size", "12"], "has no unit"),
    ]
    for argv, needle in cases:
        capsys.readouterr()
        assert export_main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("tandem export: error: ") and needle in err, err
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


class _Small(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

    def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
        return self.net(batch[0].float()).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_plain_lightning_ckpt_exports_and_a_failed_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _Small()
    trainer = _trainer("auto", 2)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt, weights_only=False)
    out = export_state_dict(ckpt, tmp_path / "sd", dtype="bfloat16")
    want = {k: v.to(torch.bfloat16) for k, v in module.state_dict().items()}
    _assert_same(read_state_dict(out), want)

    def failing_save(tensors: dict, path: str, metadata: dict) -> None:
        Path(path).write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(export_sd_mod, "save_file", failing_save)
    with pytest.raises(OSError, match="No space left"):
        export_state_dict(ckpt, tmp_path / "failed")
    with pytest.raises(OSError, match="No space left"):
        export_state_dict(ckpt, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "sd"]  # no temporary folder left behind
    _assert_same(read_state_dict(out), want)  # the previous export is untouched
    bad = tmp_path / "bad.ckpt"
    torch.save({"state_dict": {"w": torch.tensor([1.0, float("nan")])}}, bad)
    with pytest.raises(CheckpointError, match=r"tensor w holds NaN or Inf"):
        export_state_dict(bad, tmp_path / "nan")
    assert not (tmp_path / "nan").exists()


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    _worker(Path(sys.argv[1]))
