"""What ZeRO optimizer offload costs on CPU, and which optimizer to give it: step time of the same model under
ZeRO-2/3 without offload (the baseline), with offload stepping the LightningModule's own torch.optim.AdamW (DeepSpeed's
`zero_force_ds_cpu_optimizer: false`, which ZeroStrategy sets), and with offload stepping DeepSpeed's CPU Adam
(`deepspeed.ops.adam.DeepSpeedCPUAdam` returned from configure_optimizers; its C++ op is JIT-built with ninja on
first use). Also the configuration as it failed before ZeroStrategy set the switch (an error row).

The model is benchmarks/zero_matrix.py's EncoderLM (torch.nn.TransformerEncoderLayer) at a larger size; each
configuration trains `--steps` steps on 1 and on 2 processes (gloo, OMP_NUM_THREADS=1 per process); the step time is
the median after 3 warm-up steps (the median over `--repeats` interleaved fits), and the ratio is against the same
world's baseline in the same run.

    .venv/bin/python benchmarks/offload_bench.py --out results/offload_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zero_matrix

REPO = zero_matrix.REPO
SIZE = {"vocab": 4096, "width": 256, "layers": 4, "ff": 1024}
SEQ, BATCH = 64, 4
PARAMS = 5_260_288
"""Parameters of EncoderLM at SIZE (embedding and head 1.05M each, 0.79M per layer)."""

CONFIGS: dict[str, dict[str, Any]] = {
    "z2 (no offload), torch AdamW": {"stage": 2, "optimizer": "adamw"},
    "z2 + offload, torch AdamW": {"stage": 2, "offload_optimizer": True, "optimizer": "adamw"},
    "z2 + offload, DeepSpeedCPUAdam": {"stage": 2, "offload_optimizer": True, "optimizer": "cpu_adam"},
    "z2 + offload, torch AdamW, zero_force_ds_cpu_optimizer=true (before)": {
        "stage": 2,
        "offload_optimizer": True,
        "optimizer": "adamw",
        "extra": {"zero_force_ds_cpu_optimizer": True},
    },
    "z3 (no offload), torch AdamW": {"stage": 3, "optimizer": "adamw"},
    "z3 + offload opt+params, torch AdamW": {"stage": 3, "offload_optimizer": True, "offload_params": True},
    "z3 + offload opt+params, DeepSpeedCPUAdam": {
        "stage": 3,
        "offload_optimizer": True,
        "offload_params": True,
        "optimizer": "cpu_adam",
    },
}
BASELINE = {2: "z2 (no offload), torch AdamW", 3: "z3 (no offload), torch AdamW"}


def _fit(config: dict[str, Any], steps: int, world: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lt_plugins.errors import one_line
    from lt_plugins.strategy import ZeroStrategy

    times: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            times.append(time.perf_counter() - self.t0)

    kw = {k: v for k, v in config.items() if k != "optimizer"}
    pl.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    data = torch.randint(0, SIZE["vocab"], (BATCH * steps, SEQ + 1), generator=gen)
    try:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=ZeroStrategy(bucket_size=5_000_000, **kw),
            precision="32-true",
            max_steps=steps,
            callbacks=[Clock()],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        module = zero_matrix.build_module(config.get("optimizer", "adamw"), **SIZE)
        trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(data), batch_size=BATCH))
    except Exception as exc:  # a configuration that fails is a row with its error
        return {"error": f"{type(exc).__name__}: {one_line(exc)}"[:300]}
    warm = sorted(times[3:])
    return {"step_ms": warm[len(warm) // 2] * 1e3}


def optimizer_steps(numels: tuple[int, ...] = (PARAMS, 50_000_000), rounds: int = 5, iters: int = 10) -> list[dict]:
    """The part offload changes, alone: one optimizer step over `numel` fp32 parameters (what ZeRO-Offload steps on
    the CPU per rank), torch AdamW (foreach and fused) vs DeepSpeedCPUAdam, one thread, interleaved rounds; ms per
    step, the median over rounds of each round's mean."""
    import statistics

    import torch

    torch.set_num_threads(1)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    makers = {
        "torch AdamW (foreach)": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
        "torch AdamW (fused)": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
        "DeepSpeedCPUAdam": lambda p: DeepSpeedCPUAdam(p, lr=1e-3, adamw_mode=True),
    }
    rows = []
    for numel in numels:
        opts = {}
        for name, make in makers.items():
            param = torch.nn.Parameter(torch.randn(numel))
            param.grad = torch.randn(numel)
            opts[name] = make([param])
            opts[name].step()  # state allocated outside the timing
        times: dict[str, list[float]] = {name: [] for name in makers}
        for _ in range(rounds):
            for name, opt in opts.items():
                t0 = time.perf_counter()
                for _ in range(iters):
                    opt.step()
                times[name].append((time.perf_counter() - t0) / iters * 1e3)
        base = statistics.median(times["torch AdamW (foreach)"])
        for name in makers:
            ms = statistics.median(times[name])
            rows.append({"numel": numel, "optimizer": name, "step_ms": ms, "ratio": ms / base})
    return rows


def worker(out: Path, steps: int, world: int, repeats: int) -> None:
    """Every configuration `repeats` times, interleaved (A B C ... A B C: the machine's drift hits all alike); a
    configuration's step time is the median over its repeats of each fit's median."""
    import statistics
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    for _ in range(repeats):
        for name, config in CONFIGS.items():
            runs[name].append(_fit(config, steps, world))
    result = {}
    for name, fits in runs.items():
        times = [f["step_ms"] for f in fits if "step_ms" in f]
        result[name] = {"step_ms": statistics.median(times), "each_ms": times} if times else fits[0]
    (out / f"offload-w{world}-rank{os.environ['RANK']}.json").write_text(json.dumps(result))


def launch(out: Path, steps: int, world: int, repeats: int, timeout_s: float) -> dict[str, Any]:
    port = zero_matrix.free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO)}  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", str(out), str(steps), str(world), str(repeats)]
        log = open(out / f"offload-w{world}-log{rank}.txt", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    for proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            proc.wait()
        log.close()
    path = out / f"offload-w{world}-rank0.json"
    if not path.is_file():
        raise SystemExit(f"offload_bench: world {world} failed:\n" + (out / f"offload-w{world}-log0.txt").read_text())
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3, help="fits per configuration, interleaved")
    parser.add_argument("--worlds", type=int, nargs="*", default=[1, 2], help="process counts (none: skip training)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--work-dir", type=Path, default=REPO / "results" / "offload_bench")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.worker:
        worker(Path(args.worker[0]), int(args.worker[1]), int(args.worker[2]), int(args.worker[3]))
        return 0
    args.work_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for world in args.worlds:
        result = launch(args.work_dir, args.steps, world, args.repeats, args.timeout)
        for name, row in result.items():
            base = result[BASELINE[CONFIGS[name]["stage"]]].get("step_ms")
            ratio = row["step_ms"] / base if "step_ms" in row and base else None
            rows.append({"world": world, "config": name, **row, "ratio": ratio})
    print("| processes | configuration | step (ms) | vs same-stage no offload |\n|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['world']} | {r['config']} | error: {r['error'][:110]} | |")
        else:
            print(f"| {r['world']} | {r['config']} | {r['step_ms']:.0f} | x{r['ratio']:.2f} |")
    alone = optimizer_steps()
    print("\n| parameters | optimizer (1 thread) | step (ms) | vs torch AdamW (foreach) |\n|---|---|---|---|")
    for r in alone:
        print(f"| {r['numel'] / 1e6:.2f}M | {r['optimizer']} | {r['step_ms']:.1f} | x{r['ratio']:.2f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "size": SIZE, "params": PARAMS,
                "seq": SEQ, "batch": BATCH, "steps": args.steps, "repeats": args.repeats}  # fmt: skip
        args.out.write_text(json.dumps({**meta, "rows": rows, "optimizer_alone": alone}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
