"""A user's own LightningModule for `model.class_path` (imported by name in test_user_module.py's runs).

`BagOfTokens(vocab_size, hidden=8, lr=0.01)`: an embedding and a linear head trained on the batch contract of
`CorpusDataModule` (int64 token rows [B, block_size + 1]; inputs row[:, :-1], targets row[:, 1:]). `vocab_size` is
injected by `tandem train`; `hidden` and `lr` come from `model.init_args`.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn


class BagOfTokens(pl.LightningModule):
    def __init__(self, vocab_size: int, hidden: int = 8, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()  # logs/hparams.yaml: the test reads what the CLI passed
        self.embed = nn.Embedding(vocab_size, hidden)
        self.head = nn.Linear(hidden, vocab_size)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T] each
        logits = self.head(self.embed(inputs))  # [B, T, vocab]
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, on_step=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        logits = self.head(self.embed(batch[:, :-1]))
        self.log("val_loss", nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class NotAModule:
    """For the refusal test: not a LightningModule."""
