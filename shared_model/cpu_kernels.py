"""Tandem's hand-written CPU kernels: one C++ extension, built on first use, with a torch fallback everywhere.

Contract:
- `extension()` is the built extension module, or None where the kernels cannot run here: anything but x86-64
  Linux, a CPU without the avx512f, avx512bw, avx512vl and avx512_vnni flags, no C++ compiler ($CXX, else c++)
  or no ninja, or a failed build. Why it is None is logged once. Callers then run torch's kernels, which compute
  the same thing, slower. Whether a served model uses them is the serving executor's recorded choice
  (`EngineConfig.cpu_kernels`, `inference_svc.executor.prepare`), passed to each module: no switch is read here.
- `status()`: (whether they run here, one sentence saying why or why not), for that record.
- Once loaded, the operators of the `tandem_cpu` library exist (`torch.ops.tandem_cpu.*`), each with a fake
  kernel for tracing (registered here), so a compiled step calls them through the dispatcher with no Python
  wrapper: `int8_gemv` (`shared_model.int8_gemv`), `int4_gemv` (`shared_model.int4_gemv`) and `row_gemm`
  (a few fp32 or bf16 rows times a weight of the same dtype, summed in fp32 with each row's arithmetic independent
  of the row count: the compiled step's decode and verify projections, `shared_model.fuse`).
- `available()`: whether `extension()` is not None.
- `build(name, sources)` is the same for another package's kernels (`inference_svc.kernels.cpu_attention`,
  `inference_svc.kernels.cpu_sampling`).
- The build: torch's extension builder compiles `SOURCES` (beside this file) with `FLAGS` into
  `~/.cache/tandem/cpu_kernels/<hash>`, the hash covering the sources (paths and text), the flags, torch's and
  Python's versions and the compiler, so a later process loads it in about a second (the first build takes
  30-60 s; `scripts/bootstrap.sh` runs it). A build lock left by a process killed mid-build is removed after
  `STALE_LOCK_S` (torch's builder would wait on it forever).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(f"{name}.cpp") for name in ("int8_gemv", "int4_gemv", "row_gemm")]
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-fopenmp"]
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
STALE_LOCK_S = 600.0
"""A build lock older than this was left by a process that died while building."""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def extension() -> Any | None:
    """The built extension of `SOURCES`, or None (logged once) where it cannot run or be built."""
    return build("tandem_cpu_kernels", tuple(SOURCES), _register_fakes)


def build(name: str, sources: tuple[Path, ...], on_load: Callable[[], None] | None = None) -> Any | None:
    """Extension `name` built from `sources` with `FLAGS` (and `on_load()` run once it is loaded), or None (logged
    once) where it cannot run or be built: the rules of the module docstring, for any package's kernels. Threads
    calling it at once wait for one build."""
    with _BUILD_LOCK:
        return _build(name, sources, on_load)


_BUILD_LOCK = threading.Lock()


@functools.cache
def _build(name: str, sources: tuple[Path, ...], on_load: Callable[[], None] | None) -> Any | None:
    why_not = _unsupported()
    if why_not is not None:
        log.info("Tandem's CPU kernels not used: %s; using torch's kernels", why_not)
        return None
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    assert compiler is not None  # `_unsupported` checked it
    # the sources' paths too: torch's builder rebuilds when its build file names other paths (another checkout)
    key = [name, *(f"{s}\0{s.read_text()}" for s in sources), *FLAGS, torch.__version__, sys.version]
    key.append(os.path.realpath(compiler))
    build = Path.home() / ".cache" / "tandem" / "cpu_kernels" / hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    try:
        module = _import_built(name, build / f"{name}.so")
        if module is None:
            module = _compile(name, sources, build)
        if module is not None and on_load is not None:
            on_load()  # e.g. fake kernels: the operators exist once the module is loaded
        return module
    except Exception as exc:  # a failed build must not stop serving: torch's kernels are correct, only slower
        log.warning("Tandem's CPU kernels could not be built (%s: %s); using torch's kernels", type(exc).__name__, exc)
        return None


def _unsupported() -> str | None:
    """Why the kernels cannot be built or run on this machine (a phrase), or None when they can."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"they need x86-64 Linux, this is {platform.machine()} {platform.system()}"
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler ($CXX, else c++)"
    return None


def status() -> tuple[bool, str]:
    """(Whether the kernels run here, why or why not): builds them on first call, as `available()` does."""
    why_not = _unsupported()
    if why_not is not None:
        return False, why_not
    if extension() is None:
        return False, "they could not be built here (ninja missing or a failed build: see the log)"
    flags = ", ".join(f for f in ("amx_tile", "avx512_bf16") if f in _cpu_flags())
    return True, f"built for this CPU (AVX-512 BW/VL/VNNI{', ' + flags if flags else ''})"


def _compile(name: str, sources: tuple[Path, ...], build: Path) -> Any | None:
    """torch's builder over `sources` into `build` (None, logged, without ninja)."""
    from torch.utils.cpp_extension import is_ninja_available, load

    if not is_ninja_available():
        log.warning("Tandem's CPU kernels not built: ninja is missing (pip install ninja); using torch's kernels")
        return None
    build.mkdir(parents=True, exist_ok=True)
    _drop_stale_lock(build / "lock")
    return load(
        name=name,
        sources=[str(s) for s in sources],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        verbose=False,
    )


def _import_built(name: str, path: Path) -> Any | None:
    """The module at `path` when a build left it there, else None. The build folder's hash covers everything the
    build depends on, so a library there is current: importing it directly skips torch's builder, which runs ninja
    to check it (about 1.5 s a process). A library that does not load (one being written now) gives None."""
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError):
        return None
    return module


def _drop_stale_lock(lock: Path) -> None:
    """torch's builder waits without a bound on its lock file; one left by a process killed mid-build (a build
    takes about a minute) would hang every later start, so it is removed."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("removing a stale build lock %s", lock)
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def available() -> bool:
    """Whether the kernels can run here (builds the extension on first call; see the module docstring)."""
    return extension() is not None


def _register_fakes() -> None:
    @torch.library.register_fake("tandem_cpu::int8_gemv")
    def _(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
        return x.new_empty((q.shape[0],))

    @torch.library.register_fake("tandem_cpu::row_gemm")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("tandem_cpu::int4_gemv")
    def _(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0]))

    @torch.library.register_fake("tandem_cpu::int4_dequantize")
    def _(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
        return scales_and_zeros.new_empty((codes.shape[0], 2 * codes.shape[1]))


def main() -> int:
    """`python -m shared_model.cpu_kernels`: build every package's CPU kernels now (the bootstrap and the inference
    image do, so that no first start pays for it); prints one line. Exit 0 also where they cannot be built here."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    start = time.perf_counter()
    built = available()
    try:
        from inference_svc.kernels import cpu_attention, cpu_sampling  # the serving half's, where it is installed
    except ImportError:
        pass
    else:
        built = built and cpu_attention.extension() is not None and cpu_sampling.extension() is not None
    what = "ready" if built else "not built here: torch's kernels run (see the warnings above)"
    print(f"CPU kernels: {what} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
