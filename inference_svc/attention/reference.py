"""Plain-torch reference of the paged-KV attention ops: the contract's ground truth, and a CPU fallback.

Same signatures as the Triton kernels exported by `inference_svc.attention.triton`:

- `store_kv(k, v, k_cache, v_cache, slot_mapping)`: writes each token's K/V into its cache slot, in place.
- `prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)`: causal attention of
  packed query chunks against their sequences' cached keys (prefix + the chunk itself).
- `decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale, num_splits=None)`: one query token per
  sequence against all its cached keys (`num_splits` is accepted and ignored).

Layouts:
- k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`; token slot = block_id * block_size + offset.
- block_tables: int32 `[num_seqs, max_blocks_per_seq]`, padded past each sequence's last block (never read).
- Query head h uses kv head h // (Hq // Hkv).
- Scaled caches (fp8, int8): every op also takes `k_scales, v_scales` `[num_blocks, Hkv]` fp32 (None: unscaled);
  `store_kv` writes through `kv_quant.store_scaled`, the attention ops dequantize the gathered blocks
  (`kv_quant.dequantize`) before casting them to q's dtype.

Precision: everything is computed in the inputs' dtype (scores, softmax, weighted sum). This is deliberate: called
with fp64 copies it is the ground truth; called with the kernels' own dtype it is "torch in the same precision",
the baseline of FlashAttention's tolerance pattern. It materializes a [q_len × context] score matrix per sequence:
it is a reference, not a fast path. Lengths are read on the host (one device sync per call).
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference_svc.attention.kv_quant import as_bytes, dequantize, store_scaled


def store_kv(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
) -> None:
    """Write k, v `[T, Hkv, D]` into the caches at `slot_mapping` `[T]` (int64; a slot < 0 skips that token,
    except in a scaled cache, whose slots must all be ≥ 0)."""
    if k_scales is not None and v_scales is not None:
        store_scaled(k, k_cache, k_scales, slot_mapping)
        store_scaled(v, v_cache, v_scales, slot_mapping)
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # [num_blocks, block_size, Hkv, D] -> [num_slots, Hkv, D] (a view: the caches are contiguous)
    k_cache.flatten(0, 1)[slots] = k[keep].to(k_cache.dtype)
    v_cache.flatten(0, 1)[slots] = v[keep].to(v_cache.dtype)


def gather_kv(cache: Tensor, block_table: Tensor, length: int, scales: Tensor | None = None) -> Tensor:
    """The first `length` tokens of one sequence from a paged cache: `[length, Hkv, D]` (fp32 when scaled)."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    blocks = block_table[:n_blocks].long()
    data = as_bytes(cache)[blocks].view(cache.dtype)  # [n_blocks, block_size, Hkv, D]
    if scales is not None:
        data = dequantize(data, scales[blocks][:, None, :, None])
    return data.flatten(0, 1)[:length]


def _attend(q: Tensor, k: Tensor, v: Tensor, first_pos: int, scale: float) -> Tensor:
    """Causal attention of q `[n, Hq, D]` at positions first_pos.. over k, v `[ctx, Hkv, D]`; returns `[n, Hq, D]`."""
    n, hq, _ = q.shape
    ctx, hkv, _ = k.shape
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)  # [ctx, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, n, ctx]
    q_pos = torch.arange(n, device=q.device) + first_pos
    k_pos = torch.arange(ctx, device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]  # [n, ctx]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
) -> Tensor:
    """Causal attention for packed chunks q `[T, Hq, D]`; query j of sequence s sits at ctx_s - q_len_s + j."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for s, ctx in enumerate(lens):
        lo, hi = cu[s], cu[s + 1]
        if hi == lo:
            continue
        k = gather_kv(k_cache, block_tables[s], ctx, k_scales).to(q.dtype)
        v = gather_kv(v_cache, block_tables[s], ctx, v_scales).to(q.dtype)
        out[lo:hi] = _attend(q[lo:hi], k, v, ctx - (hi - lo), scale)
    return out


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    context_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    num_splits: int | None = None,
    k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
) -> Tensor:
    """One query per sequence, q `[S, Hq, D]`, attending to keys 0..context_lens[s]-1; returns `[S, Hq, D]`."""
    del num_splits  # a kernel tuning knob; the reference has nothing to split
    s = q.shape[0]
    cu = torch.arange(s + 1, dtype=torch.int32, device=q.device)
    return prefill_attention(q, k_cache, v_cache, cu, context_lens, block_tables, scale, k_scales, v_scales)
