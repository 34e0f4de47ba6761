"""Step time of ZeroStrategy at stages 0-3 against Lightning's DDP: same model, data and processes, as ratios.

Usage: python benchmarks/train_overhead.py [--steps 12] [--world 2] [--precision 32-true] [--out FILE.json]
Prints one line per strategy (median step time after 2 warm-up steps, ratio to DDP) and writes JSON.
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
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/train_overhead.json")
    args = parser.parse_args()
    base = {"precision": args.precision, "steps": args.steps, "block": args.block, "batch": args.batch}
    cases = [{"strategy": "ddp", "stage": None}] + [{"strategy": "zero", "stage": s} for s in (0, 1, 2, 3)]
    results = [run_case({**base, **c}, world=args.world) for c in cases]
    ddp = results[0]["step_s"]
    print(f"{'strategy':<10} {'step_s':>8} {'vs DDP':>7}")
    for r in results:
        name = "ddp" if r["strategy"] == "ddp" else f"zero-{r['stage']}"
        r["ratio_vs_ddp"] = r["step_s"] / ddp
        print(f"{name:<10} {r['step_s']:>8.3f} {r['ratio_vs_ddp']:>7.2f}")
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
