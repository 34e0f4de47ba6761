"""Kernel-test setup: Triton's CPU interpreter, paged-cache case builders, and the FlashAttention tolerance check.

Triton fixes interpreter-vs-compiler for its language library when `triton` is first imported, from
TRITON_INTERPRET. Without CUDA this conftest sets TRITON_INTERPRET=1 before importing anything that imports triton.
If another test module already imported triton in compiled mode in this pytest process (torch._dynamo and
lightning both import it), the in-process kernel tests skip and `test_kernel_isolated.py` reruns this folder in a
fresh interpreter-mode subprocess, so the kernels are always checked exactly once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
"""Where the kernel tests put their tensors: on a CUDA machine the whole sweep runs compiled on the GPU."""
if not HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from inference_svc.attention.triton import configs  # noqa: E402  (after TRITON_INTERPRET is set)

IN_PROCESS = HAS_CUDA or configs.interpret_mode()
"""True when the Triton kernels can run in this pytest process."""


def _single_threaded_numpy_blas() -> None:
    """The interpreter runs every tl.dot through numpy's OpenBLAS on small tiles; on a busy 2-core machine its
    worker threads thrash (measured here: 3× slower kernel tests). Best effort, process-wide: numpy is already
    loaded, so OPENBLAS_NUM_THREADS would come too late; call the library's setter if it is the bundled one."""
    import ctypes
    from pathlib import Path

    import numpy

    for lib in (Path(numpy.__file__).parent.parent / "numpy.libs").glob("libscipy_openblas*.so"):
        dll = ctypes.CDLL(str(lib))
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            if hasattr(dll, name):
                getattr(dll, name)(1)
                return


if configs.interpret_mode():
    _single_threaded_numpy_blas()


@pytest.fixture(autouse=True)
def _kernels_run_in_process(request: pytest.FixtureRequest) -> None:
    """Skip kernel tests that cannot run here; modules that launch no kernel set NEEDS_KERNELS = False."""
    if not IN_PROCESS and getattr(request.module, "NEEDS_KERNELS", True):
        pytest.skip("triton was imported in compiled mode before this folder; test_kernel_isolated reruns it")


# Absolute error floor added to 2 × the torch same-precision error (FlashAttention's tolerance pattern).
ERROR_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@dataclass
class PagedCase:
    """Inputs of one paged-attention call. Block 0 and every unassigned block, and every slot past a sequence's
    length, hold NaN: a kernel that reads outside the lengths, or through the 0-padding of a block table, fails."""

    q: torch.Tensor  # [T, Hq, D] (prefill) or [S, Hq, D] (decode)
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    context_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, 0-padded
    scale: float


def make_case(
    context_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = DEVICE,
) -> PagedCase:
    """Random q and caches; each sequence gets a random, non-contiguous set of cache blocks."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [(c + block_size - 1) // block_size for c in context_lens]
    pool = 2 * sum(n_blocks) + 2  # spare blocks so the tables are scattered, not dense
    order = (torch.randperm(pool - 1, generator=g) + 1).tolist()  # block 0 is never assigned
    tables = torch.zeros(len(context_lens), max(max(n_blocks), 1) + 1, dtype=torch.int32)
    shape = (pool, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    for s, (ctx, nb) in enumerate(zip(context_lens, n_blocks, strict=True)):
        blocks = [order.pop() for _ in range(nb)]
        tables[s, :nb] = torch.tensor(blocks, dtype=torch.int32)
        for i, b in enumerate(blocks):
            used = min(block_size, ctx - i * block_size)
            k_cache[b, :used] = torch.randn(used, num_kv_heads, head_dim, generator=g)
            v_cache[b, :used] = torch.randn(used, num_kv_heads, head_dim, generator=g)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedCase(
        q=q.to(dtype).to(device),
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        cu_seqlens_q=cu.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        scale=head_dim**-0.5,
    )


def assert_within_tolerance(out: torch.Tensor, truth: torch.Tensor, same_precision: torch.Tensor, what: str) -> None:
    """Kernel error ≤ 2 × (torch same-precision error) + floor, all against the fp64 truth; finite everywhere."""
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = (out.double() - truth).abs().max().item()
    base = (same_precision.double() - truth).abs().max().item()
    bound = 2 * base + ERROR_FLOOR[out.dtype]
    assert err <= bound, f"{what}: max error {err:.3g} > 2 × torch {base:.3g} + floor = {bound:.3g}"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def paged_case() -> Callable[..., PagedCase]:
    return make_case


@pytest.fixture
def within_tolerance() -> Callable[..., None]:
    return assert_within_tolerance
