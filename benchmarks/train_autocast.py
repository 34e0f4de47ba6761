"""bf16 autocast over fp32 weights (`trainer.autocast=bf16`) against plain fp32, on the demo's training run.

Usage: python benchmarks/train_autocast.py [--steps 100] [--rounds 4] [--config configs/demo.yaml] [--out FILE.json]

Each round runs `tandem train` twice, back to back and in alternating order, with the same config, data and seed:
`trainer.autocast=none` and `trainer.autocast=bf16` (32-true weights, gradients and optimizer state in both). A
run's speed is the median of the tokens/s it logs (its first two logged steps dropped: warm-up); the round's ratio
is bf16 / none, and the median of the rounds' ratios is the figure, since the host's speed drifts between minutes
more than between two runs. The held-out loss each run ends with (the config's last validation) stands beside it:
the runs are deterministic, so every round repeats it. Prints a table and writes JSON.
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
MODES = ("none", "bf16")
WARMUP_LOGS = 2


def train(config: Path, steps: int, mode: str, run_dir: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(config), f"run_dir={run_dir}"]
    cmd += [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", f"checkpoints.every_n_steps={steps}"]
    cmd += ["trainer.precision=32-true", f"trainer.autocast={mode}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train_autocast: `{' '.join(cmd)}` failed:\n{proc.stderr[-3000:]}")
    rows = list(csv.DictReader((run_dir / "logs" / "metrics.csv").open()))
    speeds = [float(r["tokens_per_s"]) for r in rows if r["tokens_per_s"]][WARMUP_LOGS:]
    losses = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    if not speeds or not losses:
        raise SystemExit(f"train_autocast: {run_dir}/logs/metrics.csv has no tokens_per_s or val_loss rows")
    return {"tokens_per_s": statistics.median(speeds), "val_loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "train_autocast.json")
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="train-autocast-") as tmp:
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            result = {mode: train(args.config, args.steps, mode, Path(tmp) / f"r{r}-{mode}") for mode in order}
            result["ratio"] = result["bf16"]["tokens_per_s"] / result["none"]["tokens_per_s"]
            rounds.append(result)
            print(
                f"round {r + 1}: none {result['none']['tokens_per_s']:7.0f} tok/s  bf16 "
                f"{result['bf16']['tokens_per_s']:7.0f} tok/s  ratio {result['ratio']:.2f}",
                flush=True,
            )
    median = statistics.median(r["ratio"] for r in rounds)
    loss = {mode: rounds[-1][mode]["val_loss"] for mode in MODES}
    print(f"\nmedian ratio bf16 / none over {args.rounds} rounds of {args.steps} steps: {median:.2f}")
    print(f"held-out loss after {args.steps} steps: none {loss['none']:.4f}, bf16 {loss['bf16']:.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"config": str(args.config), "steps": args.steps, "rounds": rounds, "median_ratio": median}
    args.out.write_text(json.dumps({**summary, "val_loss": loss}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
