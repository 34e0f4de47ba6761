"""Paged attention for the engine: step metadata, the KV cache, the one backend, and the torch ops.

Contract:
- KV cache layout (shared with the Triton kernels): per layer `k_cache, v_cache: [num_blocks, block_size, Hkv, D]`.
  Token slot = block_id * block_size + offset. Block tables are int32 `[S, max_blocks]` padded with 0.
- One engine step is one flat batch of T tokens: the D decode tokens first (one per sequence), then the prefill
  chunks of P sequences back to back. `AttentionMetadata` describes it with tensors only (and the count D).
- One backend for every implementation: `PagedAttention(ops, cache, meta)` is built per step; per layer it stores
  this step's K/V at `slot_mapping` (each token's K/V written exactly once), then calls the ops' decode attention
  on the D decode queries (each over its sequence's cached context) and their prefill attention on the packed
  chunks (causal over the cached prefix plus the chunk). The ops are an `AttentionOps`: the Triton kernels, the
  plain reference (`inference_svc.kernels.reference`), or `torch_ops()` here, the CPU path.
- `torch_ops()` plans each step once (which blocks to gather, the length mask, whether a lone sequence's blocks
  are consecutive so its cache is read as a view): the plan is derived from the metadata tensors, kept for the
  tensors it was derived from (the same objects in every layer of a step), and replaced when new ones arrive.
- Shapes follow `shared_model.attention`: q `[1, T, Hq, D]`, k, v `[1, T, Hkv, D]`, output `[1, T, Hq, D]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference_svc.kernels.triton_backend import AttentionOps


class KVCache:
    """All layers' paged K/V: `data[layer, 0|1]` is `[num_blocks, block_size, Hkv, D]`.

    Per-layer views are made once here (not per step or per layer call): `layer(i)` gives the block views.
    """

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data  # [L, 2, num_blocks, block_size, Hkv, D]
        self._layers = [(data[i, 0], data[i, 1]) for i in range(data.shape[0])]

    @classmethod
    def allocate(
        cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device
    ) -> KVCache:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, as tensors on the model device (no host copies)."""

    slot_mapping: torch.Tensor  # [T] int64: each token's cache slot
    num_decode_tokens: int  # D: tokens [0, D) are decodes, one per sequence
    decode_context_lens: torch.Tensor  # [D] int32 (includes the token being decoded)
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [P+1] int32, offsets into the prefill tokens (which start at D)
    prefill_context_lens: torch.Tensor  # [P] int32 = cached prefix + chunk length
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32


class PagedAttention:
    """The `AttentionBackend` of one step over any `AttentionOps` (see the module docstring)."""

    def __init__(self, ops: AttentionOps, cache: KVCache, meta: AttentionMetadata) -> None:
        self.ops = ops
        self.cache = cache
        self.meta = meta

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [1, T, Hq, D]; k, v: [1, T, Hkv, D]
        k_cache, v_cache = self.cache.layer(layer_idx)
        q, k, v = q[0], k[0], v[0]
        m, ops = self.meta, self.ops
        ops.store_kv(k, v, k_cache, v_cache, m.slot_mapping)
        d = m.num_decode_tokens
        parts: list[torch.Tensor] = []
        if d:
            decode_q = q if d == q.shape[0] else q[:d]
            parts.append(
                ops.decode_attention(decode_q, k_cache, v_cache, m.decode_context_lens, m.decode_block_tables, scale)
            )
        if q.shape[0] > d:
            parts.append(
                ops.prefill_attention(
                    q[d:], k_cache, v_cache, m.cu_seqlens_q, m.prefill_context_lens, m.prefill_block_tables, scale
                )
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return out[None]  # [1, T, Hq, D]


def paged_attention_factory(ops: AttentionOps) -> Callable[[KVCache, AttentionMetadata], PagedAttention]:
    """What the model runner calls once per step: (cache, metadata) -> that step's backend over `ops`."""
    return lambda cache, meta: PagedAttention(ops, cache, meta)


# ---------------------------------------------------------------------------------------- the torch ops (CPU path)
class _TorchOps:
    """Plain torch ops over the paged cache, planned once per step.

    Decode gathers each sequence's blocks (`index_select`) into a padded `[D, Lmax]` tensor and runs SDPA with a
    length mask; a single sequence whose blocks are consecutive is read as a slice of the cache, without a copy,
    and a single sequence over scattered blocks by one gather cut to its length. Prefill reads the chunk's context
    (cached prefix + the chunk, stored first) as a view where its blocks are consecutive, else by one gather.
    """

    def __init__(self) -> None:
        self._decode_key: tuple[torch.Tensor, torch.Tensor] | None = None
        self._decode_plan: _DecodePlan | None = None
        self._prefill_key: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._prefill_plans: list[_PrefillPlan] = []

    @staticmethod
    def store_kv(
        k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        hkv, dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, hkv, dim).index_copy_(0, slot_mapping, k)  # each token's K/V written once, at its slot
        v_cache.view(-1, hkv, dim).index_copy_(0, slot_mapping, v)

    def decode_attention(
        self,
        q: torch.Tensor,  # [S, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        context_lens: torch.Tensor,  # [S] int32
        block_tables: torch.Tensor,  # [S, max_blocks] int32
        scale: float,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        del num_splits  # a kernel tuning knob
        key = self._decode_key
        if key is None or key[0] is not context_lens or key[1] is not block_tables:
            self._decode_plan = _plan_decode(context_lens, block_tables, k_cache.shape[1], q.device)
            self._decode_key = (context_lens, block_tables)
        plan = self._decode_plan
        assert plan is not None
        s, hq, dim = q.shape
        hkv = k_cache.shape[2]
        if plan.contiguous is not None:  # one sequence, consecutive blocks: a view of the cache, no copy
            lo, hi = plan.contiguous
            keys = k_cache.view(-1, hkv, dim)[None, lo:hi]  # [1, L, Hkv, D]
            values = v_cache.view(-1, hkv, dim)[None, lo:hi]
        elif plan.length is not None:  # one sequence, scattered blocks: one gather each, cut to its length
            keys = k_cache.index_select(0, plan.block_index).view(1, -1, hkv, dim)[:, : plan.length]
            values = v_cache.index_select(0, plan.block_index).view(1, -1, hkv, dim)[:, : plan.length]
        else:
            keys = k_cache.index_select(0, plan.block_index).view(s, -1, hkv, dim)  # [S, Lmax, Hkv, D]
            values = v_cache.index_select(0, plan.block_index).view(s, -1, hkv, dim)
        # One query per sequence: fold the GQA group into the query axis, so each KV head is read once and
        # SDPA sees [S, Hkv, G, D] queries against [S, Hkv, L, D] keys (no causal mask needed within a decode).
        out = F.scaled_dot_product_attention(
            q.reshape(s, hkv, hq // hkv, dim),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=plan.mask,  # [S, 1, 1, Lmax] or None
            scale=scale,
        )
        return out.reshape(s, hq, dim)  # [S, Hq, D]

    def prefill_attention(
        self,
        q: torch.Tensor,  # [T_prefill, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cu_seqlens_q: torch.Tensor,  # [P+1] int32
        context_lens: torch.Tensor,  # [P] int32
        block_tables: torch.Tensor,  # [P, max_blocks] int32
        scale: float,
    ) -> torch.Tensor:
        key = self._prefill_key
        if key is None or key[0] is not cu_seqlens_q or key[1] is not context_lens or key[2] is not block_tables:
            self._prefill_plans = _plan_prefills(cu_seqlens_q, context_lens, block_tables, k_cache.shape[1], q.device)
            self._prefill_key = (cu_seqlens_q, context_lens, block_tables)
        parts = [_prefill_one(plan, q[plan.start : plan.end], k_cache, v_cache, scale) for plan in self._prefill_plans]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def torch_ops() -> AttentionOps:
    """The CPU (and fallback) ops as an `AttentionOps`; each call makes its own plan memo (one per engine)."""
    ops = _TorchOps()
    return AttentionOps(
        name="torch",
        store_kv=ops.store_kv,
        prefill_attention=ops.prefill_attention,
        decode_attention=ops.decode_attention,
    )


@dataclass
class _DecodePlan:
    block_index: torch.Tensor | None  # [S * max_blocks] int64, the blocks of each sequence back to back
    mask: torch.Tensor | None  # [S, 1, 1, max_blocks*bs] bool
    contiguous: tuple[int, int] | None  # slot range of a single consecutive sequence
    length: int | None = None  # a single sequence over scattered blocks: its context length (no mask needed)


def _plan_decode(context_lens: torch.Tensor, block_tables: torch.Tensor, bs: int, device: torch.device) -> _DecodePlan:
    lens: list[int] = context_lens.tolist()
    tables: list[list[int]] = block_tables.tolist()
    if len(lens) == 1:
        blocks = tables[0][: -(-lens[0] // bs)]
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            return _DecodePlan(None, None, (blocks[0] * bs, blocks[0] * bs + lens[0]))
        return _DecodePlan(torch.tensor(blocks, dtype=torch.int64, device=device), None, None, lens[0])
    max_blocks = max(-(-n // bs) for n in lens)
    index = torch.tensor([t[:max_blocks] for t in tables], dtype=torch.int64)  # padding past a row's end: block 0
    positions = torch.arange(max_blocks * bs)
    mask = positions[None, :] < torch.tensor(lens)[:, None]  # [S, Lmax]
    mask = None if bool(mask.all()) else mask[:, None, None, :].to(device)
    return _DecodePlan(index.view(-1).to(device), mask, None)


@dataclass
class _PrefillPlan:
    start: int  # the chunk's rows [start, end) in the prefill queries
    end: int
    context_len: int
    contiguous: tuple[int, int] | None  # slot range of the context when its blocks are consecutive
    block_index: torch.Tensor | None  # [nb] int64 otherwise
    mask: torch.Tensor | None  # [q_len, context_len] bool; None: plain causal (nothing cached before the chunk)


def _plan_prefills(
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor, bs: int, device: torch.device
) -> list[_PrefillPlan]:
    cu: list[int] = cu_seqlens_q.tolist()
    lens: list[int] = context_lens.tolist()
    tables: list[list[int]] = block_tables.tolist()
    plans = []
    for i, ctx in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        blocks = tables[i][: -(-ctx // bs)]
        contiguous = None
        index = None
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            contiguous = (blocks[0] * bs, blocks[0] * bs + ctx)
        else:
            index = torch.tensor(blocks, dtype=torch.int64, device=device)
        mask = None
        if ctx != q_len:  # a cached prefix before the chunk: each query sees the prefix and the chunk up to itself
            q_pos = torch.arange(ctx - q_len, ctx, device=device)
            mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        plans.append(_PrefillPlan(start, end, ctx, contiguous, index, mask))
    return plans


def _prefill_one(
    plan: _PrefillPlan,
    q: torch.Tensor,  # [n, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    hkv, dim = k_cache.shape[2], k_cache.shape[3]
    if plan.contiguous is not None:
        lo, hi = plan.contiguous
        keys = k_cache.view(-1, hkv, dim)[lo:hi]  # [ctx, Hkv, D], a view
        values = v_cache.view(-1, hkv, dim)[lo:hi]
    else:
        keys = k_cache.index_select(0, plan.block_index).view(-1, hkv, dim)[: plan.context_len]  # [ctx, Hkv, D]
        values = v_cache.index_select(0, plan.block_index).view(-1, hkv, dim)[: plan.context_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, Hq, n, D]
        keys.transpose(0, 1)[None],  # [1, Hkv, ctx, D]
        values.transpose(0, 1)[None],
        attn_mask=plan.mask,
        is_causal=plan.mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != hkv,
    )
    return out[0].transpose(0, 1)  # [n, Hq, D]
