"""An int4 GEMV for a decode batch (1 to `MAX_ROWS` activation rows) on CPUs with AVX-512 VNNI.

Contract:
- Weight format: `shared_model.quantize`'s int4, w = (q - 8)·s + z per row and group of `group` inputs, q in 0..15.
  The kernel's layout: `codes` uint8 `[N, K/2]` from `pack(q)` (per block of 64 inputs, byte i holds input i in
  its low nibble and input 32 + i in its high nibble; `unpack` inverts it), and `scales_and_zeros` `[N, 2, K/group]`
  (each row's scales, then its zeros) in the model's dtype (read as stored).
- `int4_gemv(x, codes, scales_and_zeros, group)`: x `[M, K]` with M in 1..`MAX_ROWS` → `[M, N]` in x's dtype =
  quantize_activation(x) @ Wᵀ: each row is rounded to int8 in the weight's groups (one scale per group,
  max|x| / 127, as llama.cpp rounds activations for its Q4_0 dot products), the codes times the bytes run on
  `vpdpbusd` with exact integer sums per group, then scaled in fp32. `reference(...)` is the same in plain torch;
  the tests hold the kernel to it. A row holding NaN or Inf gives NaN outputs.
- It is the C++ operator `torch.ops.tandem_cpu.int4_gemv`, built with the other CPU kernels
  (`shared_model.cpu_kernels`), with a fake kernel for tracing. `available(group)`: whether it runs here for
  that group size (a multiple of 64, and the kernels built).
- `enabled()`: whether int4 layers use it, only with `TANDEM_INT4_GEMV=1`. Off by default, because it did not
  pay where it matters: alone it is 1.4-2x faster than torch's kernel at the 82M model's shapes, but a compiled
  int4 decode step was 8% slower with it (11.3 against 10.5 ms, same process, alternating requests; eager it
  was 3% faster), and served int4 decode was slower too (docs/benchmarks.md §7). Why is not understood yet.
- Why: torch's `_weight_int4pack_mm_for_cpu` converts the weights to floats and multiplies there, and read its
  int4 bytes at 11.7-14.3 GB/s on the 2-core VM, where llama.cpp's Q4_0 decode multiplies bytes
  (docs/benchmarks.md §7).
"""

from __future__ import annotations

import os

import torch

from shared_model import cpu_kernels
from shared_model.int8_gemv import quantize_activation

MAX_ROWS = 4
"""Activation rows per call (the kernel reads each weight row once for all of them)."""


def enabled() -> bool:
    """Whether int4 layers run this kernel (`TANDEM_INT4_GEMV=1`; see the module docstring)."""
    return os.environ.get("TANDEM_INT4_GEMV", "0") == "1"


def available(group: int) -> bool:
    """Whether `int4_gemv` runs here for weights in groups of `group` inputs."""
    return group % 64 == 0 and cpu_kernels.available()


def pack(q: torch.Tensor) -> torch.Tensor:
    """Codes uint8 `[N, K]` in 0..15 (K a multiple of 64) → the kernel's `[N, K/2]` layout."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // 64, 2, 32)
    return (blocks[:, :, 0] | blocks[:, :, 1] << 4).reshape(n, k // 2)


def unpack(codes: torch.Tensor) -> torch.Tensor:
    """`pack`'s inverse: `[N, K/2]` → codes uint8 `[N, K]`."""
    n, half = codes.shape
    blocks = codes.view(n, half // 32, 1, 32)
    return torch.cat([blocks & 15, blocks >> 4], dim=2).reshape(n, 2 * half)


def dequantize(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The fp32 `[N, K]` weight the kernel multiplies by: (q - 8)·s + z with s and z as stored."""
    q = unpack(codes).float()
    n, k = q.shape
    sz = scales_and_zeros.float()[..., None]  # [N, 2, G, 1]
    return ((q.view(n, k // group, group) - 8) * sz[:, 0] + sz[:, 1]).view(n, k)


def reference(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """What `int4_gemv` computes, in plain torch: `[M, N]` fp32."""
    xq = quantize_activation(x.float().reshape(-1), group).view(x.shape)  # groups never span rows
    return xq @ dequantize(codes, scales_and_zeros, group).t()


def int4_gemv(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """quantize_activation(x) @ Wᵀ, `[M, N]` in x's dtype (see the module docstring)."""
    if not available(group):
        raise RuntimeError("int4_gemv is not available here (check available(group) first)")
    return torch.ops.tandem_cpu.int4_gemv(x, codes, scales_and_zeros, group)
