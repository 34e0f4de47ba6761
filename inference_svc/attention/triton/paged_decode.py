"""Triton split-KV paged decode attention (flash-decoding) and its log-sum-exp merge.

Contract: `decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale, num_splits=None)`.
- q `[S, Hq, D]`: one query token per sequence; it attends to keys 0..context_lens[s]-1 (int32 `[S]`, ≥ 1), read
  from the cache `[num_blocks, block_size, Hkv, D]` through block_tables[s] (int32 `[S, max_blocks]`).
- Returns `[S, Hq, D]` in q's dtype. Query head h reads kv head h // (Hq // Hkv).
- The cache may be stored in another dtype than q (`--kv-cache-dtype`): then tiles are read in fp32 and the dots
  run in fp32. fp8/int8 caches come with `k_scales, v_scales` `[num_blocks, Hkv]` fp32 (`kv_quant`): a key's block
  scale multiplies its column of scores, a value's its column of probabilities (never a dequantized tile).
- num_splits=None chooses the split count from the lengths (`configs.decode_num_splits`, from the block table's
  width × block size: a host-side bound, no device sync). num_splits=1 writes the output directly; more splits
  write fp32 partial outputs and log2-sum-exps, and a second kernel merges them.

How: one program per (sequence, kv head, split). Its rows are the group's query heads (GQA packing, padded to ≥ 16
for tl.dot), so each K/V tile is loaded once per group. Sequence s's keys are cut into `num_splits` ranges of
whole BLOCK_N tiles; trailing splits of a short sequence are empty and report lse = -inf, which the merge weighs
as 0. Online softmax in fp32 with exp2; int64 addresses; head_dim padded to the next power of two with masks.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from inference_svc.attention.kv_quant import check_scales
from inference_svc.attention.triton import configs as cfg

LOG2E = math.log2(math.e)


def _decode_kernel(
    q_ptr,  # [S, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    out_ptr,  # [S, Hq, D] (NUM_SPLITS == 1)
    part_out_ptr,  # [S, Hq, NUM_SPLITS, D] fp32 (NUM_SPLITS > 1)
    part_lse_ptr,  # [S, Hq, NUM_SPLITS] fp32, log2 domain
    context_lens_ptr,  # [S] int32
    block_tables_ptr,  # [S, max_blocks] int32
    k_scales_ptr,  # [num_blocks, Hkv] fp32 (SCALED: fp8 / int8 caches)
    v_scales_ptr,
    qk_scale,  # softmax scale × log2(e)
    stride_qs,
    stride_qh,
    stride_os,
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
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    SCALED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context = tl.load(context_lens_ptr + seq)
    n_tiles = (context + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, context)  # this split's keys: [start, end)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    g_ok = offs_g < GROUP
    head = (kv_head * GROUP + offs_g).to(tl.int64)  # [GROUP_PAD] query heads of this kv head
    q_off = seq * stride_qs + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    bt_row = block_tables_ptr + seq * stride_bts
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot_in_blk = (offs_n % BLOCK_SIZE).to(tl.int64)
        k_off = blk * stride_kb + slot_in_blk * stride_kt  # [BLOCK_N]
        k_t = tl.load(k_head + k_off[None, :] + offs_d[:, None], mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=DOT_PREC) * qk_scale  # [GROUP_PAD, BLOCK_N]
        if SCALED:  # dequantize: each key's block scale multiplies its column of scores
            s = s * tl.load(k_scales_ptr + blk * stride_sb + kv_head, mask=n_ok, other=0.0)[None, :]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = blk * stride_vb + slot_in_blk * stride_vt
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if SCALED:  # ... and each value's block scale its column of probabilities
            p = p * tl.load(v_scales_ptr + blk * stride_sb + kv_head, mask=n_ok, other=0.0)[None, :]
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new

    has_keys = l_i > 0.0  # false only for an empty split (or padded head rows)
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    store_mask = g_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        o_off = seq * stride_os + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # part_out is contiguous [S, Hq, NUM_SPLITS, HEAD_DIM]; part_lse [S, Hq, NUM_SPLITS]
        row = (seq * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=store_mask)
        lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_ok)


def _merge_kernel(
    part_out_ptr,  # [S, Hq, NUM_SPLITS, D] fp32
    part_lse_ptr,  # [S, Hq, NUM_SPLITS] fp32, log2 domain
    out_ptr,  # [S, Hq, D]
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    row = seq * tl.num_programs(1) + head
    offs_k = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k_ok = offs_k < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_k, mask=k_ok, other=float("-inf"))  # [SPLITS_PAD]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)  # empty splits weigh 0
    parts = tl.load(
        part_out_ptr + (row * NUM_SPLITS + offs_k)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=k_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [SPLITS_PAD, HEAD_DIM_PAD]
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


_DECODE = cfg.LazyKernel(
    _decode_kernel,
    autotune=(
        cfg.decode_autotune_configs,
        ["HEAD_DIM_PAD", "GROUP_PAD", "BLOCK_SIZE", "SCALED", "DOT_PREC"],
        cfg.prune_decode_configs,
    ),
)
_MERGE = cfg.LazyKernel(_merge_kernel)


def _check(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    lens: Tensor,
    tables: Tensor,
    k_scales: Tensor | None,
    v_scales: Tensor | None,
) -> None:
    s, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != d:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    if hq % hkv != 0:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    if d > cfg.MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} > {cfg.MAX_HEAD_DIM}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} differs from v_cache dtype {v_cache.dtype}")
    check_scales(k_cache, k_scales, "k_scales")
    check_scales(v_cache, v_scales, "v_scales")
    if lens.shape != (s,) or tables.dim() != 2 or tables.shape[0] != s:
        raise ValueError(f"context_lens {tuple(lens.shape)}, block_tables {tuple(tables.shape)} vs {s} queries")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")


def _int32(x: Tensor) -> Tensor:
    return x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()


def choose_num_splits(q: Tensor, k_cache: Tensor, block_tables: Tensor) -> int:
    """The default split count for this batch, from host-known shapes only (no device sync)."""
    max_context = block_tables.shape[1] * k_cache.shape[1]
    return cfg.decode_num_splits(q.shape[0], k_cache.shape[2], max_context, cfg.device_parallelism(q.device))


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
    autotune: bool = False,
) -> Tensor:
    """One query token per sequence against its paged K/V (split-KV when num_splits > 1); returns `[S, Hq, D]`.
    `autotune`: time the configs on the first launch of each shape (CUDA only), else the heuristic config."""
    _check(q, k_cache, v_cache, context_lens, block_tables, k_scales, v_scales)
    s, hq, d = q.shape
    hkv = k_cache.shape[2]
    out = torch.empty_like(q)
    if s == 0:
        return out
    splits = choose_num_splits(q, k_cache, block_tables) if num_splits is None else int(num_splits)
    if splits < 1:
        raise ValueError(f"num_splits must be ≥ 1, got {num_splits}")
    lens, tables = _int32(context_lens), _int32(block_tables)
    group = hq // hkv
    d_pad = cfg.pad_pow2(d)
    interpret = cfg.interpret_mode()
    upcast = interpret or k_cache.dtype != q.dtype  # a cache in another dtype (fp8/int8 too) is read in fp32
    no_scales = torch.empty((1,), dtype=torch.float32, device=q.device)  # the pointer argument when unscaled
    if splits > 1:
        part_out = torch.empty((s, hq, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((s, hq, splits), dtype=torch.float32, device=q.device)
    else:  # unused by the kernel; any fp32 tensor will do as the pointer argument
        part_out = part_lse = torch.empty((1,), dtype=torch.float32, device=q.device)
    args = (
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        lens,
        tables,
        no_scales if k_scales is None else k_scales,
        no_scales if v_scales is None else v_scales,
        float(scale) * LOG2E,
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
        "GROUP_PAD": cfg.pad_pow2(group),
        "BLOCK_SIZE": k_cache.shape[1],
        "NUM_SPLITS": splits,
        "UPCAST": upcast,
        "SCALED": k_scales is not None,
        "DOT_PREC": cfg.dot_precision(torch.float32 if upcast else q.dtype),
    }
    grid = (s, hkv, splits)
    if _DECODE.tuned(autotune):
        _DECODE.get(autotune)[grid](*args, **meta)
    else:
        c = cfg.decode_config(d_pad, interpret)
        _DECODE.get(autotune)[grid](*args, **meta, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages)
    if splits > 1:
        _MERGE.get()[(s, hq)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=d,
            HEAD_DIM_PAD=cfg.pad_pow2(d, minimum=1),
            NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
        )
    return out
