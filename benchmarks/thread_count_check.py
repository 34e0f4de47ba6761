"""Which threads of the process run an in-process engine's decode steps at each intra-op thread count: the check
that every kernel of a step (inductor's compiled with dynamic threads, Tandem's `at::parallel_for` kernels, oneDNN's)
follows the count the thread governor sets between steps, rather than the count it was built or compiled at.

Contract: builds `benchmarks/cpu_peer.py`'s random Qwen3 (cached under --folder) as an `Engine` with `--threads`
(the ceiling), `--compile`, `--dtype`, `--quantization` and the governor on but held at its ceiling (this script
sets the count itself with `torch.set_num_threads`), adds one greedy stream and, for each count of `--counts`, runs
a few steps to settle, then `--steps` timed decode steps, and prints the CPU seconds the engine thread and all the
process's other threads (OpenMP's workers among them) used over those steps (from /proc/self/task/*/stat), the
median step time and the compiled decoder's eager calls. At one thread the other threads should use next to
nothing. Not a test: CPU time on a shared machine is the machine's; figures go to docs/benchmarks.md.

    .venv/bin/python benchmarks/thread_count_check.py --dtype bf16 --compile on --counts 2,1,2,1
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from benchmarks import cpu_peer
from inference_svc.engine import Engine, EngineConfig, SamplingParams
from inference_svc.executor.governor import ThreadGovernor
from inference_svc.executor.threads import own_ticks


def thread_ticks() -> dict[int, int]:
    """{thread id: utime + stime ticks} of this process's threads."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            out[int(task.name)] = own_ticks((task / "stat").read_text())
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", type=Path, default=Path("/tmp/tandem-bench/compiled-decode-82m"))
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--quantization", default="none")
    p.add_argument("--compile", default="on")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--counts", default="2,1,2,1")
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    shape = argparse.Namespace(hidden=768, layers=12, vocab=8192, heads=None, kv_heads=None, intermediate=None)
    folder = cpu_peer.make_bundle(args.folder, cpu_peer.model_config(shape), 0)
    config = EngineConfig(dtype=args.dtype, compile=args.compile, threads=args.threads,
                          quantization=args.quantization)  # fmt: skip
    engine = Engine.from_bundle(folder, config)
    gov = engine.thread_governor
    engine.thread_governor = ThreadGovernor(gov.ceiling, gov.cpus, enabled=False)
    hz = os.sysconf("SC_CLK_TCK")
    me = threading.get_native_id()
    label = f"{args.dtype}/{args.quantization}/compile={args.compile}"
    print(label, "plan:", engine.info().load_plan.value("thread_governor"),
          "compiled:", engine.compiled, flush=True)  # fmt: skip
    engine.add_request("check", [3 + i for i in range(32)], SamplingParams(max_new_tokens=4000, ignore_eos=True))
    for count in (int(c) for c in args.counts.split(",")):
        torch.set_num_threads(count)
        for _ in range(10):  # settle: OpenMP's idle workers stop spinning within milliseconds
            engine.step()
        before, times = thread_ticks(), []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        after = thread_ticks()
        spent = {t: (after[t] - before.get(t, 0)) / hz for t in after}
        others = sum(v for t, v in spent.items() if t != me)
        eager = engine.runner.compiled.eager_calls if engine.runner.compiled is not None else None
        print(f"{label} threads={count} torch={torch.get_num_threads()} engine_thread_cpu_s={spent.get(me, 0):.2f} "
              f"other_threads_cpu_s={others:.2f} median_step_ms={statistics.median(times):.2f} "
              f"eager_calls={eager}", flush=True)  # fmt: skip
    engine.abort_request("check")
    engine.step()


if __name__ == "__main__":
    main()
