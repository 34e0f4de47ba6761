"""Tandem's one native library: every C++ kernel in `csrc/`, one build, one op namespace (`tandem`).

Contract:
- `library()` is the built extension module, or None where it cannot run here: anything but x86-64 Linux, a CPU
  without the avx512f, avx512bw, avx512vl and avx512_vnni flags, no C++ compiler ($CXX, else c++), no ninja, or a
  failed build. Why it is None is logged once; `status()` returns it as a sentence. Callers then run torch's
  kernels, which compute the same thing, slower. Whether a served model uses the library is the serving executor's
  recorded choice (`EngineConfig.cpu_kernels`, `inference_svc.executor.prepare`), passed to each module as an
  argument: nothing here reads a switch.
- Once loaded, the operators exist (`torch.ops.tandem.*`), each with a fake kernel for tracing registered here, so a
  compiled step calls them through the dispatcher with no Python wrapper: `int8_gemv` (`shared_model.int8_gemv`),
  `int4_gemv` and `int4_dequantize` (`shared_model.int4_gemv`), `row_gemm`, `tile_gemm`, `dot_gemm` and `table_gemm`
  (row_gemm, the many-row kernel or `at::mm` by the row count: `shared_model.serving_model`), `tile_gemm_int8` and
  `tile_gemm_int4` (`shared_model.quantize`), `paged_attention` (`inference_svc.attention.native_cpu`) and `lora_delta_`
  (`inference_svc.lora.slots`, in place). The module's own functions (`decode_attention`, `store_kv`, `decode_step`,
  `truncation_thresholds`, `sample_rows`, `greedy_rows`, `int8_gemv`, `lora_delta_`, `tile_gemm_ready`,
  `dot_gemm_ready`) are called from Python directly: `tiles()` and `dot_bf16()` say whether the many-row bf16 kernels
  run (AMX tiles; AVX512_BF16 dot products).
- The build: torch's extension builder compiles `SOURCES` with `FLAGS` in `~/.cache/tandem/native/<hash>/`, the
  hash covering the sources' and `HEADERS`' names and text, the flags, torch's and Python's versions and the
  compiler. The sources are copied there first and built from the copies, so every clone of the same commit
  shares one build (a fresh clone's bootstrap loads it in about a second). A build lock left by a process killed
  mid-build is removed after `STALE_LOCK_S` (torch's builder would wait on it forever). `python -m tandem_native`
  (and `tandem build-kernels`) builds it ahead of the first start; `scripts/bootstrap.sh` and the inference image
  run it.
- This package imports neither `shared_model` nor `inference_svc`: both import it.
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
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

NAME = "tandem_native"
CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
"""Included by the sources: copied beside them and part of the build's hash."""
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-fopenmp"]
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
STALE_LOCK_S = 600.0
"""A build lock older than this was left by a process that died while building."""
CACHE = Path.home() / ".cache" / "tandem" / "native"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ('GenuineIntel', 'AuthenticAMD'), or '' where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in text.splitlines() if line.startswith("vendor_id")), "")
    return line.split(":", 1)[-1].strip()


def unsupported() -> str | None:
    """Why the library cannot be built or run on this machine (a phrase), or None when it can."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"it needs x86-64 Linux, this is {platform.machine()} {platform.system()}"
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler ($CXX, else c++)"
    return None


def library() -> Any | None:
    """The built module, or None (logged once) where it cannot run or be built. Threads calling it at once wait
    for one build."""
    with _BUILD_LOCK:
        return _load()


_BUILD_LOCK = threading.Lock()


def available() -> bool:
    """Whether the library runs here (builds it on first call)."""
    return library() is not None


def status() -> tuple[bool, str]:
    """(Whether the library runs here, why or why not), for the serving executor's record."""
    why_not = unsupported()
    if why_not is not None:
        return False, why_not
    if library() is None:
        return False, "it could not be built here (ninja missing or a failed build: see the log)"
    extra = [f for f in ("amx_tile", "avx512_bf16") if f in _cpu_flags()]
    return True, "built for this CPU (AVX-512 BW/VL/VNNI" + "".join(f", {f}" for f in extra) + ")"


def dot_bf16() -> bool:
    """Whether `tandem::dot_gemm` runs in this process: the library is built and the CPU has AVX512_BF16 (the
    many-row bf16 kernel where AMX tiles are not usable)."""
    module = library()
    return module is not None and bool(module.dot_gemm_ready())


def tiles() -> bool:
    """Whether `tandem::tile_gemm` runs in this process: the library is built and the CPU has AMX-BF16 tiles that
    Linux lets this process use (asked once, by the library itself)."""
    module = library()
    return module is not None and bool(module.tile_gemm_ready())


def build_dir() -> Path:
    """The cache folder of this build: a hash of everything the build depends on, not of where the sources are."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or "none"
    key = [NAME, *(f"{s.name}\0{s.read_text()}" for s in (*SOURCES, *HEADERS)), *FLAGS, torch.__version__, sys.version]
    key.append(os.path.realpath(compiler))
    return CACHE / hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]


@functools.cache
def _load() -> Any | None:
    why_not = unsupported()
    if why_not is not None:
        log.info("Tandem's native kernels not used: %s; using torch's kernels", why_not)
        return None
    build = build_dir()
    try:
        module = _import_built(build / f"{NAME}.so")
        if module is None:
            module = _compile(build)
        if module is not None:
            _register_fakes()  # the operators exist once the module is loaded
        return module
    except Exception as exc:  # a failed build must not stop serving: torch's kernels are correct, only slower
        what = f"{type(exc).__name__}: {exc}"
        log.warning("Tandem's native kernels could not be built (%s); using torch's kernels", what)
        return None


def _compile(build: Path) -> Any | None:
    """torch's builder over copies of `SOURCES` in `build` (None, logged, without ninja)."""
    from torch.utils.cpp_extension import is_ninja_available, load

    if not is_ninja_available():
        log.warning("Tandem's native kernels not built: ninja is missing (pip install ninja); using torch's kernels")
        return None
    src = build / "src"
    src.mkdir(parents=True, exist_ok=True)
    for s in (*SOURCES, *HEADERS):  # the build file names the cache's paths only: any clone of the commit shares it
        if not (src / s.name).is_file() or (src / s.name).read_text() != s.read_text():
            shutil.copyfile(s, src / s.name)
    _drop_stale_lock(build / "lock")
    return load(
        name=NAME,
        sources=[str(src / s.name) for s in SOURCES],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        verbose=False,
    )


def _import_built(path: Path) -> Any | None:
    """The module at `path` when a build left it there, else None. The build folder's hash covers everything the
    build depends on, so a library there is current: importing it directly skips torch's builder, which runs ninja
    to check it (about 1.5 s a process). A library that does not load (one being written now) gives None."""
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(NAME, path)
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


def _register_fakes() -> None:
    @torch.library.register_fake("tandem::int8_gemv")
    def _(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], q.shape[0]))  # [N] or [M, N]

    @torch.library.register_fake("tandem::dot_gemm")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("tandem::row_gemm")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("tandem::tile_gemm")
    def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("tandem::table_gemm")
    def _(x: torch.Tensor, w: torch.Tensor, row_max: int, tile_max: int, onednn: bool = False) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("tandem::tile_gemm_int8")
    def _(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], q.shape[0]))

    @torch.library.register_fake("tandem::tile_gemm_int4")
    def _(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0]))

    @torch.library.register_fake("tandem::int4_gemv")
    def _(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], codes.shape[0]))

    @torch.library.register_fake("tandem::int4_dequantize")
    def _(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
        return scales_and_zeros.new_empty((codes.shape[0], 2 * codes.shape[1]))

    @torch.library.register_fake("tandem::lora_delta_")
    def _(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor, w: torch.Tensor):
        del y, x, a, bt, slots, w  # writes y in place, returns nothing

    @torch.library.register_fake("tandem::paged_attention")
    def _(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer_idx: int,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        del k, v, kv_cache, layer_idx, slot_mapping, context_lens, block_tables, scale
        return q.new_empty(q.shape)  # contiguous, q's shape and dtype: what decode_step returns


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem_native` / `tandem build-kernels`: build the library now (the bootstrap and the inference
    image do, so that no first start pays for it); prints one line. Exit 0 also where it cannot be built here."""
    del argv
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    start = time.perf_counter()
    ok, why = status()
    what = f"ready in {build_dir()}" if ok else f"not built here ({why}): torch's kernels run"
    print(f"native kernels: {what} ({time.perf_counter() - start:.1f} s)")
    return 0
