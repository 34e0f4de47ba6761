"""A rerun of a finished `tandem train` run ends with a current bundle (issue 16, item 3).

One real run (one process, ZeRO-2, 2 steps, a checkpoint each step, export on) is made once per module; each test
works on a copy. Rerunning the same command resumes from the final checkpoint, so Lightning's `fit` trains nothing
and the end-of-training export never fires: the bundle must still be exported when it is missing (the whole command
is rerun: exit 0, `bundle: PATH` last) or stale (made from step-000001; `ExportBundle.ensure`, what the rerun calls
after fit), and a current bundle must be left untouched (mtimes unchanged).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lt_plugins.checkpoint_io import MANIFEST
from lt_plugins.cli import export_main
from lt_plugins.export.bundle import ExportBundle, bundle_staleness
from shared_model.bundle import MANIFEST_FILE, load_bundle, read_source
from tests.conftest import free_port

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def _train(run_dir: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(REPO / "configs/tiny-cpu.yaml")]
    cmd += ["trainer.max_steps=2", "trainer.devices=1", "strategy.stage=2", "trainer.precision=32-true"]
    cmd += ["data.max_documents=40", "data.block_size=32", "data.batch_size=2", f"run_dir={run_dir}"]
    cmd += ["checkpoints.every_n_steps=1", "checkpoints.keep_last=2", "trainer.limit_val_batches=0"]
    cmd += ["export.dtype=float32", "trainer.enable_progress_bar=false"]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("reexport") / "run"
    proc = _train(run_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == f"bundle: {run_dir / 'bundle'}"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    return run_dir


@pytest.fixture
def run(pristine_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine_run, tmp_path / "run", symlinks=True))


def _weights_sha(bundle: Path) -> str:
    return json.loads((bundle / MANIFEST_FILE).read_text())["files"]["model.safetensors"]["sha256"]


def _rerun_exports(run: Path, why: str) -> None:
    proc = _train(run)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == f"bundle: {run / 'bundle'}"
    assert f"bundle {run / 'bundle'} is {why}: exporting step-000002" in proc.stderr, proc.stderr[-3000:]
    assert "Restored all states from the checkpoint" in proc.stderr  # it resumed: nothing was trained
    assert not (run / "checkpoints" / "step-000003").exists()


def test_the_end_of_training_export_records_its_checkpoint(pristine_run: Path) -> None:
    source = read_source(pristine_run / "bundle")
    assert source is not None and source["format"] == "bundle" and source["checkpoint"] == "step-000002"
    assert bundle_staleness(pristine_run / "bundle", pristine_run / "checkpoints" / "step-000002") is None
    assert "exported from step-000002" in str(
        bundle_staleness(pristine_run / "bundle", pristine_run / "checkpoints" / "step-000001")
    )


def test_a_deleted_bundle_is_exported_by_the_rerun(run: Path, pristine_run: Path) -> None:
    shutil.rmtree(run / "bundle")
    _rerun_exports(run, "missing")
    assert read_source(run / "bundle")["checkpoint"] == "step-000002"  # type: ignore[index]
    assert _weights_sha(run / "bundle") == _weights_sha(pristine_run / "bundle")  # the same weights as at the end
    loaded = load_bundle(run / "bundle", verify_checksums=True)
    assert loaded.tokenizer is not None


def test_a_stale_bundle_is_reexported(run: Path, pristine_run: Path) -> None:
    # what the rerun calls after fit (the deleted-bundle test above runs the whole command; this one calls the same
    # ExportBundle.ensure directly, to keep the test time down)
    ckpt1 = run / "checkpoints" / "step-000001"
    assert export_main([str(ckpt1), str(run / "bundle"), "--dtype", "float32", "--overwrite"]) == 0
    assert read_source(run / "bundle")["checkpoint"] == "step-000001"  # type: ignore[index]
    assert _weights_sha(run / "bundle") != _weights_sha(pristine_run / "bundle")
    ckpt2 = run / "checkpoints" / "step-000002"
    why = bundle_staleness(run / "bundle", ckpt2)
    assert why == "exported from step-000001, not the newest checkpoint step-000002"
    export = ExportBundle(run / "checkpoints", run / "bundle", "float32", run / "model_meta")
    assert export.ensure() == (run / "bundle").resolve()
    assert read_source(run / "bundle")["checkpoint"] == "step-000002"  # type: ignore[index]
    assert _weights_sha(run / "bundle") == _weights_sha(pristine_run / "bundle")
    assert bundle_staleness(run / "bundle", ckpt2) is None


def test_a_current_bundle_is_left_untouched(run: Path) -> None:
    bundle = run / "bundle"
    before = {p.name: p.stat().st_mtime_ns for p in bundle.iterdir()}
    export = ExportBundle(run / "checkpoints", bundle, "float32", run / "model_meta")
    assert export.ensure() == bundle.resolve()
    assert {p.name: p.stat().st_mtime_ns for p in bundle.iterdir()} == before
    ckpt = run / "checkpoints" / "step-000002"
    assert bundle_staleness(bundle, ckpt, "bf16") == "in float32, not the configured bfloat16"  # export.dtype changed
    # a bundle written before provenance: current when newer than the checkpoint, stale when older
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    del manifest["source"]
    (bundle / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert bundle_staleness(bundle, ckpt) is None
    os.utime(ckpt / MANIFEST, ns=((bundle / MANIFEST_FILE).stat().st_mtime_ns + 10**9,) * 2)
    assert bundle_staleness(bundle, ckpt) == "older than step-000002 and without a record of its checkpoint"
    (bundle / "model.safetensors").write_bytes(b"truncated")
    assert bundle_staleness(bundle, ckpt) == "a file of it is missing or resized"
