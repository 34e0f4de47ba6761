"""llama.cpp for the CPU peer benchmark: built from the llama-cpp-python source release on PyPI, cached per version.

`ensure_tools(version)` downloads the sdist (`pip download llama-cpp-python==VERSION --no-binary :all: --no-deps`),
unpacks it and builds the targets `llama-bench` and `llama-quantize` of its vendored llama.cpp (cmake + ninja,
Release, CPU only, static libraries, GGML_NATIVE=ON, no CURL/OpenSSL/server/tests/examples) under
`~/.cache/tandem/llama.cpp/<version>/` (`$TANDEM_CACHE` replaces `~/.cache/tandem`). Each step works in a temporary
folder beside its result and renames it into place only when it succeeded, under a file lock, so an interrupted or
concurrent run never leaves a half-built tree that a later run would trust. A second run reuses the cache.
`ensure_tools(version, server=True)` also builds `llama-server` in the same `build/` folder (configured with
-DLLAMA_BUILD_SERVER=ON, which only adds that target: ggml and llama are compiled once for all three); a tools-only
call accepts either configuration, a server call rebuilds a folder configured without it (all three targets at once).
`ensure_examples(tools, targets)` builds example programs (default `llama-lookup`, for
`benchmarks/speculative.py`) the same way in a second folder, `build-examples/`, configured with
-DLLAMA_BUILD_EXAMPLES=ON (and the tools' other flags) and building only those targets; about 30 minutes on 2
busy cores, since ggml and llama are compiled again there.

`convert_to_gguf(...)` runs the sdist's own `convert_hf_to_gguf.py` (with its own gguf-py) on a Hugging Face folder.
Random tokenizers are unknown to its pre-tokenizer table; speed does not depend on the pre-tokenizer, so the
converter runs under a small wrapper that maps an unrecognized one to llama.cpp's "default" (the vendored file is not
edited) and the result says so. `quantize(...)` and `bench(...)` run the built tools.

    .venv/bin/python benchmarks/llama_cpp.py [--version 0.3.36]   # build (or find) the tools, print their paths
    .venv/bin/python benchmarks/llama_cpp.py --server                 # and llama-server
    .venv/bin/python benchmarks/llama_cpp.py --examples llama-lookup   # and the example programs
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "0.3.36"  # llama-cpp-python release whose vendored llama.cpp is built
CMAKE_FLAGS = [
    "-G", "Ninja",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # static: the binaries keep working after the build folder is renamed
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DGGML_BLAS=OFF", "-DGGML_RPC=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON",
]  # fmt: skip
TARGETS = ["llama-bench", "llama-quantize"]
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# Without AMX by default: this llama.cpp's AMX int8 kernels (used for Q4_0/Q8_0 where the CPU has AMX) die with
# SIGILL on tileloadd (its tile config / per-thread XTILEDATA permission; llama.cpp PR #26954 is open for it).
# The explicit -mno-amx-* flags win over GGML_NATIVE's -march=native, so the AVX-512/VNNI/BF16 paths stay.


SERVER_TARGET = "llama-server"


def cmake_flags(amx: bool, server: bool = False) -> list[str]:
    flags = CMAKE_FLAGS
    if server:
        flags = [("-DLLAMA_BUILD_SERVER=ON" if f == "-DLLAMA_BUILD_SERVER=OFF" else f) for f in flags]
    return flags if amx else [*flags, f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


class StepError(RuntimeError):
    """A step failed; the message is one line (plus, for a build, the tail of its log)."""


@dataclass
class Tools:
    version: str
    source: Path  # the vendored llama.cpp tree
    bench: Path
    quantize: Path
    build_s: float  # seconds this run spent building (0.0 when the cache was used)
    cached: bool
    info: dict[str, Any]
    server: Path | None = None  # llama-server, when asked for


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "llama.cpp"


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _run_logged(cmd: list[str], log: Path, timeout_s: float, cwd: Path | None = None, what: str = "") -> None:
    with open(log, "ab") as f:
        f.write(("\n$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise StepError(f"{what or cmd[0]} timed out after {timeout_s:.0f} s; log {log}:\n{_tail(log)}") from None
    if rc != 0:
        raise StepError(f"{what or cmd[0]} failed (exit {rc}); last lines of {log}:\n{_tail(log)}")


def _ensure_source(vdir: Path, version: str) -> Path:
    """The unpacked sdist at `vdir/src` (its llama.cpp at `src/vendor/llama.cpp`)."""
    src = vdir / "src"
    if (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return src
    tmp = Path(tempfile.mkdtemp(prefix=".src-", dir=vdir))
    try:
        log = vdir / "download.log"
        cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:"]
        cmd += ["--no-deps", "-d", str(tmp / "dl")]
        _run_logged(cmd, log, 1200, what="pip download")
        sdists = sorted((tmp / "dl").glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise StepError(f"pip download left no llama_cpp_python sdist in {tmp / 'dl'}")
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(tmp / "x", filter="data")
        (top,) = list((tmp / "x").iterdir())
        if not (top / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            raise StepError(f"{sdists[0].name} has no vendor/llama.cpp")
        if src.exists():
            shutil.rmtree(src)
        top.rename(src)
        return src
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_tools(
    version: str = VERSION, jobs: int | None = None, log=print, amx: bool = False, server: bool = False
) -> Tools:
    """Build (once) or find `llama-bench` and `llama-quantize` for `version` (in `build/`, or `build-amx/` with AMX
    left to GGML_NATIVE), and `llama-server` too when `server`. A cached build made with other cmake flags (or, for
    `server`, configured without the server) is rebuilt; a tools-only call accepts a folder configured either way."""
    vdir = cache_root() / version
    build = vdir / ("build-amx" if amx else "build")
    flags = cmake_flags(amx, server=True)
    targets = [*TARGETS, SERVER_TARGET] if server else TARGETS
    accept = [flags] if server else [flags, cmake_flags(amx)]
    src, info, build_s = _ensure_build(vdir, version, build, flags, targets, jobs, log, accept=accept)
    bins = build / "bin"
    srv = bins / SERVER_TARGET if server else None
    return Tools(version, src, bins / TARGETS[0], bins / TARGETS[1], build_s, build_s == 0.0, info, srv)


EXAMPLE_TARGETS = ["llama-lookup"]


@dataclass
class Examples:
    """Example programs (`examples/` of the vendored llama.cpp) built beside the tools, same flags otherwise."""

    version: str
    bins: dict[str, Path]  # target -> binary
    build_s: float  # seconds this run spent building (0.0 when the cache was used)
    cached: bool
    info: dict[str, Any]


def example_flags(amx: bool) -> list[str]:
    """The tools' cmake flags with the examples on (they need the common library, which the tools' flags build)."""
    flags = [f for f in cmake_flags(amx) if not f.startswith("-DLLAMA_BUILD_EXAMPLES=")]
    return [*flags, "-DLLAMA_BUILD_EXAMPLES=ON"]


def ensure_examples(
    tools: Tools, targets: list[str] | None = None, jobs: int | None = None, log=print, amx: bool | None = None
) -> Examples:
    """Build (once) or find example `targets` (default `llama-lookup`) for `tools.version` in `build-examples/`
    (`build-examples-amx/` with AMX; `amx` None: as `tools` were built), a separate build folder configured with
    -DLLAMA_BUILD_EXAMPLES=ON that builds only those targets (and what they link: ggml, llama, llama-common).
    Same lock and temporary-then-rename discipline as `ensure_tools`; a cached folder with other flags, or without
    one of `targets`, is rebuilt (with the targets it had as well)."""
    targets = list(targets or EXAMPLE_TARGETS)
    if amx is None:
        amx = not any(NO_AMX in f for f in tools.info.get("cmake_flags", []))
    vdir = cache_root() / tools.version
    build = vdir / ("build-examples-amx" if amx else "build-examples")
    flags = example_flags(amx)
    info_file = build / "tandem_build.json"
    old = json.loads(info_file.read_text()) if info_file.is_file() else {}
    if old.get("cmake_flags") == flags:
        targets = sorted(set(targets) | set(old.get("targets", [])))
    _, info, build_s = _ensure_build(vdir, tools.version, build, flags, targets, jobs, log)
    return Examples(tools.version, {t: build / "bin" / t for t in targets}, build_s, build_s == 0.0, info)


def _ensure_build(
    vdir: Path,
    version: str,
    build: Path,
    flags: list[str],
    targets: list[str],
    jobs: int | None,
    log,
    accept: list[list[str]] | None = None,
) -> tuple[Path, dict[str, Any], float]:
    """(the vendored llama.cpp source, the build's info, seconds spent building: 0.0 when cached). Builds `targets`
    into a temporary folder beside `build` and renames it into place on success, under `vdir/.lock`. A cached
    folder is used when its flags are one of `accept` (default: `flags`) and it has every target; a rebuild with
    `flags` also builds the targets the old folder had, when it was configured with `flags`."""
    vdir.mkdir(parents=True, exist_ok=True)
    with _locked(vdir / ".lock"):
        for stale in [*vdir.glob(".src-*"), *vdir.glob(".build-*")]:  # left by an interrupted run (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        src = _ensure_source(vdir, version) / "vendor" / "llama.cpp"
        info_file = build / "tandem_build.json"
        info = json.loads(info_file.read_text()) if info_file.is_file() else {}
        if info.get("cmake_flags") in (accept or [flags]) and all((build / "bin" / t).is_file() for t in targets):
            return src, info, 0.0
        if info.get("cmake_flags") == flags:
            targets = [*targets, *(t for t in info.get("targets", []) if t not in targets)]
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=vdir))
        blog = vdir / f"{build.name}.log"
        blog.write_text("")
        jobs = jobs or os.cpu_count() or 1
        log(f"building llama.cpp ({version}) targets {' '.join(targets)} with {jobs} jobs; log {blog}", flush=True)
        t0 = time.monotonic()
        try:
            _run_logged(["cmake", "-S", str(src), "-B", str(tmp), *flags], blog, 600, what="cmake configure")
            cmd = ["cmake", "--build", str(tmp), "--config", "Release", "-j", str(jobs), "--target", *targets]
            _run_logged(cmd, blog, 7200, what="llama.cpp build")
            build_s = time.monotonic() - t0
            for t in targets:
                if not (tmp / "bin" / t).is_file():
                    raise StepError(f"build finished but {tmp / 'bin' / t} is missing; log {blog}")
            info = {"version": version, "build_s": build_s, "cmake_flags": flags, "jobs": jobs, "targets": targets,
                    "built_at": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
            (tmp / "tandem_build.json").write_text(json.dumps(info, indent=1) + "\n")
            if build.exists():
                shutil.rmtree(build)
            tmp.rename(build)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"built llama.cpp {' '.join(targets)} in {build_s:.0f} s", flush=True)
        return src, info, build_s


# ------------------------------------------------------------------------------------------------ conversion
_CONVERT_WRAPPER = r"""
import runpy, sys
script, pre = sys.argv[1], sys.argv[2]
sys.argv = [script] + sys.argv[3:]
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
import conversion.base as base
for cls in [c for c in vars(base).values() if isinstance(c, type) and "get_vocab_base_pre" in vars(c)]:
    original = cls.get_vocab_base_pre
    def patched(self, tokenizer, _original=original):
        try:
            return _original(self, tokenizer)
        except NotImplementedError:
            print(f"TANDEM: pre-tokenizer not recognized, mapped to {pre!r}", file=sys.stderr, flush=True)
            return pre
    cls.get_vocab_base_pre = patched
runpy.run_path(script, run_name="__main__")
"""


CONVERTER_DEPS = {"numpy": "numpy", "transformers": "transformers", "sentencepiece": "sentencepiece>=0.1.98,<0.3.0"}
"""What convert_hf_to_gguf.py imports that `ensure_converter` may install (module -> pip spec)."""


def converter_env(source: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source / "gguf-py"), str(source)])}
    env.pop("NO_LOCAL_GGUF", None)
    return env


def converter_python(source: Path) -> Path:
    """The converter's own interpreter: a venv beside the build (`<version>/converter-venv`) that reads the packages
    of the interpreter running this benchmark (torch, numpy, transformers) through a .pth file placed after its own
    site-packages, so what the converter alone needs is installed there, never into the benchmark's environment.
    Created on first use (a few seconds) under the version's lock; the .pth file, written last, marks it complete,
    and is rewritten whenever another interpreter (another checkout's `.venv`) runs the benchmark."""
    vdir = source.parents[2]
    venv = vdir / "converter-venv"
    python = venv / "bin" / "python"
    marker = "zz_benchmark_interpreter.pth"
    wanted = "".join(f"{d}\n" for d in sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}))
    found = list(venv.glob(f"lib/python*/site-packages/{marker}"))
    if found and found[0].read_text() == wanted:
        return python
    with _locked(vdir / ".lock"):
        found = list(venv.glob(f"lib/python*/site-packages/{marker}"))
        if not found:
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
            code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
            own = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True, timeout=60)
            found = [Path(own.stdout.strip(), marker)]
        found[0].write_text(wanted)
    return python


def missing_converter_modules(source: Path) -> list[str]:
    """Python modules the converter imports that its interpreter lacks (the sdist's gguf-py is on its path)."""
    code = (
        "import importlib.util as u\n"
        "mods = ['numpy', 'torch', 'gguf', 'transformers', 'sentencepiece', 'yaml', 'tqdm', 'requests']\n"
        "print(' '.join(m for m in mods if u.find_spec(m) is None))\n"
    )
    python = converter_python(source)
    out = subprocess.run([str(python), "-c", code], env=converter_env(source), capture_output=True, text=True)
    return out.stdout.split()


def ensure_converter(source: Path, allow_install: bool) -> list[str]:
    """Install into the converter's own venv (`converter_python`) what convert_hf_to_gguf.py needs and it lacks;
    the specs installed. torch must come from the benchmark's interpreter (the CPU wheel is not re-downloaded)."""
    missing = missing_converter_modules(source)
    if "torch" in missing:
        raise StepError("convert_hf_to_gguf.py needs torch, which the benchmark's interpreter lacks")
    specs = [CONVERTER_DEPS[m] for m in missing if m in CONVERTER_DEPS]
    if not specs:
        return []
    python = converter_python(source)
    if not allow_install:
        raise StepError(f"convert_hf_to_gguf.py needs {' '.join(specs)} (not in {python.parents[1]}; --no-install)")
    print(f"installing {' '.join(specs)} into {python.parents[1]} (convert_hf_to_gguf.py's own venv)", flush=True)
    proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *specs], capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-10:])
        raise StepError(f"pip install {' '.join(specs)} failed (exit {proc.returncode}):\n{tail}")
    return specs


def convert_to_gguf(source: Path, hf_dir: Path, out: Path, outtype: str, log_file: Path, pre: str = "default") -> bool:
    """Convert `hf_dir` to `out` (outtype f32/bf16/...); True when the pre-tokenizer had to be mapped to `pre`."""
    script = source / "convert_hf_to_gguf.py"
    cmd = [str(converter_python(source)), "-c", _CONVERT_WRAPPER, str(script), pre, str(hf_dir)]
    cmd += ["--outfile", str(out) + ".part", "--outtype", outtype]
    with open(log_file, "ab") as f:
        f.write(("\n$ convert_hf_to_gguf.py " + " ".join(cmd[5:]) + "\n").encode())
    proc = subprocess.run(cmd, env=converter_env(source), capture_output=True, text=True, timeout=1800)
    with open(log_file, "a") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        what = f"convert_hf_to_gguf.py --outtype {outtype}"
        raise StepError(f"{what} failed (exit {proc.returncode}); last lines of {log_file}:\n{_tail(log_file)}")
    os.replace(str(out) + ".part", out)
    return "TANDEM: pre-tokenizer not recognized" in proc.stderr


def quantize(tools: Tools, src: Path, out: Path, qtype: str, threads: int, log_file: Path) -> None:
    part = out.with_name(out.name + ".part")
    cmd = [str(tools.quantize), str(src), str(part), qtype, str(threads)]
    _run_logged(cmd, log_file, 1800, what=f"llama-quantize {qtype}")
    os.replace(part, out)


def bench(tools: Tools, model: Path, threads: int, n_prompt: int, n_gen: int, timeout_s: float) -> dict:
    """`llama-bench -m MODEL -t THREADS -p N_PROMPT -n N_GEN -o json` (its default 5 reps, after its warm-up):
    {"pp": mean tok/s, "tg": mean tok/s, "pp_stddev", "tg_stddev", "command", "raw": its JSON rows}."""
    cmd = [str(tools.bench), "-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen)]
    cmd += ["-o", "json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise StepError(f"llama-bench timed out after {timeout_s:.0f} s: {' '.join(cmd)}") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise StepError(f"llama-bench failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    rows = json.loads(proc.stdout)
    out: dict[str, Any] = {"command": " ".join(cmd), "raw": rows}
    for r in rows:
        kind = "pp" if r.get("n_gen", 0) == 0 else "tg"
        out[kind] = float(r["avg_ts"])
        out[kind + "_stddev"] = float(r.get("stddev_ts", 0.0))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", default=VERSION)
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--amx", action="store_true", help="leave AMX on (GGML_NATIVE's choice); see NO_AMX")
    p.add_argument("--server", action="store_true", help=f"build {SERVER_TARGET} too (same build folder)")
    p.add_argument("--examples", default="", help=f"comma-separated example targets to build too, e.g. "
                   f"{','.join(EXAMPLE_TARGETS)} (in build-examples/)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        tools = ensure_tools(args.version, args.jobs, amx=args.amx, server=args.server)
        state = "cached" if tools.cached else f"built in {tools.build_s:.0f} s"
        print(f"llama.cpp {tools.version} ({state}): {tools.bench} {tools.quantize} {tools.server or ''}".rstrip())
        targets = [t.strip() for t in args.examples.split(",") if t.strip()]
        if targets:
            ex = ensure_examples(tools, targets, args.jobs, amx=args.amx)
            state = (
                f"cached, built in {ex.info.get('build_s', 0):.0f} s" if ex.cached else f"built in {ex.build_s:.0f} s"
            )
            print(f"llama.cpp {tools.version} examples ({state}): {' '.join(str(b) for b in ex.bins.values())}")
    except StepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
