"""Triton KV write: store each new token's keys and values into its paged-cache slot.

Contract: `store_kv(k, v, k_cache, v_cache, slot_mapping)` with k, v `[T, Hkv, D]`, caches
`[num_blocks, block_size, Hkv, D]` (same dtype as k, v; last dim contiguous) and slot_mapping `[T]` int64, where
slot = block_id * block_size + offset and a slot < 0 means "skip this token" (padding). Writes in place, one
program per token; addresses are computed in int64, so caches beyond 2^31 elements are fine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from inference_svc.kernels.configs import MAX_HEAD_DIM, LazyKernel, pad_pow2


def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T] int64
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
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct
    tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(v_dst + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


_STORE_KV = LazyKernel(_store_kv_kernel)


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write k, v `[T, Hkv, D]` into k_cache, v_cache at `slot_mapping` `[T]`; slots < 0 are skipped."""
    t, hkv, d = k.shape
    if v.shape != k.shape or k_cache.shape != v_cache.shape:
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)} and the two caches must match")
    if k_cache.shape[2:] != (hkv, d) or d > MAX_HEAD_DIM:
        raise ValueError(f"store_kv: cache {tuple(k_cache.shape)} does not hold [_, _, {hkv}, {d}] tokens")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"store_kv: k/v dtype {k.dtype} differs from the cache dtype {k_cache.dtype}")
    if slot_mapping.shape != (t,):
        raise ValueError(f"store_kv: slot_mapping {tuple(slot_mapping.shape)} must be [{t}]")
    if t == 0:
        return
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"store_kv: {name} must be contiguous in head_dim")
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    _STORE_KV.get()[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
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
        BLOCK_SIZE=k_cache.shape[1],
    )
