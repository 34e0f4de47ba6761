"""Triton KV write: store each new token's keys and values into its paged-cache slot.

Contract: `store_kv(k, v, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None)` with k, v `[T, Hkv, D]`,
caches `[num_blocks, block_size, Hkv, D]` (last dim contiguous) and slot_mapping `[T]` int64, where
slot = block_id * block_size + offset and a slot < 0 means "skip this token" (padding). Writes in place, one
program per token; addresses are computed in int64, so caches beyond 2^31 elements are fine.
- A cache in another float dtype than k, v (`--kv-cache-dtype`) gets the values cast on store.
- fp8 / int8 caches take `k_scales, v_scales` `[num_blocks, Hkv]` fp32 (`kv_quant`): the scales are raised first
  (`kv_quant.update_scales`, torch ops on the device, no host sync), then each program quantizes its token with
  its block's new scale; the first program of each block's run also rescales the block's earlier tokens by
  old / new (they sit at offsets below the run's, so no two programs touch one element). Slots must be ≥ 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from inference_svc.attention.kv_quant import QMAX, is_scaled, update_scales
from inference_svc.attention.triton.configs import MAX_HEAD_DIM, LazyKernel, pad_pow2


def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T] int64
    k_old_ptr,  # [T, Hkv] fp32: each token's block scale before this write (SCALED)
    k_new_ptr,  # [T, Hkv] fp32: ... and after
    v_old_ptr,
    v_new_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SCALED: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [HEADS_PAD, HEAD_DIM_PAD]

    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_blk = k_cache_ptr + block * stride_kcb + offs_h[:, None] * stride_kch + offs_d[None, :]  # offset 0
    v_blk = v_cache_ptr + block * stride_vcb + offs_h[:, None] * stride_vch + offs_d[None, :]
    if SCALED:
        h_ok = offs_h < NUM_KV_HEADS
        row = t * NUM_KV_HEADS + offs_h
        k_new = tl.load(k_new_ptr + row, mask=h_ok, other=1.0)  # [HEADS_PAD]
        v_new = tl.load(v_new_ptr + row, mask=h_ok, other=1.0)
        prev = tl.load(slot_ptr + t - 1, mask=t > 0, other=-1).to(tl.int64)
        leads = (t == 0) | (prev < 0) | (prev // BLOCK_SIZE != block)
        k_f = tl.load(k_old_ptr + row, mask=h_ok, other=1.0) / k_new  # [HEADS_PAD] old / new, 1 if unchanged
        v_f = tl.load(v_old_ptr + row, mask=h_ok, other=1.0) / v_new
        grown = (tl.min(k_f, 0) < 1.0) | (tl.min(v_f, 0) < 1.0)
        if leads & (offset > 0) & grown:  # rescale this block's earlier tokens to the new scale
            for o in range(0, offset):
                k_o = tl.load(k_blk + o * stride_kct, mask=mask).to(tl.float32) * k_f[:, None]
                v_o = tl.load(v_blk + o * stride_vct, mask=mask).to(tl.float32) * v_f[:, None]
                if IS_INT8:  # as kv_quant.quantize: int8 rounds half up; fp8 saturates at ±448
                    k_o = tl.floor(k_o + 0.5)
                    v_o = tl.floor(v_o + 0.5)
                k_o = tl.minimum(tl.maximum(k_o, -QMAX), QMAX)
                v_o = tl.minimum(tl.maximum(v_o, -QMAX), QMAX)
                tl.store(k_blk + o * stride_kct, k_o.to(k_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(v_blk + o * stride_vct, v_o.to(v_cache_ptr.dtype.element_ty), mask=mask)
        k_q = k.to(tl.float32) / k_new[:, None]
        v_q = v.to(tl.float32) / v_new[:, None]
        if IS_INT8:
            k_q = tl.floor(k_q + 0.5)
            v_q = tl.floor(v_q + 0.5)
        k_q = tl.minimum(tl.maximum(k_q, -QMAX), QMAX)
        v_q = tl.minimum(tl.maximum(v_q, -QMAX), QMAX)
        tl.store(k_blk + offset * stride_kct, k_q.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_blk + offset * stride_vct, v_q.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(k_blk + offset * stride_kct, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_blk + offset * stride_vct, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


_STORE_KV = LazyKernel(_store_kv_kernel)


def store_kv(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
) -> None:
    """Write k, v `[T, Hkv, D]` into k_cache, v_cache at `slot_mapping` `[T]`; slots < 0 are skipped (unscaled)."""
    t, hkv, d = k.shape
    if v.shape != k.shape or k_cache.shape != v_cache.shape:
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)} and the two caches must match")
    if k_cache.shape[2:] != (hkv, d) or d > MAX_HEAD_DIM:
        raise ValueError(f"store_kv: cache {tuple(k_cache.shape)} does not hold [_, _, {hkv}, {d}] tokens")
    scaled = is_scaled(k_cache.dtype)
    if k_cache.dtype != v_cache.dtype or k.dtype != v.dtype:
        raise ValueError(f"store_kv: k/v dtypes {k.dtype}, {v.dtype} / caches {k_cache.dtype}, {v_cache.dtype} differ")
    if scaled != (k_scales is not None and v_scales is not None):
        raise ValueError(f"store_kv: a {k_cache.dtype} cache needs k_scales and v_scales exactly when it is fp8/int8")
    if slot_mapping.shape != (t,):
        raise ValueError(f"store_kv: slot_mapping {tuple(slot_mapping.shape)} must be [{t}]")
    if t == 0:
        return
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"store_kv: {name} must be contiguous in head_dim")
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    bs = k_cache.shape[1]
    if scaled:
        assert k_scales is not None and v_scales is not None
        k_old, k_new = (x.contiguous() for x in update_scales(k, k_scales, slots, bs, k_cache.dtype))
        v_old, v_new = (x.contiguous() for x in update_scales(v, v_scales, slots, bs, v_cache.dtype))
    else:  # unused by the kernel; any fp32 tensor will do as the pointer arguments
        k_old = k_new = v_old = v_new = torch.empty((1,), dtype=torch.float32, device=k.device)
    _STORE_KV.get()[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k_old,
        k_new,
        v_old,
        v_new,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=hkv,
        HEADS_PAD=triton.next_power_of_2(hkv),
        HEAD_DIM=d,
        HEAD_DIM_PAD=pad_pow2(d, minimum=1),
        BLOCK_SIZE=bs,
        SCALED=scaled,
        IS_INT8=k_cache.dtype == torch.int8,
        QMAX=QMAX.get(k_cache.dtype, 0.0),
    )
