"""Non-finite training state stops `tandem train`'s Trainer with a one-line error, and is never checkpointed.

Real single-process fits (ZeroStrategy, 32-true, a few steps) of a small LightningModule that is not shared_model's,
through the Trainer the CLI builds (tests/lt_plugins/nonfinite_worker.py):
- a loss that turns NaN at step 3 stops training at step 3, naming the step and the value; the checkpoints of
  steps 1-2 stay, the newest of them is `latest` and consolidates to finite weights;
- weights made inf by the optimizer (lr=inf) while the loss is still finite: the step-1 save is refused, so no
  checkpoint exists at all (before the fix, NaN checkpoints became latest and only export refused them).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lt_plugins.checkpoint_io import MANIFEST, latest_checkpoint
from lt_plugins.export.checkpoint import consolidate
from lt_plugins.finite import loss_from_outputs, loss_is_finite, nonfinite_tensor

pytestmark = pytest.mark.slow  # training runs (not in make test-fast)

WORKER = Path(__file__).with_name("nonfinite_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _run_worker(run_dir: Path, mode: str, port: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(WORKER), str(run_dir), mode]
    return subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=300)


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem train: error: "), proc.stderr[-4000:]
    return last


def test_nan_loss_stops_training_and_latest_stays_finite(tmp_path: Path, port: int) -> None:
    run_dir = tmp_path / "run"
    line = _error_line(_run_worker(run_dir, "nan-loss", port))
    assert "non-finite training loss at step 3" in line
    assert "loss nan" in line

    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000001", "step-000002"]  # nothing at or after step 3
    latest = latest_checkpoint(ckpts)
    assert latest == ckpts / "step-000002"
    state = consolidate(latest)  # verifies the manifest, merges the ZeRO shards
    assert state and all(bool(torch.isfinite(t).all()) for t in state.values())


def test_nonfinite_weights_are_never_checkpointed(tmp_path: Path, port: int) -> None:
    run_dir = tmp_path / "run"
    line = _error_line(_run_worker(run_dir, "inf-lr", port))
    assert "refusing to save checkpoint step-000001 at step 1" in line
    assert "parameter 'net." in line and "NaN or inf" in line

    ckpts = run_dir / "checkpoints"
    assert latest_checkpoint(ckpts) is None
    assert not list(ckpts.glob(f"*/{MANIFEST}"))  # no complete checkpoint of any step
    assert not (ckpts / "step-000001").exists()  # not even a partial one


def test_nonfinite_tensor_names_the_first_bad_parameter() -> None:
    net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    assert nonfinite_tensor(net) is None
    with torch.no_grad():
        net[1].bias.fill_(math.inf)
    assert nonfinite_tensor(net) == "1.bias"
    with torch.no_grad():
        net[0].weight[0, 0] = math.nan
    assert nonfinite_tensor(net) == "0.weight"


def test_loss_from_outputs_and_finiteness() -> None:
    loss = torch.tensor(1.5)
    assert loss_from_outputs(loss) is loss
    assert loss_from_outputs({"loss": loss, "extra": 1}) is loss
    assert loss_from_outputs(None) is None and loss_from_outputs({}) is None
    assert loss_is_finite(None) and loss_is_finite(loss)
    assert not loss_is_finite(torch.tensor(math.nan)) and not loss_is_finite(torch.tensor(-math.inf))
