"""A full disk, a read-only folder, a path through a file: `tandem train`'s checkpoint save and `tandem export` say
so in one line naming the path, exit 2, and leave nothing half-written (issue 34).

Real failures, no simulated ones: a small tmpfs mounted over the target (a full disk; remounted read-only for the
read-only case), `/dev/full` (ENOSPC on one file), RLIMIT_FSIZE in a subprocess (EFBIG), a path whose parent is a
regular file. Mounting needs privileges: the tests that need it skip, saying so, where `mount` is refused. Before
the fix: a 87-line trace ending "unexpected pos 6272 vs 6164" for the checkpoint, a raw traceback (safetensors'
"No space left on device", "Read-only file system", a misleading "File exists") for export.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lt_plugins.cli import export_main
from lt_plugins.write_errors import write_problem
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


def _train_cmd(run_dir: Path, steps: int) -> list[str]:
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(REPO / "configs/tiny-cpu.yaml")]
    cmd += [f"trainer.max_steps={steps}", "trainer.devices=1", "strategy.stage=2", "trainer.precision=32-true"]
    cmd += ["data.max_documents=40", "data.block_size=32", "data.batch_size=2", f"run_dir={run_dir}"]
    cmd += ["checkpoints.every_n_steps=1", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false"]
    cmd += ["export.dtype=float32", "logging.tensorboard=false"]
    return cmd


def _env() -> dict[str, str]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


class Tmpfs:
    """A tmpfs of `size` mounted on `path` (root only); `readonly()` remounts it read-only."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here to fill a disk for real: {proc.stderr.strip() or proc.returncode}")

    def readonly(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True, capture_output=True, timeout=30)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    if shutil.which("mount") is None:
        pytest.skip("no mount command: cannot fill a disk for real here")
    fs = Tmpfs(tmp_path / "small-disk", "2m")
    yield fs
    fs.unmount()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-process run of one step (its checkpoint of the tiny preset is tens of MB; the bundle ~20 MB)."""
    run_dir = tmp_path_factory.mktemp("write-errors") / "run"
    proc = subprocess.run(_train_cmd(run_dir, 1), cwd=run_dir.parent, env=_env(), capture_output=True, text=True,
                          timeout=540)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _export_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    code = export_main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("tandem export: error: "), err
    assert "Traceback" not in err
    return err


# ------------------------------------------------------------------------------------------ the message mapping
def test_a_write_to_dev_full_is_no_space_left_naming_the_path(tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with pytest.raises(OSError) as caught, open("/dev/full", "wb", buffering=0) as fh:
        fh.write(b"x" * 4096)
    assert caught.value.errno == errno.ENOSPC
    assert write_problem(caught.value, tmp_path / "out").startswith(f"no space left on {tmp_path / 'out'} (")


def test_errno_and_library_texts_map_to_one_line_each(tmp_path: Path) -> None:
    target = tmp_path / "out"
    (tmp_path / "file").write_text("x")
    cases = {
        OSError(errno.EROFS, "Read-only file system"): f"{target} is on a read-only file system",
        OSError(errno.EACCES, "Permission denied"): f"permission denied writing {target}",
        OSError(errno.EFBIG, "File too large"): f"file too large for {target}",
        RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"): "no space left on",
    }
    for exc, line in cases.items():
        assert (write_problem(exc, target) or "").startswith(line), (exc, write_problem(exc, target))
    in_the_way = write_problem(FileExistsError(errno.EEXIST, "File exists"), tmp_path / "file" / "out")
    assert in_the_way == f"{tmp_path / 'file'} is not a directory (it is a file on the path of {tmp_path}/file/out)"
    assert write_problem(FileExistsError(errno.EEXIST, "File exists"), target) is None  # a real "exists": not ours
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    assert write_problem(NotADirectoryError(errno.ENOTDIR, "x"), tmp_path / "gone" / "out") == (
        f"{tmp_path / 'gone'} is a broken symbolic link on the path of {tmp_path / 'gone' / 'out'}"
    )
    cleanup = FileNotFoundError(errno.ENOENT, "gone")  # a cleanup that failed while handling the full disk
    cleanup.__context__ = OSError(errno.ENOSPC, "No space left on device")
    assert (write_problem(cleanup, target) or "").startswith("no space left on")
    assert write_problem(ValueError("bad value"), target) is None
    # torch's zip writer keeps no errno: a full disk only if the file system is (nearly) full; this one is not
    assert write_problem(RuntimeError("[enforce fail] unexpected pos 6272 vs 6164"), tmp_path) is None


# ------------------------------------------------------------------------------------------ tandem export
@pytest.mark.slow
def test_export_onto_a_full_disk_says_so_and_leaves_nothing(run: Path, tmpfs: Tmpfs, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmpfs.path / "bundle"
    err = _export_error([str(run), str(out), "--dtype", "float32"], capsys)
    assert f"no space left on {out} (" in err, err
    assert list(tmpfs.path.iterdir()) == []  # the temporary folder was removed: nothing half-written


@pytest.mark.slow
def test_export_onto_a_read_only_folder_or_through_a_file_is_refused_first(run: Path, tmpfs: Tmpfs, capsys) -> None:  # type: ignore[no-untyped-def]
    tmpfs.readonly()
    out = tmpfs.path / "bundle"
    assert _export_error([str(run), str(out)], capsys) == (
        f"tandem export: error: refusing to export to {out}: {out} is on a read-only file system"
    )
    blocker = run.parent / "a-file"
    blocker.write_text("not a folder")
    for out in (blocker / "bundle", blocker / "deeper" / "bundle"):
        err = _export_error([str(run), str(out)], capsys)
        assert err.endswith(f"{blocker} is not a directory (it is a file on the path of {out})"), err
        assert "File exists" not in err
    assert blocker.read_text() == "not a folder"


@pytest.mark.slow
def test_export_past_the_file_size_limit_says_so(run: Path, tmp_path: Path) -> None:
    """RLIMIT_FSIZE (no privileges needed): the write fails with EFBIG, reported as a file size limit."""
    out = tmp_path / "bundle"

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal's default: killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))

    code = f"import sys; from lt_plugins.cli import export_main; sys.exit(export_main([{str(run)!r}, {str(out)!r}]))"
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=limit)  # fmt: skip
    err = [line for line in proc.stderr.splitlines() if "WARNING" not in line]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert err == [f"tandem export: error: cannot export to {out}, nothing was written: file too large for {out}: "
                   "the file system's or the process's file size limit (ulimit -f)"], err  # fmt: skip
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


# ------------------------------------------------------------------------------------------ tandem train
@pytest.mark.slow
def test_a_checkpoint_onto_a_full_disk_is_one_line_and_leaves_no_partial(tmp_path: Path) -> None:
    if shutil.which("mount") is None:
        pytest.skip("no mount command: cannot fill a disk for real here")
    run_dir = tmp_path / "run"
    fs = Tmpfs(run_dir / "checkpoints", "8m")  # a checkpoint of the tiny preset is tens of MB
    try:
        proc = subprocess.run(_train_cmd(run_dir, 2), cwd=tmp_path, env=_env(), capture_output=True, text=True,
                              timeout=540)  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        folder = re.escape(str(run_dir / "checkpoints"))
        expected = (
            f"tandem train: error: checkpoint step-000001 not saved: no space left on {folder} "
            r"\([0-9.]+ (B|KiB) free\); the partial step-000001 was removed; no complete checkpoint exists"
        )
        assert re.fullmatch(expected, last), proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "unexpected pos" not in proc.stderr
        assert list((run_dir / "checkpoints").iterdir()) == []  # no partial checkpoint takes the space
    finally:
        fs.unmount()
