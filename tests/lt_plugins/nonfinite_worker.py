"""Worker for the non-finite-state tests: a real single-process fit of a small LightningModule that goes NaN/inf.

Usage: python nonfinite_worker.py RUN_DIR MODE, MODE one of
- `nan-loss`: the loss is finite for steps 1-2 and NaN from step 3 on (a diverging model);
- `inf-lr`: AdamW with lr=inf (what `optim.lr=inf` did before the config refused it): the loss of step 1 is finite,
  the weights after it are not.

The Trainer is the one `tandem train` builds (`lt_plugins.cli.build_trainer`: ZeroStrategy stage 2, 32-true, the
CLI's callbacks: NonFiniteLossGuard, PeriodicCheckpoint every step); the module knows nothing of shared_model. Like
`tandem train`, a deliberate error is printed as one line on stderr and the exit code is 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lt_plugins.cli import build_trainer
from lt_plugins.config import load_config
from lt_plugins.errors import TrainingError, one_line

REPO = Path(__file__).resolve().parents[2]
NAN_FROM_STEP = 3


class Regressor(pl.LightningModule):
    """A two-layer MLP fitting random targets; `mode` decides how it goes non-finite."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # x: [B, 8], y: [B, 1]
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.mode == "nan-loss" and self.trainer.global_step + 1 >= NAN_FROM_STEP:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        lr = float("inf") if self.mode == "inf-lr" else 1e-3
        return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.01)


def main(run_dir: Path, mode: str) -> int:
    overrides = [f"run_dir={run_dir}", "trainer.max_steps=5", "trainer.precision=32-true", "export.enabled=false"]
    overrides += ["checkpoints.every_n_steps=1", "checkpoints.keep_last=5", "trainer.val_check_interval=100"]
    overrides += ["trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "logging.tensorboard=false"]
    cfg = load_config(REPO / "configs/tiny-cpu.yaml", overrides)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 1, generator=gen))
    torch.manual_seed(0)
    module = Regressor(mode)
    trainer = build_trainer(cfg, run_dir)
    try:
        trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=4))
    except TrainingError as exc:
        print(f"tandem train: error: {one_line(exc)}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
