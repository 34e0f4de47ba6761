"""Paged attention for the engine: step metadata, the KV cache, and the torch backend.

Contract:
- KV cache layout (shared with the Triton kernels): per layer `k_cache, v_cache: [num_blocks, block_size, Hkv, D]`.
  Token slot = block_id * block_size + offset. Block tables are int32 `[S, max_blocks]` padded with 0.
- One engine step is one flat batch of T tokens: the D decode tokens first (one per sequence), then the prefill
  chunks of P sequences back to back. `AttentionMetadata` describes it explicitly; a backend object is built per
  step from (cache, metadata) and reads no other state.
- Per layer the backend first stores this step's K/V at `slot_mapping` (each token's K/V written exactly once),
  then attends: decode queries over their sequence's cached context, prefill queries causally over the cached
  prefix plus the chunk (`context_lens` = cached prefix + chunk length).
- Shapes follow `shared_model.attention`: q `[1, T, Hq, D]`, k, v `[1, T, Hkv, D]`, output `[1, T, Hq, D]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVCache:
    """All layers' paged K/V: `data[layer, 0|1]` is `[num_blocks, block_size, Hkv, D]`.

    Per-layer views are made once here (not per step or per layer call): `layer(i)` gives the block views,
    `flat(i)` the same memory as `[num_blocks * block_size, Hkv, D]` slot rows.
    """

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data  # [L, 2, num_blocks, block_size, Hkv, D]
        self._layers = [(data[i, 0], data[i, 1]) for i in range(data.shape[0])]
        hkv, dim = data.shape[-2], data.shape[-1]
        self._flat = [(k.view(-1, hkv, dim), v.view(-1, hkv, dim)) for k, v in self._layers]
        self._pairs = [data[i] for i in range(data.shape[0])]  # [2, num_blocks, block_size, Hkv, D]

    @classmethod
    def allocate(
        cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device
    ) -> KVCache:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def flat(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._flat[i]

    def pair(self, i: int) -> torch.Tensor:
        """Layer i's K and V blocks as one `[2, num_blocks, block_size, Hkv, D]` view (one gather reads both)."""
        return self._pairs[i]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step. Tensors on the model device; python mirrors for the CPU path."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = do not store
    num_decode_tokens: int  # D: tokens [0, D) are decodes, one per sequence
    decode_context_lens: torch.Tensor  # [D] int32 (includes the token being decoded)
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [P+1] int32, offsets into the prefill tokens (which start at D)
    prefill_context_lens: torch.Tensor  # [P] int32 = cached prefix + chunk length
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    # Python mirrors (no device sync needed to read them)
    decode_lens_list: list[int]
    prefill_q_lens_list: list[int]
    prefill_context_lens_list: list[int]
    prefill_block_lists: list[list[int]]
    decode_block_lists: list[list[int]]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_q_lens_list)


class TorchPagedAttention:
    """The CPU (and fallback) backend: plain torch ops over the paged cache.

    Decode gathers each sequence's blocks once per layer (`index_select`) into a padded `[D, Lmax]` tensor and runs SDPA
    with a length mask built once per step; a single sequence whose blocks are consecutive is read as a slice of the
    cache, without a copy, and a single sequence over scattered blocks by one gather of its K and V cut to its length.
    Prefill attends over the chunk's own K/V when nothing is cached before it, else over its gathered context.
    """

    def __init__(self, cache: KVCache, meta: AttentionMetadata) -> None:
        self.cache = cache
        self.meta = meta
        bs = cache.data.shape[3]
        self.block_size = bs
        self._decode_plan = _plan_decode(meta, bs, cache.data.device) if meta.num_decode_tokens else None
        self._prefill_plans = [
            _plan_prefill(blocks, q_len, ctx, bs, cache.data.device)
            for blocks, q_len, ctx in zip(
                meta.prefill_block_lists, meta.prefill_q_lens_list, meta.prefill_context_lens_list, strict=True
            )
        ]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [1, T, Hq, D]; k, v: [1, T, Hkv, D]
        k_cache, v_cache = self.cache.layer(layer_idx)
        k_flat, v_flat = self.cache.flat(layer_idx)
        q, k, v = q[0], k[0], v[0]
        k_flat.index_copy_(0, self.meta.slot_mapping, k)  # each token's K/V written once, at its slot
        v_flat.index_copy_(0, self.meta.slot_mapping, v)
        d = self.meta.num_decode_tokens
        if d == q.shape[0]:  # a decode-only step
            return self._decode(layer_idx, q, k_cache, v_cache, k_flat, v_flat, scale)[None]
        parts: list[torch.Tensor] = []
        if d:
            parts.append(self._decode(layer_idx, q[:d], k_cache, v_cache, k_flat, v_flat, scale))
        start = d
        for plan in self._prefill_plans:
            end = start + plan.q_len
            parts.append(_prefill_one(plan, q[start:end], k[start:end], v[start:end], k_cache, v_cache, scale))
            start = end
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return out[None]  # [1, T, Hq, D]

    def _decode(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [S, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        k_flat: torch.Tensor,  # the same memory as [slots, Hkv, D]
        v_flat: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        plan = self._decode_plan
        assert plan is not None
        s, hq, dim = q.shape
        hkv = k_cache.shape[2]
        if plan.contiguous is not None:  # one sequence, consecutive blocks: a view of the cache, no copy
            lo, hi = plan.contiguous
            keys = k_flat[None, lo:hi]  # [1, L, Hkv, D]
            values = v_flat[None, lo:hi]
        elif plan.length is not None:  # one sequence, scattered blocks: one gather of K and V, cut to its length
            kv = self.cache.pair(layer_idx).index_select(1, plan.block_index)  # [2, nb, block_size, Hkv, D]
            keys = kv[0].view(1, -1, hkv, dim)[:, : plan.length]  # [1, L, Hkv, D]
            values = kv[1].view(1, -1, hkv, dim)[:, : plan.length]
        else:
            keys = k_cache.index_select(0, plan.block_index).view(s, -1, hkv, dim)  # [S, Lmax, Hkv, D]
            values = v_cache.index_select(0, plan.block_index).view(s, -1, hkv, dim)
        # One query per sequence: fold the GQA group into the query axis, so each KV head is read once and
        # SDPA sees [S, Hkv, G, D] queries against [S, Hkv, L, D] keys (no causal mask needed within a decode).
        out = F.scaled_dot_product_attention(
            q.view(s, hkv, hq // hkv, dim),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=plan.mask,  # [S, 1, 1, Lmax] or None
            scale=scale,
        )
        return out.reshape(s, hq, dim)  # [S, Hq, D]


@dataclass
class _DecodePlan:
    block_index: torch.Tensor | None  # [S * max_blocks] int64, the blocks of each sequence back to back
    mask: torch.Tensor | None  # [S, 1, 1, max_blocks*bs] bool
    contiguous: tuple[int, int] | None  # slot range of a single consecutive sequence
    length: int | None = None  # a single sequence over scattered blocks: its context length (no mask needed)


def _plan_decode(meta: AttentionMetadata, bs: int, device: torch.device) -> _DecodePlan:
    lens, tables = meta.decode_lens_list, meta.decode_block_lists
    if len(lens) == 1:
        blocks = tables[0][: -(-lens[0] // bs)]
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            return _DecodePlan(None, None, (blocks[0] * bs, blocks[0] * bs + lens[0]))
        return _DecodePlan(torch.tensor(blocks, dtype=torch.int64, device=device), None, None, lens[0])
    max_blocks = max(-(-n // bs) for n in lens)
    index = torch.zeros(len(lens), max_blocks, dtype=torch.int64)
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        nb = -(-n // bs)
        index[i, :nb] = torch.tensor(table[:nb], dtype=torch.int64)
    positions = torch.arange(max_blocks * bs)
    mask = positions[None, :] < torch.tensor(lens)[:, None]  # [S, Lmax]
    mask = None if bool(mask.all()) else mask[:, None, None, :].to(device)
    return _DecodePlan(index.view(-1).to(device), mask, None)


@dataclass
class _PrefillPlan:
    q_len: int
    context_len: int
    block_index: torch.Tensor | None  # [nb] int64; None when the chunk is the whole context
    mask: torch.Tensor | None  # [q_len, context_len] bool


def _plan_prefill(blocks: list[int], q_len: int, ctx: int, bs: int, device: torch.device) -> _PrefillPlan:
    if ctx == q_len:  # nothing cached before the chunk: plain causal attention over the chunk
        return _PrefillPlan(q_len, ctx, None, None)
    nb = -(-ctx // bs)
    index = torch.tensor(blocks[:nb], dtype=torch.int64, device=device)
    q_pos = torch.arange(ctx - q_len, ctx, device=device)
    mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
    return _PrefillPlan(q_len, ctx, index, mask)


def _prefill_one(
    plan: _PrefillPlan,
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [n, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    hkv, dim = k_cache.shape[2], k_cache.shape[3]
    if plan.block_index is None:
        keys, values, mask, causal = k, v, None, True
    else:
        keys = k_cache.index_select(0, plan.block_index).view(-1, hkv, dim)[: plan.context_len]  # [ctx, Hkv, D]
        values = v_cache.index_select(0, plan.block_index).view(-1, hkv, dim)[: plan.context_len]
        mask, causal = plan.mask, False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, Hq, n, D]
        keys.transpose(0, 1)[None],  # [1, Hkv, ctx, D]
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[1] != hkv,
    )
    return out[0].transpose(0, 1)  # [n, Hq, D]
