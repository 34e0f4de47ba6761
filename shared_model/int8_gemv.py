"""An int8 GEMV for one activation row on CPUs with AVX-512 VNNI: the batch-1 decode step of an int8 model.

Contract:
- `int8_gemv(x, q, scales)`: x `[K]`, q int8 `[N, K]` (contiguous), scales `[N]` → `[N]` in x's dtype =
  scales · (q @ quantize_activation(x)): the activation row is rounded to int8 in groups of `activation_group(K)`
  inputs (one scale per group, max|x| / 127), as llama.cpp rounds activations for its Q8 dot products, and the
  products run as int8 × int8 on `vpdpbusd`. `reference(x, q, scales)` is the same in plain torch (fp32 sums in
  another order); the tests hold the kernel to it.
- It is the C++ operator `torch.ops.tandem_cpu.int8_gemv(x, q, scales, group)` (x and scales in fp32 or
  bf16, the result in x's dtype), with a fake kernel for tracing: a compiled decode step calls it through the
  dispatcher, with no Python wrapper (that wrapper cost about 20 µs a call, 49 calls a step).
- `available()`: True when this machine can run it: x86-64 Linux with the avx512bw and avx512_vnni CPU flags, a
  C++ compiler and ninja, and the extension built. It is built on first use with torch's extension builder,
  from `int8_gemv.cpp` beside this file, into `~/.cache/tandem/cpu_kernels/<hash>` (the hash covers the source,
  the flags, torch's and Python's versions and the compiler), so later processes load it in about a second
  (the first build takes about 30 s). A build lock left by a process killed mid-build is removed after
  `STALE_LOCK_S`. Any failure is logged once and makes it False: callers fall back to torch's kernels.
  `TANDEM_INT8_GEMV=0` turns it off.
- Only rows whose length K is a multiple of 64 qualify (`activation_group(K)` is None otherwise).
- Why: torch's `_weight_int8pack_mm` converts every weight to fp32 and multiplies there. On the 2-core VM
  (`benchmarks/gemv_probe.py`) this kernel, which multiplies bytes, was 1.47–1.52x faster: 23.7 against 16.2
  GB/s, and 15.6 against 10.2 GB/s on a set larger than the caches (docs/benchmarks.md §7).
- A row holding NaN or Inf gives NaN outputs (its groups' scales are NaN), as a float product would.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_gemv.cpp")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mfma", "-fopenmp"]
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")
STALE_LOCK_S = 600.0
"""A build lock older than this was left by a process that died while building."""


def activation_group(k: int) -> int | None:
    """Inputs per activation scale for rows of length `k`: the largest of 256, 128, 64 dividing it, else None."""
    return next((g for g in (256, 128, 64) if k % g == 0), None)


def quantize_activation(x: torch.Tensor, group: int) -> torch.Tensor:
    """x fp32 `[K]` rounded as the kernel rounds it, back in fp32: per group s = max|x| / 127, x ≈ s·round(x/s);
    a group whose s is below the smallest normal float is zero, and one holding NaN or Inf is NaN."""
    xg = x.float().view(-1, group)  # [G, group]
    s = xg.abs().amax(dim=1, keepdim=True) / 127  # [G, 1]
    live = s >= torch.finfo(torch.float32).tiny
    inv = torch.where(live, 1 / s, torch.zeros_like(s))
    q = torch.round(xg * inv) * torch.where(live, s, torch.zeros_like(s))
    finite = torch.isfinite(xg).all(dim=1, keepdim=True)
    return torch.where(finite, q, torch.full_like(q, float("nan"))).view(-1)


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What `int8_gemv` computes, in plain torch."""
    group = activation_group(q.shape[1])
    assert group is not None
    return (q.float() @ quantize_activation(x, group)) * scales.float()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@functools.cache
def _extension() -> Any | None:
    """The built extension, or None (logged once) where it cannot run or be built."""
    if os.environ.get("TANDEM_INT8_GEMV", "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        log.info("int8 GEMV kernel not used: the CPU lacks %s", ", ".join(missing))
        return None
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        log.warning("int8 GEMV kernel not built: no C++ compiler (set CXX); using torch's int8 kernel")
        return None
    from torch.utils.cpp_extension import is_ninja_available, load

    if not is_ninja_available():
        log.warning("int8 GEMV kernel not built: ninja is missing (pip install ninja); using torch's int8 kernel")
        return None
    key = [SOURCE.read_bytes().decode(), *FLAGS, torch.__version__, sys.version, os.path.realpath(compiler)]
    build = Path.home() / ".cache" / "tandem" / "cpu_kernels" / hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    try:
        build.mkdir(parents=True, exist_ok=True)
        _drop_stale_lock(build / "lock")
        module = load(
            name="tandem_int8_gemv",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
        _register_fake()  # the operator exists once the module is loaded
        return module
    except Exception as exc:  # a failed build must not stop serving: torch's kernel is correct, only slower
        log.warning("int8 GEMV kernel could not be built (%s: %s); using torch's int8 kernel", type(exc).__name__, exc)
        return None


def _drop_stale_lock(lock: Path) -> None:
    """torch's builder waits without a bound on its lock file; one left by a process killed mid-build (a build
    takes well under a minute) would hang every later start, so it is removed."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("removing a stale build lock %s", lock)
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def available() -> bool:
    """Whether `int8_gemv` can run here (builds the extension on first call; see the module docstring)."""
    return _extension() is not None


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """scales · (q @ quantize_activation(x)), `[N]` in x's dtype (see the module docstring): the operator
    `torch.ops.tandem_cpu.int8_gemv(x, q, scales, group)`, which a layer calls directly with its group."""
    group = activation_group(q.shape[1])
    if _extension() is None or group is None:
        raise RuntimeError("int8_gemv is not available here (check available() and activation_group() first)")
    return torch.ops.tandem_cpu.int8_gemv(x, q, scales, group)


def _register_fake() -> None:
    @torch.library.register_fake("tandem_cpu::int8_gemv")
    def _(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
        return x.new_empty((q.shape[0],))
