"""Addresses past 2^31 elements: block_id × block stride overflows int32 unless computed in 64 bits.

The cache is a real contiguous fp16 tensor of 2^31 + 2048 elements (4 GiB of virtual memory; `torch.empty` touches
no page, so only the few blocks used become resident). The sequences live in blocks ≥ 2^23, whose first element
sits at 2^23 × 256 ≥ 2^31. What it proves: every kernel (store, prefill, decode, merge) forms these addresses in
int64. In the interpreter integer tensors are numpy int32/int64 arrays that wrap like the GPU's 32-bit arithmetic:
with the decode kernel's block id left in int32 this test crashes (checked once by hand, segfault). What it does not
prove: anything about compiled GPU code generation beyond that typing. It runs in a subprocess so that a regression
shows as a failed test, not as a crashed pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

NEEDS_KERNELS = False  # runs its own process

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from inference_svc.attention import triton as kernels
    from inference_svc.attention import reference

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    bs, d = 16, 16
    num_blocks = 2**23 + 16  # × 256 elements per block = 2^31 + 4096 elements
    try:
        cache = torch.empty((num_blocks, bs, 1, d), dtype=torch.float16, device=dev)
    except (RuntimeError, MemoryError):
        sys.exit(77)  # not enough (virtual) memory here: skip
    assert cache.numel() > 2**31
    ctx = 200  # long enough for prefill's unmasked phase and its diagonal phase
    blocks = (torch.randperm(16, generator=torch.Generator().manual_seed(1))[:13] + 2**23).int().to(dev)
    assert int(blocks.min()) * cache.stride(0) >= 2**31
    slots = (blocks.long()[:, None] * bs + torch.arange(bs, device=dev)).flatten()[:ctx]
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(ctx, 1, d, generator=g).half().to(dev)
    kernels.store_kv(kv, kv, cache, cache, slots)  # k_cache and v_cache share the one big tensor
    assert torch.equal(cache.flatten(0, 1)[slots], kv), "store_kv wrote elsewhere"

    q = torch.randn(ctx, 4, d, generator=g).half().to(dev)
    cu = torch.tensor([0, ctx], dtype=torch.int32, device=dev)
    lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    tables = blocks[None]
    truth = reference.prefill_attention(q.float(), cache, cache, cu, lens, tables, 0.25).float()
    out = kernels.prefill_attention(q, cache, cache, cu, lens, tables, 0.25).float()
    assert (out - truth).abs().max() < 2e-3, "prefill read the wrong slots"
    for splits in (1, 2):
        dec = kernels.decode_attention(q[-1:], cache, cache, lens, tables, 0.25, splits).float()
        assert (dec - truth[-1:]).abs().max() < 2e-3, f"decode (splits={splits}) read the wrong slots"
    print("int64 addressing OK")
    """
)


def test_offsets_beyond_int32() -> None:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode == 77:
        pytest.skip("cannot reserve 4 GiB of virtual memory for the cache here")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "int64 addressing OK" in proc.stdout
