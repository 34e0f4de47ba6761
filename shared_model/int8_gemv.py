"""An int8 GEMV for a few activation rows on CPUs with AVX-512 VNNI: the decode steps of an int8 model.

Contract:
- `int8_gemv(x, q, scales)`: x `[K]` or `[M, K]`, q int8 `[N, K]` (contiguous), scales `[N]` → `[N]` or `[M, N]` in
  x's dtype = scales · (q @ quantize_activation(x)): each activation row is rounded to int8 in groups of
  `activation_group(K)` inputs (one scale per group, max|x| / 127), as llama.cpp rounds activations for its Q8 dot
  products, and the products run as int8 × int8 on `vpdpbusd`. A row's result has the same bits at any M.
  `reference(x, q, scales)` is the same in plain torch (fp32 sums in another order); the tests hold the kernel
  to it. `MAX_ROWS`: the most rows a layer gives it in a call where no AMX tiles take its rows from two.
- It is the C++ operator `torch.ops.tandem.int8_gemv(x, q, scales, group)` (x and scales in fp32 or
  bf16, the result in x's dtype), with a fake kernel for tracing: a compiled decode step calls it through the
  dispatcher, with no Python wrapper (a wrapper's cost a call, paid once per quantized layer and step, was most of
  the difference between the kernel alone and in a step; measured: docs/benchmarks-archive.md §7, "Where a served
  int8 token goes").
- `available()`: True when this machine can run it: Tandem's native library (`tandem_native`) is built (x86-64
  Linux with AVX-512 VNNI, a C++ compiler and ninja). Whether a layer uses it is its builder's choice
  (`shared_model.quantize`'s `row_kernels`); otherwise it runs torch's `_weight_int8pack_mm`.
- Only rows whose length K is a multiple of 64 qualify (`activation_group(K)` is None otherwise), and only codes in
  [-127, 127], as `shared_model.quantize.quantize_int8` makes them (-128 is not checked for, per call: its product
  would take the wrong sign in the one-row path).
- Why: torch's `_weight_int8pack_mm` converts every weight to fp32 and multiplies there; this kernel multiplies
  bytes and reads more weight bytes a second, on sets that fit the caches and on sets larger than them
  (`benchmarks/gemv_probe.py`; measured: docs/benchmarks.md §15 and docs/benchmarks-archive.md §7, "An int8 × int8
  GEMV with AVX-512 VNNI"). For a step of many rows without AMX it reads the weight's bytes once for all of them,
  where dequantize + GEMM writes and reads a bf16 copy of the weight every call (docs/benchmarks.md §43).
- A row holding NaN or Inf gives NaN outputs (its groups' scales are NaN), as a float product would.
"""

from __future__ import annotations

import torch

import tandem_native

MAX_ROWS = 64
"""The most rows of a call to `int8_gemv` from a layer without AMX tiles: a decode step of up to 64 streams (and a
prompt chunk that short, whose activations are then rounded to int8 too); a longer chunk's rows go to oneDNN's GEMM
over the dequantized weight (docs/benchmarks.md §43)."""


def activation_group(k: int) -> int | None:
    """Inputs per activation scale for rows of length `k`: the largest of 256, 128, 64 dividing it, else None."""
    return next((g for g in (256, 128, 64) if k % g == 0), None)


def quantize_activation(x: torch.Tensor, group: int) -> torch.Tensor:
    """x `[..., K]` rounded as the kernel rounds it, back in fp32: per group s = max|x| / 127, x ≈ s·round(x/s);
    a group whose s is below the smallest normal float is zero, and one holding NaN or Inf is NaN."""
    xg = x.float().reshape(-1, group)  # [rows * G, group]
    s = xg.abs().amax(dim=1, keepdim=True) / 127  # [G, 1]
    live = s >= torch.finfo(torch.float32).tiny
    inv = torch.where(live, 1 / s, torch.zeros_like(s))
    q = torch.round(xg * inv) * torch.where(live, s, torch.zeros_like(s))
    finite = torch.isfinite(xg).all(dim=1, keepdim=True)
    return torch.where(finite, q, torch.full_like(q, float("nan"))).view(x.shape)


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What `int8_gemv` computes, in plain torch: `[N]` for x `[K]`, `[M, N]` for x `[M, K]`."""
    group = activation_group(q.shape[1])
    assert group is not None
    return (quantize_activation(x, group) @ q.float().t()) * scales.float()


def available() -> bool:
    """Whether `int8_gemv` can run here (`tandem_native` builds it on first call)."""
    return tandem_native.available()


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """scales · (q @ quantize_activation(x)), `[N]` or `[M, N]` in x's dtype (see the module docstring): the operator
    `torch.ops.tandem.int8_gemv(x, q, scales, group)`, which a layer calls directly with its group."""
    group = activation_group(q.shape[1])
    if not tandem_native.available() or group is None:
        raise RuntimeError("int8_gemv is not available here (check available() and activation_group() first)")
    return torch.ops.tandem.int8_gemv(x, q, scales, group)
