"""Triton split-KV paged decode vs the fp64 reference (interpreter on CPU; CUDA when present).

Covers context lengths 1..600 (non-multiples of the block sizes), split-KV off (1), on (2..7, including splits
left empty for short sequences in a batch with long ones) and chosen from the lengths (None), GQA ratios 1, 2, 3,
4, 8, head_dim 16, 24, 64, 80, 128, block sizes 16 and 32, fp32 / fp16 / bf16, NaN-poisoned unused cache slots.
"""

from __future__ import annotations

import random

import pytest
import torch

from inference_svc.attention import reference
from inference_svc.attention import triton as kernels
from inference_svc.attention.triton import configs

# (context_lens, Hq, Hkv, head_dim, block_size, dtype, num_splits)
CASES = [
    pytest.param([1, 17, 600, 64], 2, 2, 16, 16, torch.float32, 1, id="g1-d16-nosplit"),
    pytest.param([1, 17, 600, 64], 2, 2, 16, 16, torch.float32, 4, id="g1-d16-split4-empty-splits"),
    pytest.param([33, 300], 4, 2, 24, 32, torch.float32, 7, id="g2-d24-split7"),
    pytest.param([599, 3, 257], 6, 2, 80, 32, torch.float16, None, id="g3-d80-auto"),
    pytest.param([129, 500], 8, 2, 64, 16, torch.float16, 2, id="g4-d64-split2"),
    pytest.param([450, 1], 8, 1, 128, 16, torch.bfloat16, 3, id="g8-d128-bf16-split3"),
]


@pytest.mark.parametrize(("context_lens", "hq", "hkv", "head_dim", "block_size", "dtype", "num_splits"), CASES)
def test_decode_matches_reference(
    paged_case, within_tolerance, context_lens, hq, hkv, head_dim, block_size, dtype, num_splits
) -> None:
    c = paged_case(context_lens, [1] * len(context_lens), hq, hkv, head_dim, block_size, dtype)
    args = (c.context_lens, c.block_tables, c.scale)
    out = kernels.decode_attention(c.q, c.k_cache, c.v_cache, *args, num_splits=num_splits)
    assert out.shape == c.q.shape and out.dtype == dtype
    truth = reference.decode_attention(c.q.double(), c.k_cache.double(), c.v_cache.double(), *args)
    same = reference.decode_attention(c.q, c.k_cache, c.v_cache, *args)
    within_tolerance(out, truth, same, f"decode splits={num_splits}")


def test_split_and_unsplit_agree(paged_case) -> None:
    """The merge of partial softmaxes reproduces the single-pass result (fp32, to rounding)."""
    c = paged_case([555, 90], [1, 1], 4, 4, 64, 16, torch.float32, seed=5)
    args = (c.q, c.k_cache, c.v_cache, c.context_lens, c.block_tables, c.scale)
    one = kernels.decode_attention(*args, num_splits=1)
    many = kernels.decode_attention(*args, num_splits=5)
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-6)


def test_decode_equals_last_row_of_prefill(paged_case) -> None:
    """Decode for one token equals prefill's row for a 1-token chunk at the same position."""
    c = paged_case([200], [1], 4, 1, 24, 32, torch.float32, seed=7)
    dec = kernels.decode_attention(c.q, c.k_cache, c.v_cache, c.context_lens, c.block_tables, c.scale, 2)
    pre = kernels.prefill_attention(c.q, c.k_cache, c.v_cache, c.cu_seqlens_q, c.context_lens, c.block_tables, c.scale)
    torch.testing.assert_close(dec, pre, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, None, 8])
def test_decode_cuda_half(paged_case, within_tolerance, dtype, num_splits) -> None:
    c = paged_case([1, 4097, 300, 8000], [1] * 4, 32, 8, 128, 16, dtype, device="cuda")
    args = (c.context_lens, c.block_tables, c.scale)
    out = kernels.decode_attention(c.q, c.k_cache, c.v_cache, *args, num_splits=num_splits)
    truth = reference.decode_attention(c.q.double(), c.k_cache.double(), c.v_cache.double(), *args)
    same = reference.decode_attention(c.q, c.k_cache, c.v_cache, *args)
    within_tolerance(out, truth, same, f"decode cuda {dtype} splits={num_splits}")
    assert configs.decode_num_splits(4, 8, 8000, 264) > 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_random_batches(paged_case, within_tolerance, seed) -> None:
    """Seeded random batches: 1-6 sequences, contexts 1..600, random GQA ratio / head_dim / block size / dtype /
    split count (including the length-based default)."""
    rng = random.Random(100 + seed)
    contexts = [rng.randint(1, 600) for _ in range(rng.randint(1, 6))]
    hkv, group = rng.choice([1, 2]), rng.choice([1, 2, 3, 4, 8])
    head_dim, block_size = rng.choice([16, 24, 64, 80, 128]), rng.choice([16, 32])
    dtype, splits = rng.choice([torch.float32, torch.float16]), rng.choice([None, 1, 2, 3, 6])
    c = paged_case(contexts, [1] * len(contexts), hkv * group, hkv, head_dim, block_size, dtype, seed=seed)
    args = (c.context_lens, c.block_tables, c.scale)
    out = kernels.decode_attention(c.q, c.k_cache, c.v_cache, *args, num_splits=splits)
    truth = reference.decode_attention(c.q.double(), c.k_cache.double(), c.v_cache.double(), *args)
    same = reference.decode_attention(c.q, c.k_cache, c.v_cache, *args)
    what = f"contexts={contexts} Hq={hkv * group} Hkv={hkv} D={head_dim} bs={block_size} {dtype} splits={splits}"
    within_tolerance(out, truth, same, what)
