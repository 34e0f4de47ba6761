"""The scaled K/V formats (fp8 e4m3, int8): scales, quantize, dequantize, and the scale update of one write.

Contract (shared by the torch path, the reference and the Triton kernels; pure torch, no host sync):
- A scaled cache stores each element as `q = quantize(x / s)` with one fp32 scale `s` per (block, kv head) in
  `scales: [num_blocks, Hkv]`, beside the cache `[num_blocks, block_size, Hkv, D]`; a reader computes in fp32
  with `x ≈ q · s` (`dequantize`). int8 rounds half up (`floor(x / s + 0.5)`) into [-127, 127]; fp8 is
  `torch.float8_e4m3fn` (round to nearest even, saturated at ±448).
- Scales are powers of two, `s = 2^ceil(log2(amax / QMAX))` (QMAX 127 for int8, 448 for fp8), so amax / s lies
  in (QMAX/2, QMAX]: no calibration, no clipping, and rescaling by a ratio of two scales is an exponent shift
  (exact for fp8 outside its subnormals; for int8 one re-rounding).
- Error bounds of one round trip (`dequantize(quantize(x, s), s)` for |x| ≤ QMAX · s): int8 ≤ s / 2 absolute;
  fp8 (3 mantissa bits) ≤ 2^-4 relative to |x| for |x| / s ≥ 2^-6 (e4m3's smallest normal), else ≤ 2^-10 · s
  absolute (half its subnormal step). A value re-expressed by block growth (below): int8 within s (the growth
  steps are powers of two, so its earlier roundings sum to at most one more half-step at the final scale); fp8
  within 2^-4 · |x| + 2^-9 · s (a power-of-two rescale is exact unless it moves the value into the subnormals).
- `update_scales(x, scales, slots, block_size, dtype)` is a write's scale step: a block whose offset-0 token is in
  this write starts over (a reused block forgets its previous owner's scale); every other block's scale becomes
  max(its scale, the new tokens' need). It returns each token's block scale before and after, `[T, Hkv]` each,
  so a writer can rescale the block's earlier tokens by `old / new` and quantize the new ones with `new`.
  Assumes what the engine guarantees: slots ≥ 0, and the tokens of one block in one write are consecutive in
  `slots`, at increasing offsets (one sequence's chunk).
"""

from __future__ import annotations

import torch
from torch import Tensor

QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
"""The largest stored magnitude of each scaled dtype."""
SCALED_DTYPES = tuple(QMAX)
SCALE_FLOOR = 2.0**-100
"""Smallest scale: an all-zero head still gets a positive (power-of-two) scale."""


def as_bytes(t: Tensor) -> Tensor:
    """An fp8 tensor viewed as uint8 (torch's CPU index_copy_/index_select/index_fill_ do not take fp8); others
    unchanged. View the result back with `.view(dtype)`."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype carries per-(block, kv head) scales."""
    return dtype in QMAX


def check_scales(cache: Tensor, scales: Tensor | None, what: str) -> None:
    """ValueError unless `scales` is given exactly for a scaled cache, as `[num_blocks, Hkv]` fp32 (a kernel's
    argument check; reads shapes only)."""
    if is_scaled(cache.dtype) != (scales is not None):
        raise ValueError(f"{what}: a {cache.dtype} cache takes scales exactly when it is fp8 or int8")
    if scales is not None and (
        scales.dtype != torch.float32
        or tuple(scales.shape) != (cache.shape[0], cache.shape[2])
        or scales.stride(1) != 1
    ):
        raise ValueError(
            f"{what}: scales {tuple(scales.shape)} {scales.dtype} must be fp32 [{cache.shape[0]}, {cache.shape[2]}]"
        )


def pow2_scale(amax: Tensor, dtype: torch.dtype) -> Tensor:
    """The smallest power of two s with amax / s ≤ QMAX (fp32, same shape as amax)."""
    need = (amax.float() / QMAX[dtype]).clamp_min(SCALE_FLOOR)
    mantissa, exponent = torch.frexp(need)  # need = mantissa · 2^exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two is its own scale
    return torch.ldexp(torch.ones_like(need), exponent)


def quantize(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """x / scale in the stored dtype (scale broadcasts against x; computed in fp32)."""
    y = x.float() / scale
    if dtype == torch.int8:
        return torch.floor(y + 0.5).clamp_(-127.0, 127.0).to(torch.int8)
    if dtype == torch.float8_e4m3fn:
        return y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    raise ValueError(f"quantize: {dtype} is not a scaled K/V dtype ({SCALED_DTYPES})")


def dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """q · scale in fp32."""
    return q.float() * scale


def update_scales(
    x: Tensor, scales: Tensor, slots: Tensor, block_size: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Raise (or restart) the scales of the blocks this write touches; returns (old, new) per token `[T, Hkv]`.

    x `[T, Hkv, D]`, scales `[num_blocks, Hkv]` fp32 (updated in place), slots `[T]` int64 ≥ 0.
    """
    slots = slots.long()
    t = slots.shape[0]
    blk = slots // block_size  # [T]
    off = slots - blk * block_size
    first = torch.arange(t, device=slots.device) - off  # where this block's offset-0 token sits, if in this write
    fresh = (first >= 0) & (slots[first.clamp_min(0)] == blk * block_size)  # [T]
    old = torch.where(fresh[:, None], 0.0, scales[blk])  # [T, Hkv]; the same row for every token of a block
    scales.index_put_((blk,), old)
    need = pow2_scale(x.abs().amax(-1), dtype)  # [T, Hkv]
    scales.scatter_reduce_(0, blk[:, None].expand_as(need), need, "amax", include_self=True)
    return old, scales[blk]


def run_leaders(slots: Tensor, block_size: int) -> Tensor:
    """[T] bool: the first token of each block's run in this write (the one that rescales the block's past)."""
    blk = slots.long() // block_size
    lead = torch.ones_like(blk, dtype=torch.bool)
    lead[1:] = blk[1:] != blk[:-1]
    return lead


def requantize(q: Tensor, factor: Tensor) -> Tensor:
    """Stored values re-expressed at a larger scale: q · (old / new), factor broadcasting against q."""
    return quantize(q.float(), 1.0 / factor, q.dtype) if q.dtype == torch.int8 else (q.float() * factor).to(q.dtype)


def store_scaled(x: Tensor, cache: Tensor, scales: Tensor, slots: Tensor) -> None:
    """Write x `[T, Hkv, D]` into a scaled cache `[num_blocks, block_size, Hkv, D]` at `slots` (torch, any device).

    The earlier tokens of a block whose scale grew are rescaled first (whole blocks; the slots this write fills
    are overwritten right after), then each new token is quantized with its block's new scale.
    """
    if slots.shape[0] == 0:
        return
    bs, hkv, dim = cache.shape[1], cache.shape[2], cache.shape[3]
    old, new = update_scales(x, scales, slots, bs, cache.dtype)
    grown = run_leaders(slots, bs) & (old > 0).all(-1) & (old != new).any(-1)  # [T]
    if bool(grown.any()):
        rows = grown.nonzero()[:, 0]
        blocks = slots[rows].long() // bs
        factor = (old[rows] / new[rows])[:, None, :, None]  # [n, 1, Hkv, 1]
        past = as_bytes(cache).index_select(0, blocks).view(cache.dtype)  # [n, bs, Hkv, D]
        as_bytes(cache).index_copy_(0, blocks, as_bytes(requantize(past, factor)))
    new_q = quantize(x, new[:, :, None], cache.dtype)  # [T, Hkv, D]
    as_bytes(cache).view(-1, hkv, dim).index_copy_(0, slots.long(), as_bytes(new_q))
