"""The scaled K/V formats (`inference_svc.attention.kv_quant`) and the cache that holds them (`engine.kv_cache`).

Bounds from the formats, for x within a block's range (|x| ≤ QMAX · s, s the block's power-of-two scale):
- int8: a round trip is within s / 2 absolute (rounding to the nearest of 255 levels s apart);
- fp8 e4m3 (3 mantissa bits): within 2^-4 of |x| relative where |x| / s ≥ 2^-6 (the smallest normal), else
  within 2^-10 · s absolute (half the subnormal step);
- a token re-expressed when its block's scale grew (powers of two): int8 within s (its roundings at the smaller
  scales sum to at most one more half-step at the final one); fp8 within 2^-4 |x| + 2^-9 · s (a rescale by a
  power of two is exact unless it moves the value into the subnormals), and 2^-9 · s for subnormals.
"""

from __future__ import annotations

import pytest
import torch

from inference_svc.attention.kv_quant import QMAX, dequantize, pow2_scale, quantize, store_scaled
from inference_svc.engine.kv_cache import KVCache, ledger_dtype_name, resolve_kv_dtype

FP8 = torch.float8_e4m3fn
SCALED = [torch.int8, FP8]


def _within_format_bound(x: torch.Tensor, back: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, k: float) -> None:
    """|back - x| within k × the format's bound (k = 1 for one rounding, 2 after rescaling)."""
    err = (back - x).abs()
    if dtype == torch.int8:
        bound = k * s / 2
    else:
        normal = x.abs() / s >= 2.0**-6  # rescaling (k = 2) is exact but for values it moves into the subnormals
        bound = torch.where(normal, 2.0**-4 * x.abs() + (k - 1) * 2.0**-9 * s, k * 2.0**-10 * s)
    excess = (err - bound).max().item()
    assert excess <= 0, f"{dtype}: error above the bound by {excess:.3g}"


@pytest.mark.parametrize("dtype", SCALED, ids=["int8", "fp8"])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 37.0, 5e4])
def test_round_trip_is_within_the_format_bound(dtype: torch.dtype, magnitude: float) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=g) * magnitude  # [tokens, heads, D]
    s = pow2_scale(x.abs().amax(dim=(0, 2)), dtype)[None, :, None]  # one scale per head: [1, Hkv, 1]
    assert torch.equal(s, torch.exp2(torch.log2(s).round())), "scales are powers of two"
    ratio = x.abs().amax(dim=(0, 2)) / s.flatten()
    assert bool(((ratio > QMAX[dtype] / 2) & (ratio <= QMAX[dtype])).all()), "amax / s in (QMAX/2, QMAX]"
    q = quantize(x, s, dtype)
    assert q.dtype == dtype
    _within_format_bound(x, dequantize(q, s), s, dtype, k=1)


def test_the_bounds_are_tight_enough_to_fail() -> None:
    """The check above can fail: int8 at half the scale's resolution (a coarser grid) breaks its bound."""
    x = torch.linspace(-100, 100, 1001)[:, None, None]
    s = pow2_scale(x.abs().amax(), torch.int8)
    coarse = dequantize(quantize(x, 2 * s, torch.int8), 2 * s)
    with pytest.raises(AssertionError, match="above the bound"):
        _within_format_bound(x, coarse, s, torch.int8, k=1)


def test_an_all_zero_head_gets_a_positive_scale_and_round_trips_to_zero() -> None:
    s = pow2_scale(torch.zeros(3), torch.int8)
    assert bool((s > 0).all())
    assert torch.equal(dequantize(quantize(torch.zeros(3, 5), s[:, None], torch.int8), s[:, None]), torch.zeros(3, 5))


@pytest.mark.parametrize("dtype", SCALED, ids=["int8", "fp8"])
def test_a_block_written_token_by_token_with_growing_values_stays_within_twice_the_bound(dtype: torch.dtype) -> None:
    bs, hkv, d = 8, 2, 16
    g = torch.Generator().manual_seed(1)
    x = torch.randn(bs, hkv, d, generator=g) * torch.logspace(-2, 2, bs)[:, None, None]  # each token larger
    cache = torch.zeros(3, bs, hkv, d, dtype=dtype)
    scales = torch.zeros(3, hkv)
    for t in range(bs):  # decode: one token per write into block 1
        store_scaled(x[t : t + 1], cache, scales, torch.tensor([bs + t]))
    s = scales[1]  # [Hkv]
    assert torch.equal(s, pow2_scale(x.abs().amax(dim=(0, 2)), dtype)), "the final scale is the block's need"
    back = dequantize(cache[1], s[None, :, None])
    _within_format_bound(x, back, s[None, :, None], dtype, k=2)
    # the same tokens written in one chunk: one rounding each, at the final scale
    cache2, scales2 = torch.zeros_like(cache), torch.zeros_like(scales)
    store_scaled(x, cache2, scales2, torch.arange(bs, 2 * bs))
    assert torch.equal(scales2, scales)
    _within_format_bound(x, dequantize(cache2[1], s[None, :, None]), s[None, :, None], dtype, k=1)
    assert bool((cache[0] == 0).all() and (cache[2] == 0).all()), "other blocks untouched"


def test_a_reused_block_starts_its_scale_over() -> None:
    """A write at offset 0 is a new owner: the previous sequence's (large) scale is forgotten."""
    bs = 4
    cache = torch.zeros(2, bs, 1, 8, dtype=torch.int8)
    scales = torch.zeros(2, 1)
    store_scaled(torch.full((bs, 1, 8), 1000.0), cache, scales, torch.arange(bs))
    big = scales[0].clone()
    small = torch.randn(2, 1, 8)
    store_scaled(small, cache, scales, torch.arange(2))
    assert scales[0] < big / 100
    assert torch.equal(scales[0], pow2_scale(small.abs().amax(), torch.int8).reshape(1))


def test_two_sequences_in_one_write_keep_their_blocks_apart() -> None:
    """Decodes of two sequences (one token each, different blocks) and a chunk: every block gets its own scale."""
    bs, d = 4, 8
    cache = torch.zeros(4, bs, 1, d, dtype=torch.int8)
    scales = torch.zeros(4, 1)
    x = torch.stack([torch.full((1, d), v) for v in (1.0, 100.0, 3.0, 3.0, 3.0)])  # [5, 1, D]
    store_scaled(x, cache, scales, torch.tensor([1 * bs + 0, 3 * bs + 0, 2 * bs + 0, 2 * bs + 1, 2 * bs + 2]))
    assert scales[:, 0].tolist() == [0.0, *pow2_scale(torch.tensor([1.0, 3.0, 100.0]), torch.int8).tolist()]


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_kv_cache_allocates_scales_and_zero_blocks_clears_them(name: str) -> None:
    dtype = resolve_kv_dtype(name, torch.float32)
    assert ledger_dtype_name(dtype) == name
    cache = KVCache.allocate(2, 5, 4, 2, 8, dtype, "cpu")
    assert cache.scales is not None and cache.scales.shape == (2, 2, 5, 2)
    assert cache.nbytes == 2 * 2 * 5 * 4 * 2 * 8 * 1 + 2 * 2 * 5 * 2 * 4
    k, _ = cache.layer(1)
    ks, _ = cache.layer_scales(1)
    store_scaled(torch.randn(6, 2, 8), k, ks, torch.arange(4, 10))
    assert bool((ks[1:3] > 0).all()) and bool((k.float()[1:3] != 0).any())
    cache.zero_blocks(torch.tensor([1, 2]))
    assert bool((cache.scales == 0).all()) and bool((cache.data.view(torch.uint8) == 0).all())


def test_unscaled_caches_have_no_scales_and_auto_is_the_compute_dtype() -> None:
    assert resolve_kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        cache = KVCache.allocate(1, 2, 4, 1, 8, resolve_kv_dtype(name, torch.float32), "cpu")
        assert cache.dtype == dtype and cache.scales is None and cache.layer_scales(0) == (None, None)
    with pytest.raises(ValueError, match="needs scales"):
        KVCache(torch.zeros(1, 2, 1, 4, 1, 8, dtype=torch.int8))
