"""benchmarks/kernel_ab.py's source handling, without building: each kernel file it knows, read from the working
tree and from git, comes out with its ops under the side's namespace and without the module's registrations."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest
import torch

import tandem_native
from tandem_native import loader
from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kernel", ["row_gemm", "int4_gemv", "int8_gemv"])
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
    # row_gemm.cpp's table_gemm calls dot_gemm.cpp's kernel: built beside it, from the working tree and from git
    assert ab.companions_at(None, "row_gemm.cpp") == ab.companions_at("HEAD", "row_gemm.cpp") == ["dot_gemm.cpp"]
    assert ab.companions_at(None, "int8_gemv.cpp") == []
    headers = ab.headers_at("HEAD")
    assert {"tiles.h", "int4_layout.h", "line_aligned.h"} <= set(headers)
    assert all(name.endswith(".h") and "#pragma once" in body for name, body in headers.items())


@pytest.mark.skipif(
    not tandem_native.available(), reason=f"the native library does not run here: {loader.unsupported()}"
)
@pytest.mark.parametrize("kernel", ["row_gemm", "int4_gemv", "int8_gemv"])
def test_a_token_of_projections_runs_each_kernel_against_its_reference(kernel: str) -> None:
    """The timed token is what each kernel computes on a decoder's shapes (the library's own ops as a side): every
    projection's output matches the kernel's reference, and the LM head is there but for int4 (its model's is int8)."""
    ab = load_benchmark("kernel_ab")
    args = argparse.Namespace(hidden=128, intermediate=256, kv_size=64, layers=2, vocab=512)
    proj = ab.Projections(kernel, torch.bfloat16, args)
    assert len(proj.mats) == 4 * args.layers + (0 if kernel == "int4_gemv" else 1)
    assert proj.bytes > 0
    h, f, kv = args.hidden, args.intermediate, args.kv_size
    widths = {h + 2 * kv, h, 2 * f, args.vocab}  # qkv, o and down, gate_up, the LM head
    gen = torch.Generator().manual_seed(0)
    for operands, k in proj.mats:
        x = torch.randn(1, k, generator=gen).to(torch.bfloat16)  # [1, K]
        out, ref = proj.call(torch.ops.tandem, x, operands).float(), proj.reference(x, operands)
        assert out.shape == ref.shape and ref.shape[0] == 1 and ref.shape[1] in widths
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-3)
