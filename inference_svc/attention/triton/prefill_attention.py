"""Triton varlen causal prefill/extend attention over the paged KV cache (FlashAttention-style forward).

Contract: `prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)`.
- q `[T, Hq, D]`: the query chunks of S sequences packed back to back; chunk s is rows
  cu_seqlens_q[s]:cu_seqlens_q[s+1] (cu_seqlens_q `[S+1]` int32).
- context_lens `[S]` int32: keys visible to the LAST query of sequence s (cached prefix + this chunk). The chunk's
  own K/V were already written by `store_kv`; every key is read from the cache through block_tables[s].
- Query j of sequence s sits at position context_lens[s] - q_len_s + j and sees keys 0..that position.
- Returns `[T, Hq, D]` in q's dtype. Hq is a multiple of Hkv; query head h reads kv head h // (Hq // Hkv).
- The cache may be stored in another dtype than q (`--kv-cache-dtype`): then tiles are read in fp32 and the dots
  run in fp32. fp8/int8 caches come with `k_scales, v_scales` `[num_blocks, Hkv]` fp32 (`kv_quant`): a key's block
  scale multiplies its column of scores, a value's its column of probabilities (never a dequantized tile).

How (one program per (query tile, kv head)):
- GQA packing: a tile's BLOCK_M rows are BLOCK_M // group query tokens × the group's query heads, so each K/V
  tile is loaded once for all query heads that share it.
- Varlen without a host sync: the grid has T // BLOCK_Q + S tiles along axis 0 (an upper bound); each program
  finds its sequence by binary search over cu_seqlens_q[s] // BLOCK_Q + s and exits if it has no rows.
- Keys stream in BLOCK_N tiles (a tile may span several cache blocks: each key looks up its own block). Tiles
  wholly below the tile's first query position run without masks; the diagonal tiles apply the causal mask.
- Online softmax in fp32 with exp2 (scale folded with log2 e); the output is normalized and written once. Scores
  exist only as one [BLOCK_M, BLOCK_N] tile in registers: no [tokens × tokens] tensor is ever stored.
- head_dim D ≤ 256 is padded to the next power of two with masked loads; all addresses are int64.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl
from torch import Tensor

from inference_svc.attention.kv_quant import check_scales
from inference_svc.attention.triton import configs as cfg

LOG2E = math.log2(math.e)


def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [T, Hq, D]
    cu_seqlens_ptr,  # [S + 1] int32
    context_lens_ptr,  # [S] int32
    block_tables_ptr,  # [S, max_blocks] int32
    k_scales_ptr,  # [num_blocks, Hkv] fp32 (SCALED: fp8 / int8 caches)
    v_scales_ptr,
    qk_scale,  # softmax scale × log2(e)
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    stride_sb,  # scales' block stride (Hkv)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    SCALED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    BLOCK_Q = BLOCK_M // GROUP  # query tokens per tile (constexpr arithmetic)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Which sequence owns this tile: the largest s with cu_seqlens[s] // BLOCK_Q + s <= tile.
    lo = tile * 0  # tensors from the start: Triton specializes an int argument equal to 1 as a constant
    hi = tile * 0 + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(cu_seqlens_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= tile, mid, lo)
        hi = tl.where(first_tile <= tile, hi, mid - 1)
    seq = lo
    q_begin = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_begin
    q_tile = tile - (q_begin // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    context = tl.load(context_lens_ptr + seq)
    prefix = context - q_len  # keys cached before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    tok = q_tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] token index within the chunk
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    pos = prefix + tok  # [BLOCK_M] absolute position of each row's query

    q_off = (q_begin + tok).to(tl.int64)[:, None] * stride_qt + head.to(tl.int64)[:, None] * stride_qh
    q = tl.load(q_ptr + q_off + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max (log2 units); finite: no inf - inf
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    first_pos = prefix + q_tile * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, context)  # keys this tile can see: [0, kv_end)
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # tiles below this are visible to every row

    # Phase 1: keys every row sees, no masks.
    for start in range(0, full_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE).to(tl.int64)
        kv_off = blk * stride_kb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_kt  # [BLOCK_N]
        k_t = tl.load(k_head + kv_off[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        if UPCAST:
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SCALED:  # dequantize: each key's block scale multiplies its column of scores
            s = s * tl.load(k_scales_ptr + blk * stride_sb + kv_head)[None, :]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = blk * stride_vb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_vt
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if SCALED:  # ... and each value's block scale its column of probabilities
            p = p * tl.load(v_scales_ptr + blk * stride_sb + kv_head)[None, :]
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    # Phase 2: the diagonal band, causal mask per row.
    for start in range(full_end, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = blk * stride_kb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_kt
        k_t = tl.load(k_head + kv_off[None, :] + offs_d[:, None], mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=DOT_PREC) * qk_scale
        if SCALED:
            s = s * tl.load(k_scales_ptr + blk * stride_sb + kv_head, mask=n_ok, other=0.0)[None, :]
        visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = blk * stride_vb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_vt
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if SCALED:
            p = p * tl.load(v_scales_ptr + blk * stride_sb + kv_head, mask=n_ok, other=0.0)[None, :]
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # only padding rows can have l == 0; they are not stored
    out = acc / l_safe[:, None]
    o_off = (q_begin + tok).to(tl.int64)[:, None] * stride_ot + head.to(tl.int64)[:, None] * stride_oh
    tl.store(
        out_ptr + o_off + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


_PREFILL = cfg.LazyKernel(
    _prefill_kernel,
    autotune=(
        cfg.prefill_autotune_configs,
        ["HEAD_DIM_PAD", "GROUP", "BLOCK_SIZE", "SCALED", "DOT_PREC"],
        cfg.prune_prefill_configs,
    ),
)


def _check(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu: Tensor,
    lens: Tensor,
    tables: Tensor,
    k_scales: Tensor | None,
    v_scales: Tensor | None,
) -> None:
    _, hq, d = q.shape
    _, _, hkv, dk = k_cache.shape
    if k_cache.shape != v_cache.shape or dk != d:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    if hq % hkv != 0:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    if d > cfg.MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} > {cfg.MAX_HEAD_DIM}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} differs from v_cache dtype {v_cache.dtype}")
    check_scales(k_cache, k_scales, "k_scales")
    check_scales(v_cache, v_scales, "v_scales")
    s = lens.shape[0]
    if cu.shape != (s + 1,) or tables.dim() != 2 or tables.shape[0] != s:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu.shape)}, block_tables {tuple(tables.shape)} do not match {s} sequences"
        )
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")


def _int32(x: Tensor) -> Tensor:
    return x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()


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
    autotune: bool = False,
) -> Tensor:
    """Causal attention of packed query chunks over their sequences' paged K/V; returns `[T, Hq, D]`.
    `autotune`: time the configs on the first launch of each shape (CUDA only), else the heuristic config."""
    _check(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, k_scales, v_scales)
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(q)
    if t == 0 or num_seqs == 0:
        return out
    cu, lens, tables = _int32(cu_seqlens_q), _int32(context_lens), _int32(block_tables)
    group = hq // hkv
    d_pad = cfg.pad_pow2(d)
    interpret = cfg.interpret_mode()
    upcast = interpret or k_cache.dtype != q.dtype  # a cache in another dtype (fp8/int8 too) is read in fp32
    no_scales = torch.empty((1,), dtype=torch.float32, device=q.device)  # the pointer argument when unscaled
    args = (
        q,
        k_cache,
        v_cache,
        out,
        cu,
        lens,
        tables,
        no_scales if k_scales is None else k_scales,
        no_scales if v_scales is None else v_scales,
        float(scale) * LOG2E,
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        tables.stride(0),
        k_scales.stride(0) if k_scales is not None else 0,
    )
    meta = {
        "HEAD_DIM": d,
        "HEAD_DIM_PAD": d_pad,
        "GROUP": group,
        "BLOCK_SIZE": k_cache.shape[1],
        "UPCAST": upcast,
        "SCALED": k_scales is not None,
        "DOT_PREC": cfg.dot_precision(torch.float32 if upcast else q.dtype),
    }

    def grid(m: dict) -> tuple[int, int]:
        return (t // (m["BLOCK_M"] // group) + num_seqs, hkv)

    if _PREFILL.tuned(autotune):
        _PREFILL.get(autotune)[grid](*args, **meta)
    else:
        c = cfg.prefill_config(d_pad, group, interpret)
        _PREFILL.get(autotune)[grid](
            *args,
            **meta,
            BLOCK_M=c.block_m,
            BLOCK_N=c.block_n,
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
    return out
