"""The lecture's comparison table for training configurations: precision, activation checkpointing and ZeRO stage,
side by side, each trained the same way for the same steps.

What it does, per configuration (`name:key=value key=value ...` overrides of one base config):
  1. `tandem train --config BASE` with those overrides, `trainer.max_steps=--steps`, validation at the last step,
     the memory ledger on (`ledger.enabled=true`), no export, in a fresh run folder under `--work-dir`;
  2. reads the run's CSV log: the last `val_loss`, and the step time (tokens per step / the median of the logged
     `tokens_per_s`, which excludes validation);
  3. reads `memory/memory_ledger_rank*.json`: each rank's measured terms (weights, master weights, gradients,
     optimizer moments, saved activations, buckets), their sum per rank, and the predicted sum.
A configuration that fails is a row with its error. The table is printed and written as JSON (`--out`).

    .venv/bin/python benchmarks/train_compare.py --steps 30 --out results/train_compare.json
    .venv/bin/python benchmarks/train_compare.py --configs "z2:strategy.stage=2" "z3:strategy.stage=3" --devices 2
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from inference_svc.serve_process import free_port

REPO = Path(__file__).resolve().parents[1]

DEFAULT_CONFIGS = (
    "fp32-z0:trainer.precision=32-true strategy.stage=0",
    "fp32-z2:trainer.precision=32-true strategy.stage=2",
    "fp32-z3:trainer.precision=32-true strategy.stage=3",
    "bf16-z2:trainer.precision=bf16-mixed strategy.stage=2",
    "fp32-z2-full-ckpt:trainer.precision=32-true strategy.stage=2 checkpointing.mode=full",
    "fp32-z3-ops-ckpt:trainer.precision=32-true strategy.stage=3 checkpointing.mode=ops",
)
COLUMNS = ("val_loss", "step_time_ms", "tokens_per_s", "peak_measured_mb_per_rank", "peak_predicted_mb_per_rank")


def parse_config(spec: str) -> tuple[str, list[str]]:
    name, sep, rest = spec.partition(":")
    if not sep or not name.strip():
        raise SystemExit(f"train_compare: a configuration is NAME:key=value ..., got {spec!r}")
    overrides = rest.split()
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise SystemExit(f"train_compare: {name}: overrides are key=value, got {bad}")
    return name.strip(), overrides


def _csv_rows(run_dir: Path) -> list[dict[str, str]]:
    path = run_dir / "logs" / "metrics.csv"
    if not path.is_file():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def _last(rows: list[dict[str, str]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
    return values[-1] if values else None


def _ledger(run_dir: Path) -> tuple[list[float], list[float]]:
    measured, predicted = [], []
    for path in sorted((run_dir / "memory").glob("memory_ledger_rank*.json")):
        data = json.loads(path.read_text())
        rows = [r for r in data["rows"] if not str(r["term"]).startswith("CUDA")]
        measured.append(sum(r["measured"] or 0.0 for r in rows) / 1e6)
        predicted.append(sum(r["predicted"] or 0.0 for r in rows) / 1e6)
    return measured, predicted


def run_one(name: str, overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(args.work_dir) / name
    base = [
        f"run_dir={run_dir}", f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}",
        f"trainer.devices={args.devices}", "ledger.enabled=true", "export.enabled=false",
        f"checkpoints.every_n_steps={args.steps * 100}", "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", args.config, *base, *overrides]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # loopback only
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"name": name, "overrides": overrides, "wall_s": wall}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {**row, "error": tail[0], **dict.fromkeys(COLUMNS)}
    resolved = _resolved_config(run_dir)
    rows = _csv_rows(run_dir)
    tps = [float(r["tokens_per_s"]) for r in rows if r.get("tokens_per_s") not in (None, "")]
    data = resolved.get("data", {})
    trainer = resolved.get("trainer", {})
    tokens_per_step = int(data.get("batch_size", 1)) * (int(data.get("block_size", 1)) - 1)
    tokens_per_step *= int(trainer.get("devices", 1)) * int(trainer.get("accumulate_grad_batches", 1))
    median_tps = statistics.median(tps) if tps else None
    measured, predicted = _ledger(run_dir)
    return {
        **row,
        "error": None,
        "val_loss": _last(rows, "val_loss"),
        "tokens_per_s": median_tps,
        "step_time_ms": 1000 * tokens_per_step / median_tps if median_tps else None,
        "peak_measured_mb_per_rank": measured,
        "peak_predicted_mb_per_rank": predicted,
    }


def _resolved_config(run_dir: Path) -> dict[str, Any]:
    import yaml

    path = run_dir / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'configuration':<22} {'val loss':>9} {'step ms':>9} {'tok/s':>9} {'measured MB/rank':>22} {'predicted':>14}"
    )
    lines = [head]
    for r in results:
        if r["error"]:
            lines.append(f"{r['name']:<22} failed: {r['error']}")
            continue
        meas = "/".join(f"{m:.1f}" for m in r["peak_measured_mb_per_rank"]) or "-"
        pred = "/".join(f"{p:.1f}" for p in r["peak_predicted_mb_per_rank"]) or "-"
        val = f"{r['val_loss']:.3f}" if r["val_loss"] is not None else "-"
        step = f"{r['step_time_ms']:.0f}" if r["step_time_ms"] else "-"
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-"
        lines.append(f"{r['name']:<22} {val:>9} {step:>9} {tps:>9} {meas:>22} {pred:>14}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "tiny-cpu.yaml"), help="base training config")
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="NAME:key=value ... per row")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per configuration")
    p.add_argument("--devices", type=int, default=2, help="CPU processes per run")
    p.add_argument("--work-dir", default=str(REPO / "runs" / "train-compare"), help="run folders go here")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the ledger measures at step 1)")
    specs = [parse_config(s) for s in args.configs]
    results = []
    for name, overrides in specs:
        print(f"train_compare: {name} ({' '.join(overrides)})", flush=True)
        results.append(run_one(name, overrides, args))
    print(table(results))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"config": args.config, "steps": args.steps, "devices": args.devices, "date": time.strftime("%F")}
        out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0 if all(r["error"] is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
