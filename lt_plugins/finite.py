"""Non-finite training state: the loss guard every `tandem train` run installs, and the check before a checkpoint.

Contract:
- `NonFiniteLossGuard` works with any LightningModule and any strategy. Before each backward it looks at the loss;
  if it is NaN or ±inf on any process (one boolean all-reduce, so every rank stops together) it raises
  `NonFiniteError` naming the optimizer step being computed and the loss value. Training stops before that loss's
  gradients reach the optimizer, so the state it would have produced is never saved.
- `nonfinite_tensor(module)` is the name of the first parameter or buffer holding NaN or ±inf on this process
  (ZeRO-3 shards are read from `ds_tensor`), or None. `PeriodicCheckpoint` calls it, through
  `check_finite_before_save`, so that no checkpoint of non-finite state is written (and so none becomes latest).
- `loss_from_outputs(outputs)` is the loss tensor of a `training_step` result (a tensor or a dict with `loss`), or
  None (manual optimization returning nothing).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lt_plugins.errors import TrainingError


class NonFiniteError(TrainingError, FloatingPointError):
    """The training loss or the model state became NaN or ±inf; training stopped and nothing of it was saved."""


def loss_from_outputs(outputs: Any) -> torch.Tensor | None:
    """The loss of a training_step's outputs, or None when it returned no loss."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, dict) and isinstance(outputs.get("loss"), torch.Tensor):
        return outputs["loss"]
    return None


def _value(loss: torch.Tensor) -> float:
    return float(loss.detach().float().reshape(-1)[0]) if loss.numel() else math.nan


def loss_is_finite(loss: torch.Tensor | None) -> bool:
    """True when there is no loss or every element of it is finite."""
    return loss is None or bool(torch.isfinite(loss.detach()).all())


def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in module.named_parameters():
        yield name, param.detach()
        shard = getattr(param, "ds_tensor", None)  # ZeRO-3: this process's partition
        if isinstance(shard, torch.Tensor):
            yield name, shard.detach()
    for name, buf in module.named_buffers():
        if buf.is_floating_point():
            yield name, buf


def nonfinite_tensor(module: torch.nn.Module) -> str | None:
    """Name of the first floating parameter/buffer holding NaN or ±inf on this process, else None."""
    named = [(n, t) for n, t in _tensors(module) if t.numel() and t.is_floating_point()]
    if not named:
        return None
    flags = torch.stack([torch.isfinite(t).all().to("cpu") for _, t in named])  # one bool per tensor
    if bool(flags.all()):
        return None
    return named[int((~flags).nonzero()[0])][0]


def check_finite_before_save(
    trainer: Trainer, pl_module: LightningModule, name: str, loss: torch.Tensor | None
) -> None:
    """Raise NonFiniteError (on every process) unless the last loss and all parameters are finite everywhere."""
    bad = nonfinite_tensor(pl_module)
    finite_loss = loss_is_finite(loss)
    ok = trainer.strategy.reduce_boolean_decision(bad is None and finite_loss, all=True)
    if ok:
        return
    if bad is not None:
        what = f"parameter {bad!r} holds NaN or inf"
    elif not finite_loss:
        what = f"the last training loss is {_value(loss)}"  # type: ignore[arg-type]
    else:
        what = "another process holds NaN or inf values"
    raise NonFiniteError(
        f"refusing to save checkpoint {name} at step {trainer.global_step}: {what}; training stopped and nothing "
        "was written, so the newest earlier checkpoint (if any) stays latest (lower optim.lr or check the data)"
    )


class NonFiniteLossGuard(Callback):
    """Stop training with `NonFiniteError` when the loss becomes NaN or ±inf (see the module contract)."""

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        finite = loss_is_finite(loss)
        if trainer.strategy.reduce_boolean_decision(finite, all=True):
            return
        step = trainer.global_step + 1  # the optimizer step this loss belongs to (checkpoint step-N is after N)
        where = f"loss {_value(loss)}" if not finite else "a non-finite loss on another process"
        raise NonFiniteError(
            f"non-finite training loss at step {step}: {where}; training stopped before this step's update, no "
            "checkpoint of it was saved (lower optim.lr or check the data)"
        )
