"""`tandem train` end to end: Lightning launches 2 processes under ZeRO-3, the run dir holds the resolved config,
sharded checkpoints and logs, the last line names the bundle, `tandem export` re-exports in another dtype, and
rerunning the finished 2-process command after its bundle was deleted resumes, trains nothing and exports it again
(the same weights)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lt_plugins.cli import export_main
from shared_model.bundle import MANIFEST_FILE
from tests.conftest import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_train_stage3_two_processes_then_export(tmp_path: Path, port: int) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(REPO / "configs/tiny-cpu.yaml")]
    cmd += ["trainer.max_steps=4", "trainer.devices=2", "strategy.stage=3", "trainer.precision=32-true"]
    cmd += ["data.max_documents=40", "data.block_size=32", "data.batch_size=2", f"run_dir={run_dir}"]
    cmd += ["checkpoints.every_n_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"]
    cmd += ["export.dtype=float32", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false"]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("bundle: ")
    bundle = Path(last.removeprefix("bundle: "))
    assert bundle == run_dir / "bundle"

    assert "stage: 3" in (run_dir / "config.yaml").read_text()
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step-000002", "step-000004"]
    assert all((c / "tandem_manifest.json").is_file() for c in ckpts)
    header = (run_dir / "logs" / "metrics.csv").read_text().splitlines()[0]
    assert {"train_loss", "lr", "tokens_per_s", "val_loss", "val_ppl"} <= set(header.split(","))

    from shared_model.bundle import load_bundle

    transformers = pytest.importorskip("transformers")
    loaded = load_bundle(bundle, dtype=torch.float32)
    ids = torch.tensor([loaded.tokenizer.encode("def main():\n    return 0\n")])
    with torch.no_grad():
        ours = loaded.model(ids)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(bundle, torch_dtype=torch.float32).eval()(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)

    out = tmp_path / "bf16-bundle"
    assert export_main([str(run_dir), str(out), "--dtype", "bfloat16"]) == 0
    assert load_bundle(out, dtype=None).dtype == torch.bfloat16
    assert export_main([str(run_dir), str(out)]) == 2  # exists: refused without --overwrite

    weights_sha = json.loads((bundle / MANIFEST_FILE).read_text())["files"]["model.safetensors"]["sha256"]
    shutil.rmtree(bundle)
    rerun_env = {**env, "MASTER_PORT": str(free_port())}
    proc = subprocess.run(cmd, cwd=tmp_path, env=rerun_env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == f"bundle: {bundle}"
    assert f"bundle {bundle} is missing: exporting step-000004" in proc.stderr, proc.stderr[-3000:]
    assert sorted(c.name for c in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert json.loads((bundle / MANIFEST_FILE).read_text())["files"]["model.safetensors"]["sha256"] == weights_sha
