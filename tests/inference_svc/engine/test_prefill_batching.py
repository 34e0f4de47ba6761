"""The CPU path's prefill attention batches a step's short fresh chunks of one length into one call: the same bits
as a call per chunk, beside chunks it does not batch (a cached prefix, another length, a long chunk), over scattered
and consecutive blocks; and the fp64 reference's values."""

from __future__ import annotations

import pytest
import torch

from inference_svc.attention import reference
from inference_svc.attention.torch_ops import BATCH_PREFILL_MAX_TOKENS, TorchOps

BS = 16


def _step(chunks: list[tuple[int, int]], dtype: torch.dtype, hq: int = 12, hkv: int = 4, d: int = 64, seed: int = 0):
    """A cache whose sequences (context length, chunk length) own scattered blocks (the first consecutively)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-ctx // BS) for ctx, _ in chunks]
    pool = 2 * sum(need) + 4
    k_cache = torch.randn(pool, BS, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(pool, BS, hkv, d, generator=g).to(dtype)
    order = torch.randperm(pool - need[0], generator=g).add(need[0]).tolist()
    tables = torch.zeros(len(chunks), max(need) + 1, dtype=torch.int32)
    tables[0, : need[0]] = torch.arange(need[0], dtype=torch.int32)  # consecutive: read as a view
    for i, n in enumerate(need[1:], start=1):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    q_lens = [n for _, n in chunks]
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor([c for c, _ in chunks], dtype=torch.int32)
    return q, k_cache, v_cache, cu, ctx, tables


def _one_call_per_chunk(q, k_cache, v_cache, cu, ctx, tables, scale):
    parts = []
    for i in range(len(ctx)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        one = torch.tensor([0, hi - lo], dtype=torch.int32)
        alone = TorchOps().prefill_attention(q[lo:hi], k_cache, v_cache, one, ctx[i : i + 1], tables[i : i + 1], scale)
        parts.append(alone)
    return torch.cat(parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_chunks_are_the_bits_of_one_call_each(dtype: torch.dtype) -> None:
    long = BATCH_PREFILL_MAX_TOKENS + 1
    # fresh chunks of 32 (four: one batch, the first on consecutive blocks), of 7 (two: another), a lone 20, a
    # chunk after a cached prefix (never batched) and a long fresh chunk (run alone)
    chunks = [(32, 32), (7, 7), (32, 32), (50, 18), (32, 32), (20, 20), (7, 7), (long, long), (32, 32)]
    q, k_cache, v_cache, cu, ctx, tables = _step(chunks, dtype)
    ops = TorchOps()
    out = ops.prefill_attention(q, k_cache, v_cache, cu, ctx, tables, 0.125)
    assert [len(b.members) for b in ops._prefill_batches] == [4, 2]  # the 32s and the 7s
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.equal(out, _one_call_per_chunk(q, k_cache, v_cache, cu, ctx, tables, 0.125))
    want = reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu, ctx, tables, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - want).abs().max() <= tol * max(want.abs().max().item(), 1.0)


def test_a_batch_plan_is_kept_for_the_step_and_replaced_with_the_next() -> None:
    q, k_cache, v_cache, cu, ctx, tables = _step([(16, 16), (16, 16)], torch.float32)
    ops = TorchOps()
    first = ops.prefill_attention(q, k_cache, v_cache, cu, ctx, tables, 0.125)
    batch = ops._prefill_batches[0]
    assert torch.equal(ops.prefill_attention(q, k_cache, v_cache, cu, ctx, tables, 0.125), first)
    assert ops._prefill_batches[0] is batch  # the same metadata tensors: the same plan (every layer of a step)
    q2, k2, v2, cu2, ctx2, tables2 = _step([(9, 9), (9, 9), (9, 9)], torch.float32, seed=1)
    out = ops.prefill_attention(q2, k2, v2, cu2, ctx2, tables2, 0.125)
    assert len(ops._prefill_batches[0].members) == 3
    assert torch.equal(out, _one_call_per_chunk(q2, k2, v2, cu2, ctx2, tables2, 0.125))
