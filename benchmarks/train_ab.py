"""Two settings of one training run against each other, alternating: by default bf16 autocast over fp32 weights
(`trainer.autocast=bf16`) against plain fp32 (`none`), on the demo's run.

Usage: python benchmarks/train_ab.py [--a OVERRIDE ...] [--b OVERRIDE ...] [--steps 100] [--rounds 4]
                                     [--config configs/demo.yaml] [--out FILE.json]
  e.g. --a model.loss_chunk_tokens=0 --b model.loss_chunk_tokens=256

Each round runs `tandem train` twice, back to back and in alternating order, with the same config, data and seed,
and the `--a` or the `--b` overrides on top (the defaults: `trainer.precision=32-true` with `trainer.autocast=none`
or `bf16`). A run's speed is the median of the tokens/s it logs (its first two logged steps dropped: warm-up); the
round's ratio is b / a, and the median of the rounds' ratios is the figure, since the host's speed drifts between
minutes more than between two runs. The held-out loss each run ends with (the config's last validation) stands
beside it: the runs are deterministic, so every round repeats it. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_A = ["trainer.precision=32-true", "trainer.autocast=none"]
DEFAULT_B = ["trainer.precision=32-true", "trainer.autocast=bf16"]
WARMUP_LOGS = 2


def train(config: Path, steps: int, overrides: list[str], run_dir: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(config), f"run_dir={run_dir}"]
    cmd += [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", f"checkpoints.every_n_steps={steps}"]
    cmd += overrides
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train_ab: `{' '.join(cmd)}` failed:\n{proc.stderr[-3000:]}")
    rows = list(csv.DictReader((run_dir / "logs" / "metrics.csv").open()))
    speeds = [float(r["tokens_per_s"]) for r in rows if r["tokens_per_s"]][WARMUP_LOGS:]
    losses = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    if not speeds or not losses:
        raise SystemExit(f"train_ab: {run_dir}/logs/metrics.csv has no tokens_per_s or val_loss rows")
    return {"tokens_per_s": statistics.median(speeds), "val_loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", nargs="+", default=DEFAULT_A, help="overrides of the baseline run")
    parser.add_argument("--b", nargs="+", default=DEFAULT_B, help="overrides of the run measured against it")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "train_ab.json")
    args = parser.parse_args()
    settings = {"a": args.a, "b": args.b}
    print(f"a: {' '.join(args.a)}\nb: {' '.join(args.b)}", flush=True)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="train-ab-") as tmp:
        for r in range(args.rounds):
            order = ("a", "b") if r % 2 == 0 else ("b", "a")
            result = {k: train(args.config, args.steps, settings[k], Path(tmp) / f"r{r}-{k}") for k in order}
            result["ratio"] = result["b"]["tokens_per_s"] / result["a"]["tokens_per_s"]
            rounds.append(result)
            print(
                f"round {r + 1}: a {result['a']['tokens_per_s']:7.0f} tok/s  b {result['b']['tokens_per_s']:7.0f} "
                f"tok/s  ratio {result['ratio']:.2f}",
                flush=True,
            )
    median = statistics.median(r["ratio"] for r in rounds)
    loss = {k: rounds[-1][k]["val_loss"] for k in settings}
    print(f"\nmedian ratio b / a over {args.rounds} rounds of {args.steps} steps: {median:.2f}")
    print(f"held-out loss after {args.steps} steps: a {loss['a']:.4f}, b {loss['b']:.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"config": str(args.config), "settings": settings, "steps": args.steps, "rounds": rounds}
    args.out.write_text(json.dumps({**summary, "median_ratio": median, "val_loss": loss}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
