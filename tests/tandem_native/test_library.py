"""Tandem's one native library: one build shared by every clone of a commit, one op namespace, and no imports of
the packages that use it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tandem_native
from tandem_native import loader

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, path: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=path, env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_another_clone_of_the_same_sources_shares_the_build(tmp_path: Path) -> None:
    """The cache key covers the sources' text, not where they sit: a second checkout loads the first one's build
    (the bootstrap of a fresh clone used to rebuild for a minute and more)."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "tandem_native", clone / "tandem_native", ignore=shutil.ignore_patterns("__pycache__"))
    there = _run("from tandem_native import loader; print(loader.build_dir())", clone)
    assert there == str(loader.build_dir())
    (clone / "tandem_native" / "csrc" / "row_gemm.cpp").write_text("// changed\n")
    assert _run("from tandem_native import loader; print(loader.build_dir())", clone) != there


def test_it_imports_neither_package_that_uses_it() -> None:
    users = "('shared_model', 'inference_svc')"
    code = f"import sys, tandem_native; print([m for m in sys.modules if m.split('.')[0] in {users}])"
    assert _run(code, REPO) == "[]"


@pytest.mark.skipif(
    not tandem_native.available(), reason=f"the native library does not run here: {loader.unsupported()}"
)
def test_one_module_and_one_op_namespace() -> None:
    module = tandem_native.library()
    for fn in ("decode_attention", "store_kv", "decode_step", "truncation_thresholds", "sample_rows", "int8_gemv"):
        assert callable(getattr(module, fn)), fn
    for op in ("int8_gemv", "int4_gemv", "int4_dequantize", "row_gemm", "tile_gemm_int4", "paged_attention"):
        assert isinstance(getattr(torch.ops.tandem, op), torch._ops.OpOverloadPacket), op
    ok, why = tandem_native.status()
    assert ok and why.startswith("built for this CPU")
