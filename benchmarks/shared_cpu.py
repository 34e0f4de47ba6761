"""Time per token at batch 1 with and without a busy-looping process pinned to one CPU, per thread policy.

Each policy runs in a fresh child process (OpenMP reads its wait policy when torch loads it): the engine is built
with `EngineConfig(threads=..., omp_wait=...)` (or `threads='auto'`, the default rule of
`inference_svc.executor.threads`) and greedy-decodes `--tokens` tokens from one prompt, `--reps` times; the child
prints the per-token times of its decode steps. `--busy-cpu N` starts `while True: pass` pinned to CPU N for the
"loaded" half of the runs. Figures go to docs/benchmarks.md; nothing here is a test.

    .venv/bin/python benchmarks/shared_cpu.py --model DIR [--dtype bf16] [--quantization int8] [--busy-cpu 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
POLICIES = {
    "2 threads, runtime wait (old default)": {"threads": 2, "omp_wait": "active", "env": {}},
    "2 threads, passive wait": {"threads": 2, "omp_wait": "passive", "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
    "2 threads, spin 10k then sleep": {"threads": 2, "omp_wait": "active", "env": {"GOMP_SPINCOUNT": "10000"}},
    "1 thread": {"threads": 1, "omp_wait": "auto", "env": {}},
    "auto (the new default)": {"threads": "auto", "omp_wait": "auto", "env": None},
}


def child(args: argparse.Namespace) -> None:
    if args.env is not None:
        os.environ.update(json.loads(args.env))
    else:  # what `tandem serve` does before torch starts
        from inference_svc.cli import set_omp_wait

        set_omp_wait(args.threads, args.omp_wait)
    import torch

    from inference_svc.engine import Engine, EngineConfig, SamplingParams

    threads_value = args.threads if args.threads == "auto" else int(args.threads)
    wait = args.omp_wait if args.env is not None else "auto"
    config = EngineConfig(dtype=args.dtype, quantization=args.quantization, compile="off", device="cpu",
                          threads=threads_value, omp_wait=wait)  # fmt: skip
    engine = Engine.from_bundle(args.model, config)
    plan = engine.info().load_plan
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    engine.generate([list(range(10, 30))], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    per_token: list[float] = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        engine.generate([list(range(10, 30))], params)
        per_token.append((time.perf_counter() - t0) / args.tokens * 1000)
    print(json.dumps({"ms": per_token, "threads": plan.value("threads"), "omp_wait": plan.value("omp_wait"),
                      "torch_threads": torch.get_num_threads()}))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--quantization", default="none")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--busy-cpu", type=int, default=1)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--omp-wait", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--env", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for loaded in (False, True):
        busy = None
        if loaded:
            code = f"import os; os.sched_setaffinity(0, {{{args.busy_cpu}}})\nwhile True: pass"
            busy = subprocess.Popen([sys.executable, "-c", code])
            time.sleep(1.0)
        try:
            for name, pol in POLICIES.items():
                cmd = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype,
                       "--quantization", args.quantization, "--tokens", str(args.tokens), "--reps", str(args.reps),
                       "--threads", str(pol["threads"]), "--omp-wait", pol["omp_wait"]]  # fmt: skip
                if pol["env"] is not None:
                    cmd += ["--env", json.dumps(pol["env"])]
                env = {
                    k: v
                    for k, v in os.environ.items()
                    if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")
                }
                env["PYTHONPATH"] = str(REPO)
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                ms = r["ms"]
                rows.append((loaded, name, r["threads"], r["omp_wait"], statistics.median(ms), min(ms), max(ms)))
                print(f"{'busy CPU' if loaded else 'no busy'} | {name} | threads {r['threads']} | wait "
                      f"{r['omp_wait']} | median {statistics.median(ms):.2f} ms/token (min {min(ms):.2f}, max "
                      f"{max(ms):.2f})", flush=True)  # fmt: skip
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    quiet = {r[1]: r[4] for r in rows if not r[0]}
    print("\nslowdown under the busy CPU (median loaded / median quiet):")
    for r in rows:
        if r[0]:
            print(f"  {r[1]}: {r[4] / quiet[r[1]]:.2f}x")


if __name__ == "__main__":
    main()
