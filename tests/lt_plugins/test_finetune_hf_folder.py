"""`model.init_from`: fine-tune a local Hugging Face folder (tiny random Qwen3 with a chat template and added special
tokens, sharded safetensors) on your own JSONL for a few steps with `tandem train`, then check the exported bundle:
its tokenizer files and chat template equal the source's, the weights moved away from the source's, and no
tokenizer was trained. Also the refusals: conflicting settings and unusable folders, each one line naming the key."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lt_plugins.config import load_config
from lt_plugins.errors import TrainingConfigError
from lt_plugins.lit_module import model_source

sys.path.insert(0, str(Path(__file__).parent))
from finetune_folder import CHAT_TEMPLATE, make_hf_folder

pytestmark = pytest.mark.slow  # training runs (not in make test-fast)

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("hf") / "qwen3-tiny"
    return folder, make_hf_folder(folder)


def _jsonl(path: Path) -> Path:
    lines = [json.dumps({"id": i, "text": f"<|im_start|>user\nadd {i} and {i + 1}<|im_end|>\n" * 3}) for i in range(60)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_finetune_keeps_chat_template_and_special_tokens(source, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, weights = source
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(REPO / "configs/finetune-example.yaml")]
    cmd += [f"model.init_from={folder}", f"data.extra=[{_jsonl(tmp_path / 'chat.jsonl')}]", f"run_dir={run_dir}"]
    cmd += ["trainer.max_steps=3", "data.block_size=32", "data.batch_size=2", "optim.lr=1e-2", "optim.warmup_steps=1"]
    cmd += ["trainer.val_check_interval=3", "trainer.limit_val_batches=1", "checkpoints.every_n_steps=3"]
    cmd += ["trainer.enable_progress_bar=false", "logging.tensorboard=false", "export.dtype=float32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    bundle = Path(proc.stdout.strip().splitlines()[-1].removeprefix("bundle: "))

    ours, theirs = (json.loads((f / "tokenizer_config.json").read_text()) for f in (bundle, folder))
    assert ours == theirs  # chat_template, eos/pad, added_tokens_decoder, additional_special_tokens, class...
    assert ours["chat_template"] == CHAT_TEMPLATE
    added = [json.loads((f / "tokenizer.json").read_text())["added_tokens"] for f in (bundle, folder)]
    assert added[0] == added[1] and {t["content"] for t in added[0]} >= {"<|im_start|>", "<|im_end|>"}
    assert not any((run_dir / "cache").glob("*/tokenizer.json")) or all(
        json.loads(p.read_text())["model"] == json.loads((folder / "tokenizer.json").read_text())["model"]
        for p in (run_dir / "cache").glob("*/tokenizer.json")
    )  # the folder's tokenizer, not a trained one

    from shared_model.bundle import load_bundle, read_state_dict

    loaded = load_bundle(bundle, dtype=torch.float32)
    assert loaded.tokenizer is not None and loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.tokenizer.eos_token == "<|im_end|>" and loaded.config.eos_token_ids == (loaded.tokenizer.eos_id,)
    tuned = read_state_dict(bundle)
    assert set(tuned) == set(weights)
    moved = {k for k in weights if not torch.equal(tuned[k], weights[k])}
    assert "model.embed_tokens.weight" in moved and "lm_head.weight" in moved  # trained from the source ...
    delta = max((tuned[k] - weights[k]).abs().max().item() for k in weights)
    assert 0 < delta < 0.5  # ... a few small steps away from it, not a fresh random init


@pytest.mark.slow
@pytest.mark.distributed
def test_zero3_bf16_finetune_of_an_fp32_folder_starts_at_the_fp32_loss(source, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 34's command: `model.init_from=DIR trainer.devices=2 strategy.stage=3 trainer.precision=bf16-mixed` on an
    fp32 folder stopped with "tensor model.embed_tokens.weight holds NaN or Inf values". It trains, and its first
    loss (before any update: what was loaded) equals the same run's in 32-true within the bf16 tolerance."""
    from lt_plugins.metrics_csv import read_metrics
    from tests.conftest import free_port

    folder, weights = source
    assert {t.dtype for t in weights.values()} == {torch.float32}
    data = _jsonl(tmp_path / "chat.jsonl")
    first: dict[str, float] = {}
    for precision in ("bf16-mixed", "32-true"):
        run_dir = tmp_path / precision
        cmd = [
            sys.executable,
            "-m",
            "shared_model.cli",
            "train",
            "--config",
            str(REPO / "configs/finetune-example.yaml"),
        ]
        cmd += [f"model.init_from={folder}", f"data.extra=[{data}]", f"run_dir={run_dir}", "trainer.devices=2"]
        cmd += ["strategy.stage=3", f"trainer.precision={precision}", "trainer.max_steps=2", "data.block_size=32"]
        cmd += ["data.batch_size=2", "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1"]
        cmd += ["trainer.enable_progress_bar=false", "logging.tensorboard=false", "export.enabled=false"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480)
        assert proc.returncode == 0, proc.stderr[-4000:]
        losses = [r["train_loss"] for r in read_metrics(run_dir) if r.get("train_loss") is not None]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
        first[precision] = losses[0]
    assert first["bf16-mixed"] == pytest.approx(first["32-true"], rel=0.02, abs=0.05)  # the bf16 tolerance


def test_tokenizer_round_trip_keeps_jinja_template_file(tmp_path: Path, source) -> None:  # type: ignore[no-untyped-def]
    from shared_model.tokenizer import Tokenizer

    folder, _ = source
    jinja = tmp_path / "jinja"
    jinja.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (jinja / name).write_bytes((folder / name).read_bytes())
    (jinja / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # transformers 5's layout wins
    out = tmp_path / "out"
    out.mkdir()
    Tokenizer.load(jinja).save(out)
    assert (out / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"
    assert Tokenizer.load(out).chat_template == "{{ messages[0]['content'] }}"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["data.tokenizer=/x/tok"], "data.tokenizer='/x/tok' conflicts with model.init_from="),
        (["data.vocab_size=512"], "data.vocab_size=512 conflicts with model.init_from="),
        (["strategy.name=auto"], "strategy.name=auto plans for model.preset, not for model.init_from="),
        (["model.class_path=lightning.pytorch.LightningModule"], "conflicts with model.class_path="),
    ],
)
def test_conflicting_settings_name_both(source, overrides: list[str], named: str) -> None:  # type: ignore[no-untyped-def]
    folder, _ = source
    with pytest.raises(TrainingConfigError, match=named.replace(".", r"\.").replace("(", r"\(")):
        load_config("configs/finetune-example.yaml", [f"model.init_from={folder}", *overrides])


def test_unusable_folders_are_refused(tmp_path: Path, source) -> None:  # type: ignore[no-untyped-def]
    folder, _ = source
    with pytest.raises(TrainingConfigError, match=r"model\.init_from='/no/such' is not a folder"):
        load_config(None, ["model.init_from=/no/such"])
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer_config.json", "model.safetensors.index.json"):
        (broken / name).write_bytes((folder / name).read_bytes())
    cfg = load_config(None, [f"model.init_from={broken}"])
    with pytest.raises(TrainingConfigError, match=r"model\.init_from=.*tokenizer\.json is missing"):
        model_source(cfg.model, 32)
    (broken / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    with pytest.raises(TrainingConfigError, match=r"model\.init_from=.*missing file: .*model-00001-of"):
        model_source(cfg.model, 32)
    with pytest.raises(TrainingConfigError, match=r"data\.block_size=4096 exceeds .*max_position_embeddings=256"):
        model_source(load_config(None, [f"model.init_from={folder}"]).model, 4096)
