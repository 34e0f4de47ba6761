"""A run resumed after kills keeps its history and its disk bounded (issue 34): every attempt's metrics rows stay
(`logs/metrics.csv`, then `metrics.attempt-N.csv`), and `checkpoints.keep_last` counts the checkpoints of earlier
attempts, the one a run resumed from included.

The end-to-end test runs `tandem train` (one process, ZeRO-2, a checkpoint every step, keep_last=2) three times on
one run dir: attempt 1 finishes 3 steps; attempt 2 (max_steps=8) is SIGKILLed once its step-5 checkpoint is
complete; attempt 3 resumes and finishes. Before the fix, metrics.csv held attempt 3's rows only and the
checkpoints each attempt resumed from were never pruned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lt_plugins.checkpoint_io import MANIFEST, prune_checkpoints
from lt_plugins.errors import CheckpointError
from lt_plugins.metrics_csv import attempt_files, read_metrics
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


def _ckpt(folder: Path, step: int, complete: bool = True, mtime: int | None = None) -> Path:
    path = folder / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / "shard.pt").write_bytes(b"x")
    if complete:
        (path / MANIFEST).write_text("{}")
        if mtime is not None:
            os.utime(path / MANIFEST, ns=(mtime, mtime))
    return path


def test_pruning_counts_every_checkpoint_in_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    for step in (2, 3, 4):  # earlier attempts' checkpoints, the one resumed from (4) included
        _ckpt(folder, step, mtime=step * 10**9)
    partial_old = _ckpt(folder, 5, complete=False)  # a save killed half-way
    partial_new = _ckpt(folder, 9, complete=False)  # a later attempt got further before dying: not ours to judge
    (folder / "notes.txt").write_text("mine")  # not a checkpoint: never touched
    (folder / "step-foo").mkdir()
    written = _ckpt(folder, 6, mtime=6 * 10**9)
    doomed = prune_checkpoints(folder, 2, written)
    assert [p.name for p in doomed] == ["step-000002", "step-000003", partial_old.name]
    assert partial_new not in doomed
    assert [p.name for p in prune_checkpoints(folder, 5, written)] == [partial_old.name]  # 4 complete ones: kept


def test_pruning_never_deletes_the_one_written_nor_the_last_complete(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    for step in (10, 20):  # a longer attempt before; this one resumed from an explicit older checkpoint
        _ckpt(folder, step, mtime=step * 10**9)
    written = _ckpt(folder, 7, mtime=30 * 10**9)  # written last: the newest by time, not by step
    assert prune_checkpoints(folder, 1, written) == [folder / "step-000010"]  # kept: 20 (newest step) and 7
    with pytest.raises(CheckpointError, match="keep_last must be >= 1"):
        prune_checkpoints(folder, 0, written)


def _train(run_dir: Path, max_steps: int, kill_at: int | None = None) -> subprocess.CompletedProcess | None:
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(REPO / "configs/tiny-cpu.yaml")]
    cmd += [f"trainer.max_steps={max_steps}", "trainer.devices=1", "strategy.stage=2", "trainer.precision=32-true"]
    cmd += ["data.max_documents=40", "data.block_size=32", "data.batch_size=2", f"run_dir={run_dir}"]
    cmd += ["checkpoints.every_n_steps=1", "checkpoints.keep_last=2", "trainer.limit_val_batches=0"]
    cmd += ["trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "export.enabled=false"]
    cmd += ["logging.tensorboard=false"]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if kill_at is None:
        return subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=540)
    log = open(run_dir.parent / "killed.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, cwd=run_dir.parent, env=env, stdout=log, stderr=subprocess.STDOUT)
    marker = run_dir / "checkpoints" / f"step-{kill_at:06d}" / MANIFEST
    deadline = time.monotonic() + 540  # a liveness bound, not a speed expectation
    # killed once checkpoint `kill_at` is complete and the row of its last step is in this attempt's file (a kill
    # between the two would lose that row, whatever the logger does: the row is logged after the checkpoint)
    while not (marker.is_file() and _logged(run_dir, kill_at - 1)) and proc.poll() is None:
        assert time.monotonic() < deadline, (run_dir.parent / "killed.log").read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
    assert marker.is_file(), (run_dir.parent / "killed.log").read_text()[-3000:]
    return None


def _logged(run_dir: Path, step: int) -> bool:
    """Whether the newest attempt's metrics file already holds the training row of `step`."""
    try:
        rows = read_metrics(run_dir)
    except Exception:  # a file being created or a row being written: ask again (bounded by the caller)
        return False
    newest = max((r["attempt"] for r in rows), default=0)
    return any(r["attempt"] == newest and r["step"] == step and r.get("train_loss") is not None for r in rows)


@pytest.mark.slow
def test_three_attempts_keep_every_row_and_two_checkpoints(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _train(run_dir, 3)
    assert first is not None and first.returncode == 0, first.stderr[-3000:]
    _train(run_dir, 8, kill_at=5)
    last = _train(run_dir, 8)
    assert last is not None and last.returncode == 0, last.stderr[-3000:]

    logs = run_dir / "logs"
    assert [(n, p.name) for n, p in attempt_files(logs)] == [
        (1, "metrics.csv"),
        (2, "metrics.attempt-2.csv"),
        (3, "metrics.attempt-3.csv"),
    ]
    rows = read_metrics(run_dir)
    steps = {a: [r["step"] for r in rows if r["attempt"] == a and r.get("train_loss") is not None] for a in (1, 2, 3)}
    assert steps[1] == [0, 1, 2]  # attempt 1's rows survive the two resumes
    assert steps[2][0] == 3  # the killed attempt's rows (it logs each step after that step's checkpoint)
    assert steps[3][-1] == 7 and steps[3][0] >= 5  # the last attempt resumed where attempt 2's checkpoint left off
    assert set(steps[1] + steps[2] + steps[3]) == set(range(8))  # no step of the run is missing from the history
    assert all(isinstance(r["train_loss"], float) for r in rows if r.get("train_loss") is not None)

    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step-000007", "step-000008"], ckpts  # keep_last=2 over every attempt's checkpoints


def test_each_attempt_gets_its_own_file_and_a_new_column_keeps_the_rows(tmp_path: Path) -> None:
    from lt_plugins.metrics_csv import AttemptCSVLogger

    first = AttemptCSVLogger(tmp_path)
    first.log_metrics({"train_loss": 4.0}, step=0)
    first.log_metrics({"train_loss": 3.5, "val_loss": 3.9}, step=1)  # a new column: the file is rewritten
    assert first.metrics_file == tmp_path / "logs" / "metrics.csv"
    second = AttemptCSVLogger(tmp_path)  # a resume: Lightning's CSVLogger deleted metrics.csv here
    second.log_metrics({"train_loss": 3.4}, step=1)
    third = AttemptCSVLogger(tmp_path)
    third.log_hyperparams({"lr": 1e-3})  # starts the attempt; killed before its first row
    assert third.metrics_file == tmp_path / "logs" / "metrics.attempt-3.csv" and third.metrics_file.stat().st_size == 0
    assert read_metrics(tmp_path) == [
        {"step": 0, "train_loss": 4.0, "val_loss": None, "attempt": 1},
        {"step": 1, "train_loss": 3.5, "val_loss": 3.9, "attempt": 1},
        {"step": 1, "train_loss": 3.4, "attempt": 2},
    ]
    assert not list((tmp_path / "logs").glob(".*tmp"))  # the header rewrite left no temporary file
