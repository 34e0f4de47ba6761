"""Helpers for the multi-process tests: free loopback ports and a bounded 2-rank launch of zero_worker.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from inference_svc.serve_process import free_port

WORKER = Path(__file__).with_name("zero_worker.py")


def launch(mode: str, out: Path, world: int = 2, timeout_s: float = 420) -> None:
    """Run zero_worker.py `mode` on `world` ranks (torchrun-style env); fail with the logs on error or timeout."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "OMP_NUM_THREADS": "1",
        }
        log = open(out / f"{mode}-log{rank}.txt", "w")  # noqa: SIM115 - closed below
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(WORKER), mode, str(out)], env=env, stdout=log, stderr=subprocess.STDOUT
                ),
                log,
            )
        )
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            code = "timeout"
        log.close()
        if code != 0:
            failed.append(f"rank {rank}: {code}\n" + (out / f"{mode}-log{rank}.txt").read_text()[-3000:])
    if failed:
        raise AssertionError(f"{mode} failed:\n" + "\n".join(failed))
