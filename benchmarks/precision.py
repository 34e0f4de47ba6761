"""Cost and benefit of bf16-mixed against fp32 under ZeroStrategy: loss after N steps, per-rank state bytes, step time.

Usage: python benchmarks/precision.py [--steps 20] [--stage 2] [--world 2] [--out FILE.json]
Same model (tiny preset), data, seed and processes for both runs; prints ratios bf16-mixed / fp32 and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import run_case


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/precision.json")
    args = parser.parse_args()
    base = {"strategy": "zero", "stage": args.stage, "steps": args.steps, "block": args.block, "batch": args.batch}
    fp32 = run_case({**base, "precision": "32-true"}, world=args.world)
    bf16 = run_case({**base, "precision": "bf16-mixed"}, world=args.world)
    print(f"{'':<12} {'32-true':>12} {'bf16-mixed':>12} {'ratio':>7}")
    print(f"{'loss':<12} {fp32['loss']:>12.4f} {bf16['loss']:>12.4f} {bf16['loss'] / fp32['loss']:>7.3f}")
    print(f"{'step_s':<12} {fp32['step_s']:>12.3f} {bf16['step_s']:>12.3f} {bf16['step_s'] / fp32['step_s']:>7.2f}")
    for key in ("params", "master", "grads", "optimizer"):
        a, b = fp32["bytes"][key], bf16["bytes"][key]
        print(f"{key + '_bytes':<12} {a:>12,} {b:>12,} {(b / a if a else float('nan')):>7.2f}")
    Path(args.out).write_text(json.dumps({"fp32": fp32, "bf16_mixed": bf16}, indent=1) + "\n")


if __name__ == "__main__":
    main()
