"""`tandem serve --threads/--omp-wait` (issue 33, goal 3): the flags are parsed before torch is imported, so the
OpenMP wait policy is in the environment when the runtime starts, and the load plan served by /v1/models says so
(the rule itself: tests/inference_svc/engine/test_thread_policy.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from inference_svc.serve_process import ServeProcess, free_port

pytestmark = pytest.mark.slow  # a tandem serve subprocess

REPO = Path(__file__).resolve().parents[3]


CHILD = """
import builtins, os, sys
seen = []
real_import = builtins.__import__
def watch(name, *args, **kwargs):
    if name == "torch" and "torch" not in sys.modules and not seen:
        seen.append(os.environ.get("OMP_WAIT_POLICY", "unset"))
    return real_import(name, *args, **kwargs)
builtins.__import__ = watch
from inference_svc.cli import build_serve_config
build_serve_config([".", "--threads", "2", "--omp-wait", "passive"])  # --device auto: looks for CUDA with torch
print(seen[0] if seen else "torch never imported")
"""


def test_the_wait_policy_is_in_the_environment_before_torch_starts() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "PASSIVE", out.stdout + out.stderr[-2000:]


def test_the_wait_policy_is_in_effect_and_reported(bundle_dir: Path, tmp_path: Path) -> None:
    http = free_port()
    flags = ["--device", "cpu", "--kv-cache-memory", "2MiB", "--no-warmup", "--http-port", str(http),
             "--metrics-port", "0", "--threads", "2", "--omp-wait", "passive"]  # fmt: skip
    env = {"OMP_WAIT_POLICY": ""}  # not the caller's: the flag decides
    with ServeProcess(bundle_dir, flags, log=tmp_path / "serve.log", env=env) as server:
        server.wait_serving(180)
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=30) as r:
            card = json.load(r)["data"][0]
    plan = {c["lever"]: c for c in card["tandem_load_plan"]}
    assert plan["threads"]["value"] == "2" and plan["threads"]["reason"].startswith("--threads 2")
    assert plan["omp_wait"]["value"] == "passive", plan["omp_wait"]
    assert plan["omp_wait"]["reason"] == "--omp-wait passive"
    assert plan["compile_cache"]["value"] == "unused"  # a tiny model: not compiled
