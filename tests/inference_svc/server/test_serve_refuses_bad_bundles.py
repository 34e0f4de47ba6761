"""`tandem serve` refuses, at load, model folders it used to serve (issue 15, item 4).

Each folder is a tiny random bundle with one defect. `tandem serve` (a subprocess) must exit 1 with one
`tandem serve:` line on stderr naming the file and the field (or tensor), before it ever reports SERVING. Only the
bit flip needs `--verify-checksums` (safetensors has no checksum of its own); the other defects are refused
without it. A good bundle passes `--verify-checksums`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from inference_svc.cli import build_serve_config
from inference_svc.engine.engine import Engine
from inference_svc.errors import ModelLoadError
from shared_model.bundle import save_bundle
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer
from tests.conftest import tiny_config

pytestmark = pytest.mark.slow  # a tandem serve subprocess per folder (not in make test-fast)

REPO = str(Path(__file__).resolve().parents[3])
FLAGS = ["--port", "0", "--no-metrics", "--no-http", "--device", "cpu", "--kv-cache-memory", "2MiB", "--no-warmup"]


@pytest.fixture
def good(tmp_path: Path, small_tokenizer: Tokenizer) -> Path:
    cfg = tiny_config()
    return save_bundle(tmp_path / "good", cfg, build_model(cfg, seed=0), small_tokenizer)


def _vocab_256_with_512_tokenizer(good: Path) -> tuple[Path, list[str]]:
    small = tiny_config(vocab_size=256)
    folder = save_bundle(good.parent / "v256", small, build_model(small, seed=0))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(good / name, folder / name)
    return folder, [str(folder / "tokenizer.json"), "config.json: vocab_size is 256"]


def _nan_weight(good: Path) -> tuple[Path, list[str]]:
    tensors = load_file(good / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
    save_file(tensors, good / "model.safetensors", metadata={"format": "pt"})
    return good, [f"{good / 'model.safetensors'}: tensor model.layers.0.self_attn.q_proj.weight holds NaN"]


def _flipped_bit(good: Path) -> tuple[Path, list[str]]:
    data = bytearray((good / "model.safetensors").read_bytes())
    data[-4] ^= 0x01  # a finite float32 either way: only the checksum can tell
    (good / "model.safetensors").write_bytes(bytes(data))
    return good, [f"{good / 'model.safetensors'}: SHA-256 does not match tandem_bundle.json"]


def _one_position(good: Path) -> tuple[Path, list[str]]:
    raw = json.loads((good / "config.json").read_text())
    raw["max_position_embeddings"] = 1
    (good / "config.json").write_text(json.dumps(raw))
    return good, [f"{good / 'config.json'}: max_position_embeddings must be at least 16"]


@pytest.mark.parametrize(
    "make", [_vocab_256_with_512_tokenizer, _nan_weight, _flipped_bit, _one_position], ids=lambda f: f.__name__
)
def test_serve_refuses_the_folder_in_one_line(good: Path, make) -> None:  # type: ignore[no-untyped-def]
    folder, names = make(good)
    verify = ["--verify-checksums"] if make is _flipped_bit else []
    cmd = [sys.executable, "-m", "shared_model.cli", "serve", "--model", str(folder), *FLAGS, *verify]
    try:  # a served folder never exits by itself: the timeout only bounds a failing run
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"tandem serve served {folder} instead of refusing it: {exc.stderr!r}")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tandem serve:")]
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"tandem serve: cannot load model from {folder}: ")
    for name in names:
        assert name in lines[0], lines[0]
    assert "prompt_token_ids" not in proc.stderr and "SERVING" not in proc.stdout


def test_verify_checksums_flag_reaches_the_engine(good: Path) -> None:
    _, engine_config, _ = build_serve_config(["--model", str(good), *FLAGS, "--verify-checksums"])
    assert engine_config.verify_checksums is True
    assert build_serve_config(["--model", str(good), *FLAGS])[1].verify_checksums is False
    engine = Engine.from_bundle(good, engine_config)  # an untouched bundle verifies
    assert engine.tokenizer is not None
    _flipped_bit(good)
    Engine.from_bundle(good, build_serve_config(["--model", str(good), *FLAGS])[1])  # verification is opt-in
    with pytest.raises(ModelLoadError, match="SHA-256 does not match"):
        Engine.from_bundle(good, engine_config)
