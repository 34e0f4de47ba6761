"""Triton KV write vs the reference: bit-exact copies into scattered slots, negative slots skipped."""

from __future__ import annotations

import pytest
import torch

from inference_svc.attention import reference
from inference_svc.attention import triton as kernels


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size", "dtype"),
    [(1, 16, 16, torch.float32), (3, 24, 32, torch.float16), (2, 80, 16, torch.bfloat16), (8, 128, 32, torch.float16)],
)
def test_store_kv_matches_reference(device, num_kv_heads, head_dim, block_size, dtype) -> None:
    g = torch.Generator().manual_seed(1)
    shape = (9, block_size, num_kv_heads, head_dim)  # [num_blocks, block_size, Hkv, D]
    k_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    tokens = 37
    slots = torch.randperm(9 * block_size, generator=g)[:tokens]  # scattered over blocks
    slots[[0, 5, 36]] = -1  # padding tokens: not written
    slots = slots.to(device)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    reference.store_kv(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_rejects_dtype_mismatch(device) -> None:
    """k and v must share a dtype, and so must the two caches (a cache in another float dtype is a cast: see
    test_kernel_kv_dtype.py); an int8 cache without scales is refused."""
    cache = torch.zeros(2, 16, 1, 16, device=device)
    k = torch.zeros(1, 1, 16, dtype=torch.float16, device=device)
    slot = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="dtype"):
        kernels.store_kv(k, k.float(), cache, cache.clone(), slot)
    with pytest.raises(ValueError, match="dtype"):
        kernels.store_kv(k, k, cache, cache.half(), slot)
    with pytest.raises(ValueError, match="fp8/int8"):
        kernels.store_kv(k, k, cache.to(torch.int8), cache.to(torch.int8), slot)
