"""The one attention interface: the engine's torch ops and the plain reference, run under the same per-step
backend (`PagedAttention`) over tensor-only metadata, agree on a mixed step: decodes of different lengths over
scattered blocks, a lone decode over consecutive blocks, and prefill chunks with and without a cached prefix."""

from __future__ import annotations

import pytest
import torch

from inference_svc.attention.paged import AttentionMetadata, PagedAttention
from inference_svc.attention.torch_ops import torch_ops
from inference_svc.attention.triton_ops import reference_ops
from inference_svc.engine.kv_cache import KVCache

BS, HKV, HQ, D = 4, 2, 4, 16


def _tables(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)


def _meta(decodes: list[tuple[int, list[int]]], prefills: list[tuple[int, int, list[int]]]) -> AttentionMetadata:
    """decodes: (context_len, blocks); prefills: (q_len, context_len, blocks). Slots of this step's tokens."""
    slots = [blocks[(n - 1) // BS] * BS + (n - 1) % BS for n, blocks in decodes]
    cu = [0]
    for q_len, ctx, blocks in prefills:
        slots += [blocks[p // BS] * BS + p % BS for p in range(ctx - q_len, ctx)]
        cu.append(cu[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_tokens=len(decodes),
        decode_context_lens=torch.tensor([n for n, _ in decodes], dtype=torch.int32),
        decode_block_tables=_tables([b for _, b in decodes] or [[0]])[: len(decodes)],
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        prefill_context_lens=torch.tensor([c for _, c, _ in prefills], dtype=torch.int32),
        prefill_block_tables=_tables([b for _, _, b in prefills] or [[0]])[: len(prefills)],
    )


STEPS = {
    "mixed": (
        [(7, [9, 2]), (3, [5]), (12, [0, 14, 3])],  # decodes over scattered blocks, uneven lengths
        [(5, 5, [6, 7]), (3, 10, [10, 1, 11])],  # a fresh chunk (no prefix); a chunk after a cached prefix
    ),
    "lone-contiguous-decode": ([(10, [4, 5, 6])], []),
    "lone-scattered-decode": ([(10, [12, 1, 8])], []),
    "prefill-only": ([], [(6, 9, [2, 3, 4]), (4, 4, [13])]),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_torch_ops_match_the_reference_under_one_backend(name: str) -> None:
    decodes, prefills = STEPS[name]
    meta = _meta(decodes, prefills)
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(2, 2, 16, BS, HKV, D, generator=gen)  # 2 layers' K and V, 16 blocks
    t = meta.slot_mapping.shape[0]
    q, k, v = (torch.randn(1, t, h, D, generator=gen) for h in (HQ, HKV, HKV))
    outs = {}
    for ops in (torch_ops(), reference_ops()):
        cache = KVCache(data.clone())
        backend = PagedAttention(ops, cache, meta)
        outs[ops.name] = [backend(layer, q, k, v, D**-0.5) for layer in (0, 1)]  # the plan is reused by layer 1
        written = cache.data[0, 0].view(-1, HKV, D)[meta.slot_mapping]
        assert torch.equal(written, k[0])  # this step's K stored at its slots
    for got, want in zip(outs["torch"], outs["reference"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
