"""Triton varlen causal prefill over the paged cache vs the fp64 reference (interpreter on CPU; CUDA when present).

The sweep is small on purpose (each interpreted launch runs every program in Python), but together the cases
cover: context lengths 1..600 incl. non-multiples of the block size, chunks with and without a cached prefix, an
empty chunk, GQA ratios 1, 2, 3, 4, 8, head_dim 16, 24, 64, 80, 96, 128, 256, block sizes 16 and 32, random
non-contiguous block tables with NaN everywhere a kernel must not read, and fp32 / fp16 / bf16.
"""

from __future__ import annotations

import random

import pytest
import torch

from inference_svc.attention import reference
from inference_svc.attention import triton as kernels

# (context_lens, q_lens, Hq, Hkv, head_dim, block_size, dtype)
CASES = [
    pytest.param([1], [1], 1, 1, 16, 16, torch.float32, id="one-token"),
    pytest.param([37, 600, 5], [37, 600, 5], 4, 4, 64, 16, torch.float32, id="full-prefill-g1-d64"),
    pytest.param([100, 333, 17], [7, 64, 17], 4, 2, 24, 32, torch.float32, id="prefix-chunks-g2-d24"),
    pytest.param([600, 129, 48], [128, 1, 0], 6, 2, 80, 16, torch.float16, id="prefix-g3-d80-empty-chunk"),
    pytest.param([513, 48], [200, 48], 8, 2, 96, 32, torch.float16, id="g4-d96"),
    pytest.param([250, 31], [250, 30], 8, 1, 128, 32, torch.bfloat16, id="g8-d128-bf16"),
    pytest.param([70], [33], 2, 1, 256, 16, torch.float32, id="d256"),
]


@pytest.mark.parametrize(("context_lens", "q_lens", "hq", "hkv", "head_dim", "block_size", "dtype"), CASES)
def test_prefill_matches_reference(
    paged_case, within_tolerance, context_lens, q_lens, hq, hkv, head_dim, block_size, dtype
) -> None:
    c = paged_case(context_lens, q_lens, hq, hkv, head_dim, block_size, dtype)
    args = (c.cu_seqlens_q, c.context_lens, c.block_tables, c.scale)
    out = kernels.prefill_attention(c.q, c.k_cache, c.v_cache, *args)
    assert out.shape == c.q.shape and out.dtype == dtype
    truth = reference.prefill_attention(c.q.double(), c.k_cache.double(), c.v_cache.double(), *args)
    same = reference.prefill_attention(c.q, c.k_cache, c.v_cache, *args)
    within_tolerance(out, truth, same, "prefill")


def test_chunked_prefill_equals_one_shot(paged_case, device) -> None:
    """Splitting a 300-token prompt into chunks (prefix cache) gives the one-shot result for every chunk's rows."""
    c = paged_case([300], [300], 4, 2, 64, 16, torch.float32, seed=3)
    full = kernels.prefill_attention(c.q, c.k_cache, c.v_cache, c.cu_seqlens_q, c.context_lens, c.block_tables, c.scale)
    for lo, hi in ((0, 100), (100, 217), (217, 300)):
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=device)
        ctx = torch.tensor([hi], dtype=torch.int32, device=device)
        part = kernels.prefill_attention(c.q[lo:hi], c.k_cache, c.v_cache, cu, ctx, c.block_tables, c.scale)
        torch.testing.assert_close(part, full[lo:hi], rtol=1e-5, atol=1e-5)


def test_rejects_bad_shapes(paged_case) -> None:
    c = paged_case([20], [20], 3, 2, 16, 16, torch.float32)  # 3 query heads over 2 kv heads: not GQA
    with pytest.raises(ValueError, match="multiple"):
        kernels.prefill_attention(c.q, c.k_cache, c.v_cache, c.cu_seqlens_q, c.context_lens, c.block_tables, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "head_dim", "block_size"), [(8, 8, 128, 16), (32, 8, 128, 32), (12, 4, 80, 16)])
def test_prefill_cuda_half(paged_case, within_tolerance, dtype, hq, hkv, head_dim, block_size) -> None:
    c = paged_case([1000, 77, 2049], [1000, 13, 512], hq, hkv, head_dim, block_size, dtype, device="cuda")
    args = (c.cu_seqlens_q, c.context_lens, c.block_tables, c.scale)
    kernels.prefill_attention(c.q, c.k_cache, c.v_cache, *args)  # compile / autotune first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = kernels.prefill_attention(c.q, c.k_cache, c.v_cache, *args)
    torch.cuda.synchronize()
    # the only allocation is the output: no [tokens × tokens] scores (here ≥ 1525² × Hq × 4 bytes ≥ 74 MiB)
    assert torch.cuda.max_memory_allocated() - before <= out.numel() * out.element_size() + (1 << 20)
    truth = reference.prefill_attention(c.q.double(), c.k_cache.double(), c.v_cache.double(), *args)
    same = reference.prefill_attention(c.q, c.k_cache, c.v_cache, *args)
    within_tolerance(out, truth, same, f"prefill cuda {dtype}")


def test_prefill_small_tiles(paged_case, within_tolerance, monkeypatch) -> None:
    """The GPU-sized tiles (several query tiles per chunk, key tiles smaller than a cache block and spanning
    the unmasked and diagonal phases) give the same answer as the interpreter's large default tiles."""
    monkeypatch.setattr(
        "inference_svc.attention.triton.configs.prefill_config", lambda d, g, i: kernels.configs.PrefillConfig(32, 16)
    )
    c = paged_case([90, 41], [50, 41], 6, 2, 24, 32, torch.float32, seed=11)
    args = (c.cu_seqlens_q, c.context_lens, c.block_tables, c.scale)
    out = kernels.prefill_attention(c.q, c.k_cache, c.v_cache, *args)
    truth = reference.prefill_attention(c.q.double(), c.k_cache.double(), c.v_cache.double(), *args)
    within_tolerance(out, truth, reference.prefill_attention(c.q, c.k_cache, c.v_cache, *args), "small tiles")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefill_random_batches(paged_case, within_tolerance, seed) -> None:
    """Seeded random batches: 1-4 sequences, contexts 1..600, chunks from 0 to the whole context, random GQA
    ratio / head_dim / block size / dtype (printed on failure through the parameters below)."""
    rng = random.Random(seed)
    contexts = [rng.randint(1, 600) for _ in range(rng.randint(1, 4))]
    q_lens = [rng.choice([c, rng.randint(0, c), rng.randint(1, min(c, 8))]) for c in contexts]
    hkv, group = rng.choice([1, 2]), rng.choice([1, 2, 3, 4, 8])
    head_dim, block_size = rng.choice([16, 24, 64, 80, 128]), rng.choice([16, 32])
    dtype = rng.choice([torch.float32, torch.float16])
    c = paged_case(contexts, q_lens, hkv * group, hkv, head_dim, block_size, dtype, seed=seed)
    args = (c.cu_seqlens_q, c.context_lens, c.block_tables, c.scale)
    out = kernels.prefill_attention(c.q, c.k_cache, c.v_cache, *args)
    truth = reference.prefill_attention(c.q.double(), c.k_cache.double(), c.v_cache.double(), *args)
    same = reference.prefill_attention(c.q, c.k_cache, c.v_cache, *args)
    what = f"contexts={contexts} q_lens={q_lens} Hq={hkv * group} Hkv={hkv} D={head_dim} bs={block_size} {dtype}"
    within_tolerance(out, truth, same, what)
