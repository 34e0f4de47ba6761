"""An int4 GEMV for a decode batch (1 to `MAX_ROWS` activation rows) on CPUs with AVX-512 VNNI.

Contract:
- Weight format: `shared_model.quantize`'s int4, w = (q - 8)·s + z per row and group of `group` inputs, q in 0..15.
  The kernel's layout (`pack(q, group)`, inverted by `unpack`): codes uint8 `[N, K/2]`, and `scales_and_zeros`
  `[2, N, K/group]` (all the scales, then all the zeros) in the model's dtype, read as stored.
  - One 32-bit vector lane per (row, group). Rows go in blocks of P = `block_rows(G)` = 16 / gcd(G, 16) (G groups
    a row), so that a block's P·G groups fill whole tiles of 16 lanes: (row p of the block, group g) is lane
    (p·G + g) % 16 of tile (p·G + g) / 16. Blocks are N/P consecutive runs of P·K/2 bytes (N a multiple of P:
    `shared_model.quantize` asks 16).
  - A tile is group/8 steps of 64 bytes. In step j, lane l's 4 bytes hold its group's inputs 4j..4j+3 in their
    low nibbles and group/2 + 4j..+3 in their high nibbles.
  So one aligned 64-byte load gives 128 codes, two ANDs split them, and two `vpdpbusd` add every group's products
  into that group's own lane; a tile's 16 scales and zeros are 16 consecutive values of `scales_and_zeros`.
- `int4_gemv(x, codes, scales_and_zeros, group)`: x `[M, K]` with M in 1..`MAX_ROWS` → `[M, N]` in x's dtype =
  quantize_activation(x) @ Wᵀ: each row is rounded to int8 in the weight's groups (one scale per group,
  max|x| / 127, as llama.cpp rounds activations for its Q4_0 dot products), the codes times the bytes run on
  `vpdpbusd` with exact integer sums per group, then scaled in fp32. `reference(...)` is the same in plain torch;
  the tests hold the kernel to it. A row holding NaN or Inf gives NaN outputs.
- `torch.ops.tandem.int4_dequantize(codes, scales_and_zeros, group)`: the weight `[N, K]` in the scales'
  dtype, bitwise `dequantize(...)` rounded to it (what a layer's calls of more rows, prefill chunks, multiply by).
- It is the C++ operator `torch.ops.tandem.int4_gemv`, built with the other CPU kernels
  (`tandem_native`), with a fake kernel for tracing. `available(group)`: whether it runs here for
  that group size (a multiple of 32, and the kernels built).
- Whether int4 layers use it is their builder's choice (`shared_model.quantize`'s `row_kernels`, which serving takes
  from `EngineConfig.int4_kernel`).
- Why: torch's `_weight_int4pack_mm_for_cpu` converts the weights to floats and multiplies there, where
  llama.cpp's Q4_0 decode multiplies bytes. This kernel's first layout (one row's groups of 64 inputs per vector,
  a shuffle and a conversion per group) was no faster than torch's in a compiled step; the lane-per-group layout
  reads the int4 bytes about twice as fast (figures: docs/benchmarks-archive.md §7).
"""

from __future__ import annotations

import math

import torch

import tandem_native
from shared_model.int8_gemv import quantize_activation

MAX_ROWS = 16
"""Activation rows per call, 4 at a time over the whole weight (a 16-stream decode step's projections; more rows,
prefill chunks, take the dequantized weight and the dense GEMM: docs/benchmarks.md §16). Where the AMX tiles run,
an int4 layer in bf16 calls it for fewer rows (`shared_model.quantize.INT4_TILE_MIN_ROWS`)."""
LANES = 16
"""Groups per tile of the layout: one 32-bit lane of an AVX-512 vector each."""


def available(group: int) -> bool:
    """Whether `int4_gemv` runs here for weights in groups of `group` inputs."""
    return group % 32 == 0 and tandem_native.available()


def block_rows(groups: int) -> int:
    """Rows per block of the layout for rows of `groups` groups: P = 16 / gcd(G, 16), so a block's P·G groups fill
    whole tiles of 16 lanes."""
    return LANES // math.gcd(groups, LANES)


def pack(q: torch.Tensor, group: int) -> torch.Tensor:
    """Codes uint8 `[N, K]` in 0..15 (K a multiple of `group`, itself of 32; N of `block_rows(K / group)`) → the
    kernel's `[N, K/2]` layout (see the module docstring)."""
    n, k = q.shape
    groups, steps, half = k // group, group // 8, group // 2
    p = block_rows(groups)
    if n % p:
        raise ValueError(f"int4_gemv.pack: {n} rows are not a multiple of {p} (blocks of 16 / gcd({groups}, 16))")
    flat = q.to(torch.uint8).reshape(n // p, p * groups, group)  # [blocks, P·G, group]: (row, group) pairs in order
    lo = flat[..., :half].reshape(n // p, -1, LANES, steps, 4)  # [blocks, tiles, 16, steps, 4]
    hi = flat[..., half:].reshape(n // p, -1, LANES, steps, 4)
    return (lo | hi << 4).transpose(2, 3).reshape(n, k // 2)  # [blocks, tiles, steps, 16, 4]


def unpack(codes: torch.Tensor, group: int) -> torch.Tensor:
    """`pack`'s inverse: `[N, K/2]` → codes uint8 `[N, K]`."""
    n, half_k = codes.shape
    k = 2 * half_k
    groups, steps = k // group, group // 8
    p = block_rows(groups)
    tiled = codes.reshape(n // p, -1, steps, LANES, 4).transpose(2, 3)  # [blocks, tiles, 16, steps, 4]
    lo, hi = (tiled & 15).reshape(n // p, p * groups, -1), (tiled >> 4).reshape(n // p, p * groups, -1)
    return torch.cat([lo, hi], dim=2).reshape(n, k)


def dequantize(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The fp32 `[N, K]` weight the kernel multiplies by: (q - 8)·s + z with s and z as stored."""
    q = unpack(codes, group).float()
    n, k = q.shape
    sz = scales_and_zeros.float()[..., None]  # [2, N, G, 1]
    return ((q.view(n, k // group, group) - 8) * sz[0] + sz[1]).view(n, k)


def reference(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """What `int4_gemv` computes, in plain torch: `[M, N]` fp32."""
    xq = quantize_activation(x.float().reshape(-1), group).view(x.shape)  # groups never span rows
    return xq @ dequantize(codes, scales_and_zeros, group).t()


def int4_gemv(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """quantize_activation(x) @ Wᵀ, `[M, N]` in x's dtype (see the module docstring)."""
    if not available(group):
        raise RuntimeError("int4_gemv is not available here (check available(group) first)")
    return torch.ops.tandem.int4_gemv(x, codes, scales_and_zeros, group)
