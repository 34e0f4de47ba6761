"""One rank of the 2-process ZeRO tests (started by the tests with torchrun-style env vars, never by pytest).

Modes (argv[1]), each writing `<out>/<mode>-rank<r>.json`:
- `stages`: for ZeRO stages 0-3, 20 fp32 steps of a micro decoder (per-step global loss, per-rank state bytes);
  stage 3 also saves a checkpoint and exports it (rank 0); then a straight 10-step run (the resume reference)
  and 3 steps in bf16-mixed.
- `part_a`: the resume run's first half: checkpoints every 5 steps, then the processes are killed at step 5.
- `part_b`: resumes from the newest checkpoint and trains to step 10.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lt_plugins.checkpoint_io import PeriodicCheckpoint, latest_checkpoint
from lt_plugins.config import DataSection, OptimSection
from lt_plugins.data import Blocks, CorpusDataModule
from lt_plugins.export.bundle import export_bundle
from lt_plugins.export.checkpoint import META_DIR
from lt_plugins.ledger_measure import held_bytes_by_role
from lt_plugins.lit_module import LitCausalLM
from lt_plugins.precision import PrecisionPolicyCallback
from lt_plugins.strategy import ZeroStrategy
from shared_model.config import ModelConfig

MICRO = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    intermediate_size=128,
    qk_norm=True,
    tie_word_embeddings=True,
)
DATA = DataSection(block_size=32, batch_size=4, seed=0)
OPTIM = OptimSection(lr=3e-3, warmup_steps=2)


def micro_blocks() -> Blocks:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(3, MICRO.vocab_size, (256, DATA.block_size + 1), generator=gen)
    rows[:, 1::2] = (rows[:, 0::2][:, : rows[:, 1::2].shape[1]] * 7 + 1) % MICRO.vocab_size  # learnable structure
    return Blocks(train=rows, val=rows[:16], tokenizer=None)  # type: ignore[arg-type]


class Recorder(pl.Callback):
    """Global mean loss per step; state bytes after the first backward (grads) and the first step (the rest)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: int | None = None
        self.bytes: dict[str, int] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if self.grads is None:
            self.grads = held_bytes_by_role(pl_module, trainer.strategy.optimizers[0])["grads"]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        loss = trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean")
        self.losses.append(float(loss))
        if not self.bytes:
            self.bytes = held_bytes_by_role(pl_module, trainer.strategy.optimizers[0])
            self.bytes["grads"] = self.grads or 0


class KillAt(pl.Callback):
    """Simulates a crash: the process dies right after the checkpoint of step `step` (no clean shutdown)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.barrier("before_kill")
            os._exit(0)


def fit(
    stage: int, steps: int, precision: str = "32-true", callbacks: list[Any] | None = None, ckpt: str | None = None
) -> Recorder:
    pl.seed_everything(0, verbose=False)
    rec = Recorder()
    strategy = ZeroStrategy(stage=stage, param_persistence_threshold=0, bucket_size=10_000)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=[PrecisionPolicyCallback(), rec, *(callbacks or [])],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    module = LitCausalLM(MICRO, OPTIM, seed=0)
    trainer.fit(module, datamodule=CorpusDataModule(DATA, micro_blocks()), ckpt_path=ckpt)
    return rec


def write_meta(out: Path) -> None:
    meta = out / META_DIR
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "config.json").write_text(json.dumps(MICRO.to_hf_dict()))


def main() -> None:
    warnings.filterwarnings("ignore")
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {}
    torch.set_num_threads(1)
    if mode == "stages":
        for stage in (0, 1, 2, 3):
            ckpt_cb = PeriodicCheckpoint(out / f"ckpt-s{stage}", every_n_steps=20) if stage == 3 else None
            rec = fit(stage, 20, callbacks=[ckpt_cb] if ckpt_cb else None)
            result[f"stage{stage}"] = {"losses": rec.losses, "bytes": rec.bytes}
        if rank == 0:
            write_meta(out)
            ckpt = latest_checkpoint(out / "ckpt-s3")
            assert ckpt is not None
            export_bundle(ckpt, out / "bundle-s3", dtype="float32", meta_dir=out / META_DIR)
        result["straight10"] = fit(2, 10).losses
        result["bf16"] = fit(2, 3, precision="bf16-mixed").losses
    elif mode == "part_a":
        fit(2, 10, callbacks=[PeriodicCheckpoint(out / "ckpt-resume", every_n_steps=5), KillAt(5)])
    elif mode == "part_b":
        ckpt = latest_checkpoint(out / "ckpt-resume")
        assert ckpt is not None
        rec = fit(2, 10, callbacks=[PeriodicCheckpoint(out / "ckpt-resume", every_n_steps=5)], ckpt=str(ckpt))
        result["resumed"] = rec.losses
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
