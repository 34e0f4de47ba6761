"""`tandem export --overwrite` never deletes what is not a bundle (issue 15, item 1).

One real run (`tandem train`, one process, 2 steps, a checkpoint each step) is made once per module; each test
works on its own copy. A refusal must be one line on stderr, exit 2, and leave every file of the copy
byte-for-byte as it was; replacing an empty folder or an earlier bundle still works and writes a manifest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lt_plugins.cli import export_main
from lt_plugins.errors import CheckpointError
from lt_plugins.export.bundle import export_bundle
from shared_model.bundle import MANIFEST_FILE, load_bundle
from tests.conftest import free_port

pytestmark = [pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pristine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run folder: config.yaml, cache/, logs/, model_meta/, checkpoints/step-00000{1,2}, bundle/."""
    base = tmp_path_factory.mktemp("export-target")
    run_dir = base / "run"
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(REPO / "configs/tiny-cpu.yaml")]
    cmd += ["trainer.max_steps=2", "trainer.devices=1", "strategy.stage=2", "trainer.precision=32-true"]
    cmd += ["data.max_documents=40", "data.block_size=32", "data.batch_size=2", f"run_dir={run_dir}"]
    cmd += ["checkpoints.every_n_steps=1", "checkpoints.keep_last=2", "trainer.limit_val_batches=0"]
    cmd += ["export.dtype=float32", "trainer.enable_progress_bar=false"]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=base, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step-000001", "step-000002"]
    assert (run_dir / "bundle" / MANIFEST_FILE).is_file()  # the end-of-training export wrote <run>/bundle
    return run_dir


@pytest.fixture
def run(pristine_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine_run, tmp_path / "run", symlinks=True))


def _snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under root: relative path → SHA-256 (files) or 'dir' / 'link → target'."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = f"link → {os.readlink(p)}"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], root: Path) -> str:
    """Run `tandem export argv`; assert exit 2, one stderr line, nothing under root changed; return the line."""
    before = _snapshot(root)
    capsys.readouterr()
    code = export_main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("tandem export: error: refusing"), err
    assert _snapshot(root) == before
    return err


def test_exporting_onto_the_run_folder_is_refused(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused([str(run / "checkpoints"), str(run), "--overwrite"], capsys, run.parent)
    assert f"refusing to export to {run}" in err and "the run being read" in err
    assert {"config.yaml", "cache", "logs", "model_meta", "checkpoints", "bundle"} <= {p.name for p in run.iterdir()}


def test_exporting_onto_a_checkpoint_is_refused(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpts = run / "checkpoints"
    # the checkpoint being read, and another checkpoint of the same run
    err = _refused([str(ckpts / "step-000002"), str(ckpts / "step-000002"), "--overwrite"], capsys, run.parent)
    assert "is the checkpoint being exported" in err
    err = _refused([str(ckpts / "step-000001"), str(ckpts / "step-000002"), "--overwrite"], capsys, run.parent)
    assert "lies inside the checkpoints folder being read" in err
    err = _refused([str(run), str(ckpts / "step-000002" / "bundle"), "--overwrite"], capsys, run.parent)
    assert "lies inside the checkpoint being exported" in err


def test_a_folder_with_an_unrelated_file_is_refused(run: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    plain = tmp_path / "out"
    plain.mkdir()
    (plain / "notes.txt").write_text("mine\n")
    err = _refused([str(run), str(plain), "--overwrite"], capsys, tmp_path)
    assert f"refusing to overwrite {plain}" in err and "not a Tandem bundle" in err and "notes.txt" in err
    # a real bundle with one foreign file in it is not a bundle any more
    (run / "bundle" / "notes.txt").write_text("mine too\n")
    err = _refused([str(run), str(run / "bundle"), "--overwrite"], capsys, tmp_path)
    assert "notes.txt is not a file of the bundle" in err


def test_out_that_contains_the_run_or_points_at_it_is_refused(run: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    err = _refused([str(run), str(tmp_path), "--overwrite"], capsys, tmp_path)
    assert "contains" in err
    link = tmp_path / "link"
    link.symlink_to(run, target_is_directory=True)
    err = _refused([str(run), str(link), "--overwrite"], capsys, tmp_path)
    assert "is the run being read" in err
    with pytest.raises(CheckpointError, match="model description being read"):
        export_bundle(run, run / "model_meta", overwrite=True)


def test_an_earlier_bundle_or_an_empty_folder_is_replaced(run: Path, tmp_path: Path) -> None:
    old = (run / "bundle" / "model.safetensors").read_bytes()
    others = {k: v for k, v in _snapshot(run).items() if not k.startswith("bundle")}
    path = export_bundle(run / "checkpoints" / "step-000001", run / "bundle", dtype="bfloat16", overwrite=True)
    assert path == (run / "bundle").resolve()
    assert (path / "model.safetensors").read_bytes() != old
    assert load_bundle(path, dtype=None, verify_checksums=True).config.vocab_size > 0
    assert {k: v for k, v in _snapshot(run).items() if not k.startswith("bundle")} == others
    assert not [p for p in run.iterdir() if p.name.startswith(".")], "no temporary or old folder left behind"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_main([str(run), str(empty), "--overwrite"]) == 0
    assert (empty / MANIFEST_FILE).is_file()
