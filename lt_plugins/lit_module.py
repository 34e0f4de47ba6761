"""LitCausalLM: the example LightningModule around shared_model's decoder.

Contract:
- Holds the decoder as `self.model` (so checkpoint keys are `model.<HF name>`, see `STATE_PREFIX`) and the loss as
  a module (`self.loss_fn`, a CrossEntropyLoss) so that a precision policy can keep it in fp32.
- Batches are token rows [B, T+1]: inputs are row[:, :-1], targets row[:, 1:].
- Logs `train_loss`, `lr` and `tokens_per_s` (global: all processes) on the progress bar; `val_loss` and
  `val_ppl` (averaged over processes) after each validation.
- AdamW (no decay on vectors), linear warm-up then cosine to `min_lr_ratio`·lr, stepped every optimizer step.
- The model is built fully on every rank at construction (deterministic from `seed`); ZeRO shards it afterwards.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lt_plugins.config import OptimSection
from shared_model.config import ModelConfig
from shared_model.evaluate import token_nll
from shared_model.model import build_model

STATE_PREFIX = "model."
"""Prefix of the decoder's parameters in this module's state dict (stripped on export)."""


class LitCausalLM(pl.LightningModule):
    """Next-token prediction with shared_model's CausalLM."""

    def __init__(self, model_config: ModelConfig, optim: OptimSection | None = None, seed: int = 0) -> None:
        super().__init__()
        self.model_config = model_config
        self.optim = optim or OptimSection()
        self.model = build_model(model_config, seed=seed)
        self.loss_fn = nn.CrossEntropyLoss()
        self._last_step_time: float | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T] each
        logits = self.model(inputs)  # [B, T, vocab]
        return self.loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss.detach().float(), prog_bar=True, on_step=True)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], prog_bar=True, on_step=True)
        now = time.perf_counter()
        if self._last_step_time is not None:
            tokens = (batch.shape[0] * (batch.shape[1] - 1)) * self.trainer.world_size
            self.log("tokens_per_s", tokens / max(now - self._last_step_time, 1e-9), prog_bar=True, on_step=True)
        self._last_step_time = now
        return loss

    def on_validation_start(self) -> None:
        self._last_step_time = None  # do not count validation time as training throughput

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T] each
        nll, count = token_nll(self.model(inputs), targets)  # the scoring function `tandem eval` uses
        loss = nll / count
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, on_epoch=True)
        self.log("val_ppl", torch.exp(loss.clamp(max=30.0)), sync_dist=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        o = self.optim
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=(o.beta1, o.beta2),
        )
        total = max(self.trainer.max_steps, 1) if self._trainer is not None else 1
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(o.warmup_steps, total, o.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class warmup_cosine:
    """lr multiplier: linear warm-up over `warmup` steps, then cosine from 1 to `floor` at `total` steps."""

    def __init__(self, warmup: int, total: int, floor: float) -> None:
        self.warmup, self.total, self.floor = warmup, total, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min((step - self.warmup) / max(self.total - self.warmup, 1), 1.0)
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))
