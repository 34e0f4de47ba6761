"""The CPU path's attention ops: plain torch over the paged cache, and Tandem's C++ decode kernels where they run.

Contract:
- `TorchOps` satisfies `inference_svc.attention.interface.AttentionOps`. It stores K/V in the cache's dtype
  (fp8/int8 through `kv_quant.store_scaled`); where the stored dtype is not q's it reads the blocks back in fp32
  (dequantized with their scales), computes in fp32 and returns q's dtype. A cache in q's dtype is read as it is
  (views where it can).
- With `native` (the default), decode attention and the K/V stores of an unscaled CPU cache run through Tandem's
  C++ kernels where they are built (`inference_svc.attention.native_cpu`: the cache read in place, fp32 softmax
  and sums, one rounding to q's dtype), and `decode_step` runs a decode-only step's store and attention in one C++
  call; elsewhere, and for prefill chunks, the plain torch ops below (`decode_step` then returns None).
- It plans each step once (which blocks to gather, the length mask, whether a lone sequence's blocks are
  consecutive so its cache is read as a view): the plan is derived from the metadata tensors, kept for the tensors
  it was derived from (the same objects in every layer of a step), and replaced when new ones arrive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from inference_svc.attention import native_cpu
from inference_svc.attention.interface import AttentionOps
from inference_svc.attention.kv_quant import as_bytes, store_scaled


class TorchOps:
    """Plain torch ops over the paged cache, planned once per step (an `AttentionOps`; `name` is "torch").

    Decode gathers each sequence's blocks (`index_select`) into a padded `[D, Lmax]` tensor and runs SDPA with a
    length mask; a single sequence whose blocks are consecutive is read as a slice of the cache, without a copy,
    and a single sequence over scattered blocks by one gather cut to its length. Prefill reads the chunk's context
    (cached prefix + the chunk, stored first) as a view where its blocks are consecutive, else by one gather; a
    step's fresh chunks (nothing cached before them) of one length up to `BATCH_PREFILL_MAX_TOKENS` run as one
    batched call (many short prompts admitted together: one call instead of one per prompt, the same bits).
    """

    name = "torch"

    def __init__(self, native: bool = True) -> None:
        """`native=False`: torch ops only, even where the C++ decode kernels run (the load plan's `cpu_kernels`)."""
        self._native: Any = _UNBUILT if native else None
        """The C++ decode kernels (`native_cpu.extension()`, built at the first CPU call), or None: torch ops."""
        self._decode_key: tuple[torch.Tensor, torch.Tensor] | None = None
        self._decode_plan: _DecodePlan | None = None
        self._prefill_key: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._prefill_plans: list[_PrefillPlan] = []
        self._prefill_batches: list[_PrefillBatch] = []

    def _kernels(self, cache: torch.Tensor) -> Any:
        """The C++ kernels for a cache on the CPU (built on first use), else None."""
        if not cache.is_cpu:
            return None
        if self._native is _UNBUILT:
            self._native = native_cpu.extension()
        return self._native

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        if k_scales is not None and v_scales is not None:  # fp8 / int8: quantized at the blocks' scales
            store_scaled(k, k_cache, k_scales, slot_mapping)
            store_scaled(v, v_cache, v_scales, slot_mapping)
            return
        native = self._kernels(k_cache)
        if native is not None:  # the same two index copies, in one call
            native.store_kv(k, v, k_cache, v_cache, slot_mapping)
            return
        hkv, dim = k_cache.shape[2], k_cache.shape[3]
        # each token's K/V written once, at its slot (cast when the cache's dtype is not the model's)
        k_cache.view(-1, hkv, dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, hkv, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def decode_step(
        self,
        q: torch.Tensor,  # [1, T, Hq, D]
        k: torch.Tensor,  # [1, T, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor | None:
        """`store_kv` then `decode_attention` in one C++ call, where the C++ kernels take this cache; else None."""
        native = self._kernels(k_cache)
        if native is None or not native_cpu.reads(k_cache, q.shape[-1]):
            return None
        return native.decode_step(q, k, v, k_cache, v_cache, slot_mapping, context_lens, block_tables, scale)

    def decode_attention(
        self,
        q: torch.Tensor,  # [S, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        context_lens: torch.Tensor,  # [S] int32
        block_tables: torch.Tensor,  # [S, max_blocks] int32
        scale: float,
        num_splits: int | None = None,
        k_scales: torch.Tensor | None = None,  # [num_blocks, Hkv] fp32 (fp8/int8 caches)
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        del num_splits  # a kernel tuning knob
        native = self._kernels(k_cache)
        if native is not None and k_scales is None and native_cpu.reads(k_cache, q.shape[-1]):
            return native.decode_attention(q.contiguous(), k_cache, v_cache, context_lens, block_tables, scale)
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
            keys = _slot_range(k_cache, k_scales, lo, hi, q.dtype)[None]  # [1, L, Hkv, D]
            values = _slot_range(v_cache, v_scales, lo, hi, q.dtype)[None]
        elif plan.length is not None:  # one sequence, scattered blocks: one gather each, cut to its length
            keys = _gather(k_cache, k_scales, plan.block_index, q.dtype).view(1, -1, hkv, dim)[:, : plan.length]
            values = _gather(v_cache, v_scales, plan.block_index, q.dtype).view(1, -1, hkv, dim)[:, : plan.length]
        else:
            keys = _gather(k_cache, k_scales, plan.block_index, q.dtype).view(s, -1, hkv, dim)  # [S, Lmax, Hkv, D]
            values = _gather(v_cache, v_scales, plan.block_index, q.dtype).view(s, -1, hkv, dim)
        # One query per sequence: fold the GQA group into the query axis, so each KV head is read once and
        # SDPA sees [S, Hkv, G, D] queries against [S, Hkv, L, D] keys (no causal mask needed within a decode).
        out = F.scaled_dot_product_attention(
            q.reshape(s, hkv, hq // hkv, dim).to(keys.dtype),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=plan.mask,  # [S, 1, 1, Lmax] or None
            scale=scale,
        )
        return out.reshape(s, hq, dim).to(q.dtype)  # [S, Hq, D]

    def prefill_attention(
        self,
        q: torch.Tensor,  # [T_prefill, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cu_seqlens_q: torch.Tensor,  # [P+1] int32
        context_lens: torch.Tensor,  # [P] int32
        block_tables: torch.Tensor,  # [P, max_blocks] int32
        scale: float,
        k_scales: torch.Tensor | None = None,  # [num_blocks, Hkv] fp32 (fp8/int8 caches)
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        key = self._prefill_key
        if key is None or key[0] is not cu_seqlens_q or key[1] is not context_lens or key[2] is not block_tables:
            self._prefill_plans = _plan_prefills(cu_seqlens_q, context_lens, block_tables, k_cache.shape[1], q.device)
            self._prefill_batches = _batch_prefills(self._prefill_plans, k_cache.shape[1], q.device)
            self._prefill_key = (cu_seqlens_q, context_lens, block_tables)
        plans, batches = self._prefill_plans, self._prefill_batches
        if len(plans) == 1:
            return _prefill_one(plans[0], q, k_cache, v_cache, k_scales, v_scales, scale)
        if not batches or k_scales is not None or k_cache.dtype != q.dtype:
            parts = [_prefill_one(p, q[p.start : p.end], k_cache, v_cache, k_scales, v_scales, scale) for p in plans]
            return torch.cat(parts, dim=0)
        out = torch.empty_like(q)  # [T_prefill, Hq, D]
        batched = set()
        for batch in batches:
            out.index_copy_(0, batch.rows, _prefill_batch(batch, q, k_cache, v_cache, scale))
            batched.update(batch.members)
        for i, p in enumerate(plans):
            if i not in batched:
                out[p.start : p.end] = _prefill_one(p, q[p.start : p.end], k_cache, v_cache, None, None, scale)
        return out


_UNBUILT = object()


def is_torch_ops(ops: AttentionOps) -> bool:
    """Whether `ops` are the CPU path's `TorchOps` (not replaced or wrapped)."""
    return type(ops) is TorchOps


def torch_ops(native: bool = True) -> TorchOps:
    """The CPU (and fallback) ops; each call makes its own plan memo (one per engine). `native=False`: torch ops
    only, even where the C++ decode kernels run (the load plan's `cpu_kernels`)."""
    return TorchOps(native)


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


@dataclass
class _PrefillBatch:
    """Chunks of one length with nothing cached before them: one SDPA call over `[G, H, n, D]` instead of G calls
    (each chunk's rows are computed alone, as a call of its own computes them: the same bits)."""

    members: tuple[int, ...]  # the chunks' indices in the step's plans
    rows: torch.Tensor  # [G * n] int64, their query rows in the step's prefill queries, chunk after chunk
    slots: torch.Tensor  # [G * n] int64, the cache slots of their K/V, in the same order
    length: int  # n


BATCH_PREFILL_MAX_TOKENS = 256
"""Chunks of at most this many tokens are batched with the step's other chunks of their length (`_PrefillBatch`):
a short chunk's attention is a call's fixed cost more than its arithmetic; a long one's is arithmetic."""


def _batch_prefills(plans: list[_PrefillPlan], bs: int, device: torch.device) -> list[_PrefillBatch]:
    """The step's short fresh chunks (no cached prefix) grouped by length, groups of two or more."""
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(plans):
        n = p.end - p.start
        if p.mask is None and n <= BATCH_PREFILL_MAX_TOKENS:
            by_length.setdefault(n, []).append(i)
    batches = []
    for n, members in by_length.items():
        if len(members) < 2:
            continue
        rows, slots = [], []
        for i in members:
            p = plans[i]
            rows.extend(range(p.start, p.end))
            if p.contiguous is not None:
                slots.extend(range(*p.contiguous))
            else:  # the context is the chunk: its first n slots over its blocks
                assert p.block_index is not None
                slots.extend([b * bs + j for b in p.block_index.tolist() for j in range(bs)][:n])
        to = {"dtype": torch.int64, "device": device}
        batches.append(_PrefillBatch(tuple(members), torch.tensor(rows, **to), torch.tensor(slots, **to), n))  # type: ignore[arg-type]
    return batches


def _prefill_batch(
    batch: _PrefillBatch, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """`[G * n, Hq, D]`: causal attention of each of the batch's chunks over itself, in one call."""
    hq, hkv, dim, n = q.shape[1], k_cache.shape[2], k_cache.shape[3], batch.length
    queries = q.index_select(0, batch.rows).view(-1, n, hq, dim).transpose(1, 2)  # [G, Hq, n, D]
    keys = k_cache.view(-1, hkv, dim).index_select(0, batch.slots).view(-1, n, hkv, dim).transpose(1, 2)
    values = v_cache.view(-1, hkv, dim).index_select(0, batch.slots).view(-1, n, hkv, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=hq != hkv)
    return out.transpose(1, 2).reshape(-1, hq, dim)  # [G * n, Hq, D]


def _prefill_one(
    plan: _PrefillPlan,
    q: torch.Tensor,  # [n, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    hkv, dim = k_cache.shape[2], k_cache.shape[3]
    if plan.contiguous is not None:
        lo, hi = plan.contiguous
        keys = _slot_range(k_cache, k_scales, lo, hi, q.dtype)  # [ctx, Hkv, D], a view in q's dtype
        values = _slot_range(v_cache, v_scales, lo, hi, q.dtype)
    else:
        keys = _gather(k_cache, k_scales, plan.block_index, q.dtype).view(-1, hkv, dim)[: plan.context_len]
        values = _gather(v_cache, v_scales, plan.block_index, q.dtype).view(-1, hkv, dim)[: plan.context_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].to(keys.dtype),  # [1, Hq, n, D]
        keys.transpose(0, 1)[None],  # [1, Hkv, ctx, D]
        values.transpose(0, 1)[None],
        attn_mask=plan.mask,
        is_causal=plan.mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != hkv,
    )
    return out[0].transpose(0, 1).to(q.dtype)  # [n, Hq, D]


def _gather(cache: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks `index` of a cache `[num_blocks, bs, Hkv, D]` → `[n, bs, Hkv, D]`: as stored when that is `dtype`,
    else in fp32 (dequantized with the blocks' scales when the cache is fp8/int8)."""
    blocks = as_bytes(cache).index_select(0, index).view(cache.dtype)
    if scales is not None:
        return blocks.float() * scales.index_select(0, index)[:, None, :, None]
    return blocks if blocks.dtype == dtype else blocks.float()


def _slot_range(cache: torch.Tensor, scales: torch.Tensor | None, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Slots [lo, hi) of a cache → `[hi - lo, Hkv, D]`: a view when stored in `dtype`, else fp32 (as `_gather`)."""
    bs, hkv, dim = cache.shape[1], cache.shape[2], cache.shape[3]
    if scales is None and cache.dtype == dtype:
        return cache.view(-1, hkv, dim)[lo:hi]
    first, last = lo // bs, -(-hi // bs)
    blocks = cache[first:last].float()  # [nb, bs, Hkv, D]
    if scales is not None:
        blocks = blocks * scales[first:last][:, None, :, None]
    return blocks.view(-1, hkv, dim)[lo - first * bs : hi - first * bs]
