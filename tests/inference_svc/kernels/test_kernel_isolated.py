"""Runs this folder's kernel tests in a fresh interpreter-mode process when they cannot run in this one.

Triton fixes interpreter vs compiler when it is first imported. When an earlier test module of this pytest run
imported triton without TRITON_INTERPRET (torch._dynamo and lightning both do), the in-process kernel tests skip
(see conftest.py) and this test reruns the folder in a subprocess with TRITON_INTERPRET=1. Otherwise it skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_svc.attention.triton import configs

NEEDS_KERNELS = False


def test_kernel_suite_in_subprocess() -> None:
    if torch.cuda.is_available() or configs.interpret_mode():
        pytest.skip("the kernel tests ran in this process")
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here)]
    proc = subprocess.run(cmd, cwd=here.parents[2], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"kernel tests failed in the subprocess:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
