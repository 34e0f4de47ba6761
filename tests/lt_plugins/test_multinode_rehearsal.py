"""A multi-node rehearsal on one machine: two "nodes" of one CPU process each, each started by its own torchrun
(`--nnodes 2 --node-rank 0|1 --nproc-per-node 1`, rendezvous on a free loopback port), train the compatibility
matrix's module under ZeRO-3 with every parameter sharded. The losses equal those of one node with two processes
(the matrix's own launch) within the 32-true ZeRO-vs-DDP tolerance. Both torchruns are bounded by a timeout and
killed (with their workers: each runs in its own session) when either fails or hangs."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("multinode_worker.py")
TIMEOUT_S = 300


def _matrix():
    spec = importlib.util.spec_from_file_location("zero_matrix", ROOT / "benchmarks" / "zero_matrix.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["zero_matrix"] = mod
    spec.loader.exec_module(mod)
    return mod


def _torchrun_two_nodes(out: Path, port: int) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(WORKER), str(out)]  # fmt: skip
        log = open(out / f"node{node}.txt", "w")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append((proc, log))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p, _ in procs):
                break
            time.sleep(0.5)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the torchrun agent and its worker
            proc.wait()
            log.close()
    codes = [p.returncode for p, _ in procs]
    if codes != [0, 0]:
        logs = "\n".join(f"--- node {n} (exit {c}):\n" + (out / f"node{n}.txt").read_text()[-2500:]
                         for n, c in enumerate(codes))  # fmt: skip
        raise AssertionError(f"two-node torchrun failed or timed out after {TIMEOUT_S} s:\n{logs}")


def test_two_nodes_of_one_process_train_like_one_node_of_two(tmp_path: Path) -> None:
    zm = _matrix()
    _torchrun_two_nodes(tmp_path, zm.free_port())
    ranks = [json.loads((tmp_path / f"multinode-rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["env"]["LOCAL_RANK"] for r in ranks] == ["0", "0"]  # really one process per node
    assert [r["env"]["GROUP_RANK"] for r in ranks] == ["0", "1"]
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == zm.STEPS

    one_node = zm.launch([zm.Cell(3)], tmp_path / "one-node", timeout_s=TIMEOUT_S, references=False)
    row = one_node["cells"][zm.Cell(3).name]
    assert row["outcome"] == "trained", row
    rtol, atol = zm.TOLERANCE["32-true"]
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(row["losses"]), rtol=rtol, atol=atol)
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]  # it learns
