"""Tandem's one native library (C++ kernels for the CPU): see `tandem_native.loader` for its contract."""

from tandem_native.loader import available, build_dir, cpu_vendor, dot_bf16, library, status, tiles, unsupported

__all__ = ["available", "build_dir", "cpu_vendor", "dot_bf16", "library", "status", "tiles", "unsupported"]
