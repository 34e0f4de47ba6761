"""The sampler's cost per decode step on the CPU: `Sampler.sample` over S rows of V logits, with the native kernels
(`tandem_native/csrc/sampling.cpp`: one `sample_rows` call) against the torch path (`Sampler(native=False)`: a sort
per row for the truncation thresholds), in the same run.

For each (S, V) and each truncation (top-p 0.95, top-k 50, none; temperature 0.8, unseeded), the median of `--reps`
calls of each path on the same logits (`randn * 3`: a row about as peaked as a language model's), then the ratio
torch / native. Prints a markdown table; `--json` writes the figures.

    .venv/bin/python benchmarks/sampler_rows.py --threads 2 --shapes 1x8192,64x8192,1x151936,16x151936
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference_svc.engine.sampler import Sampler, SampleRequest
from inference_svc.engine.types import SamplingParams

TRUNCATIONS = {"top-p 0.95": {"top_p": 0.95}, "top-k 50": {"top_k": 50}, "none": {}}


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="1x8192,64x8192,1x151936,16x151936", help="comma-separated ROWSxVOCAB")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    torch.set_num_threads(args.threads)
    native, reference = Sampler(seed=0), Sampler(seed=0, native=False)
    rows = []
    print(f"| rows x vocab | truncation | native ms | torch ms | torch / native |  ({args.threads} threads)")
    print("|---|---|--:|--:|--:|")
    for s, v in shapes:
        logits = torch.randn(s, v, generator=torch.Generator().manual_seed(s * v)) * 3  # [S, V]
        for name, kw in TRUNCATIONS.items():
            requests = [SampleRequest(SamplingParams(temperature=0.8, **kw), [1], None)] * s
            a = median_ms(lambda x=logits, r=requests: native.sample(x, r), args.reps)
            b = median_ms(lambda x=logits, r=requests: reference.sample(x, r), max(3, args.reps // 4))
            rows.append({"rows": s, "vocab": v, "truncation": name, "native_ms": a, "torch_ms": b})
            print(f"| {s} x {v:,} | {name} | {a:.3f} | {b:.3f} | {b / a:.1f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
