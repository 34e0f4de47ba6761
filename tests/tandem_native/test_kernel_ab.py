"""benchmarks/kernel_ab.py's source handling, without building: each kernel file it knows, read from the working
tree and from git, comes out with its ops under the side's namespace and without the module's registrations."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kernel", ["row_gemm", "int4_gemv"])
def test_a_kernel_file_gets_its_own_namespace_and_loses_its_pybind_registrations(kernel: str) -> None:
    ab = load_benchmark("kernel_ab")
    text = ab.source_at(None, f"{ab.CSRC}/{ab.KERNELS[kernel]}")
    out = ab.namespaced(text, "tandem_ab_new", kernel)
    assert "TORCH_LIBRARY_FRAGMENT(tandem_ab_new," in out and "TORCH_LIBRARY_IMPL(tandem_ab_new," in out
    assert "(tandem," not in out  # no op left in the library's own namespace: it would clash with the real one
    assert "void register_" not in out and "pybind11::module_" not in out
    ops = text.split("\nvoid register_")[0].count("m.def(")  # the library's ops (the pybind defs come after)
    assert ops > 0 and out.count("m.def(") == ops


def test_a_file_without_ops_is_refused_by_name() -> None:
    ab = load_benchmark("kernel_ab")
    with pytest.raises(SystemExit, match=re.escape("x.cpp at HEAD has no TORCH_LIBRARY_FRAGMENT(tandem, ...)")):
        ab.namespaced("int f() { return 1; }\n", "tandem_ab_base", "x.cpp at HEAD")


def test_the_baseline_is_read_from_git_with_the_headers_of_that_revision() -> None:
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    ab = load_benchmark("kernel_ab")
    assert "row_gemm" in ab.source_at("HEAD", f"{ab.CSRC}/row_gemm.cpp")
    headers = ab.headers_at("HEAD")
    assert {"tiles.h", "int4_layout.h", "line_aligned.h"} <= set(headers)
    assert all(name.endswith(".h") and "#pragma once" in body for name, body in headers.items())
