"""Shared by the training benchmarks: a 2-process launch of one training run and the rank code it executes.

`run_case(case, world)` starts `world` processes of this file (torchrun-style env, a free loopback port, a bounded
timeout); each trains the `tiny` preset on fixed random token blocks and rank 0 prints one JSON line with the
median step time, the loss after the last step and its per-rank state bytes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

from inference_svc.serve_process import free_port


def run_case(case: dict[str, Any], world: int = 2, timeout_s: float = 900) -> dict[str, Any]:
    """Train `case` (strategy, stage, precision, steps, block, batch) on `world` processes; rank 0's result."""
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
        env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "OMP_NUM_THREADS": "1"})
        logs.append(tempfile.TemporaryFile())  # noqa: SIM115 - read back and closed with the process
        cmd = [sys.executable, __file__, json.dumps(case)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    texts = []
    for p, log in zip(procs, logs, strict=True):
        p.wait(timeout=timeout_s)
        log.seek(0)
        texts.append(log.read().decode(errors="replace"))
        if p.returncode != 0:
            raise RuntimeError(f"case {case} failed:\n{texts[-1][-3000:]}")
    line = [ln for ln in texts[0].splitlines() if ln.startswith("{")][-1]
    return json.loads(line)


def _rank_main(case: dict[str, Any]) -> None:
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    import torch

    from lt_plugins.config import DataSection, OptimSection
    from lt_plugins.data import Blocks, CorpusDataModule
    from lt_plugins.ledger_measure import held_bytes_by_role
    from lt_plugins.lit_module import LitCausalLM
    from lt_plugins.precision import PrecisionPolicyCallback
    from lt_plugins.strategy import ZeroStrategy
    from shared_model.config import get_preset

    torch.set_num_threads(1)
    config = get_preset("tiny")
    data = DataSection(block_size=case["block"], batch_size=case["batch"])
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 2000, (512, data.block_size + 1), generator=gen)
    rows[:, 1::2] = (rows[:, 0::2][:, : rows[:, 1::2].shape[1]] * 7 + 1) % 2000

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.loss = float("nan")
            self.grads = 0
            self.bytes: dict[str, int] = {}

        def on_train_batch_start(self, *args: Any) -> None:
            self.t0 = time.perf_counter()

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            if not self.grads:
                self.grads = held_bytes_by_role(module, trainer.strategy.optimizers[0])["grads"]

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
            self.times.append(time.perf_counter() - self.t0)
            self.loss = float(trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean"))
            if not self.bytes:
                self.bytes = held_bytes_by_role(module, trainer.strategy.optimizers[0])
                self.bytes["grads"] = self.grads

    strategy: Any = "ddp" if case["strategy"] == "ddp" else ZeroStrategy(stage=case["stage"])
    probe = Probe()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        precision=case["precision"],
        max_steps=case["steps"],
        gradient_clip_val=1.0,
        callbacks=[PrecisionPolicyCallback(), probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    module = LitCausalLM(config, OptimSection(lr=3e-3, warmup_steps=3), seed=0)
    trainer.fit(module, datamodule=CorpusDataModule(data, Blocks(rows, rows[:8], None)))  # type: ignore[arg-type]
    if trainer.is_global_zero:
        timed = probe.times[2:] or probe.times
        print(json.dumps({**case, "step_s": statistics.median(timed), "loss": probe.loss, "bytes": probe.bytes}))


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
