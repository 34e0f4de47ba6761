"""Worker for the distributed MemoryLedger / checkpointing tests: one launch, several short fits on 2 CPU ranks.

Usage: python ledger_cb_worker.py OUT_DIR PRESET RUN [RUN ...] where RUN is STAGE:MODE (e.g. 2:none, 3:ops).
Lightning launches the second rank by re-running this script; every rank runs the same fits in order. Each fit
trains 2 steps under ZeroStrategy(stage) in bf16-mixed with SelectiveCheckpointing(mode) and a MemoryLedger that
writes OUT_DIR/PRESET-sSTAGE-MODE/memory_ledger_rankR.json; the per-step losses go to losses_rankR.json there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lt_plugins.checkpointing import SelectiveCheckpointing
from lt_plugins.ledger_callback import MemoryLedger
from lt_plugins.strategy import ZeroStrategy
from shared_model.config import get_preset
from shared_model.model import build_model

SEQ, BATCH, STEPS = 64, 1, 2


class LitLM(pl.LightningModule):
    """A minimal LightningModule around the decoder (the callbacks know nothing about it)."""

    def __init__(self, preset: str) -> None:
        super().__init__()
        self.net = build_model(get_preset(preset), seed=0)
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        logits = self.net(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(out: Path, preset: str, stage: int, mode: str) -> None:
    run_dir = out / f"{preset}-s{stage}-{mode}"
    torch.manual_seed(0)
    module = LitLM(preset)
    vocab = module.net.config.vocab_size
    data = torch.randint(0, vocab, (2 * BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=stage),
        precision="bf16-mixed",
        max_steps=STEPS,
        callbacks=[SelectiveCheckpointing(mode=mode), MemoryLedger(measure_at_step=1, report_dir=run_dir)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=True,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    (run_dir / f"losses_rank{trainer.global_rank}.json").write_text(json.dumps(module.losses))


def main(argv: list[str]) -> None:
    out, preset, runs = Path(argv[0]), argv[1], argv[2:]
    for run in runs:
        stage, mode = run.split(":")
        fit(out, preset, int(stage), mode)


if __name__ == "__main__":
    main(sys.argv[1:])
