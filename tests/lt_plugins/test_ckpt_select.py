"""Which modules a CheckpointingConfig wraps, config errors, undo, and the Lightning callback on a plain strategy."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lt_plugins.checkpointing import (
    CheckpointingConfig,
    SelectiveCheckpointing,
    apply_checkpointing,
    remove_checkpointing,
    resolve_ops,
)
from lt_plugins.errors import TrainingConfigError
from shared_model.model import build_model
from tests.conftest import tiny_config


def _model(layers: int = 4) -> nn.Module:
    return build_model(tiny_config(num_layers=layers))


def test_default_blocks_are_the_largest_repeated_stack() -> None:
    names = apply_checkpointing(_model(), CheckpointingConfig(mode="full"))
    assert names == [f"model.layers.{i}" for i in range(4)]


def test_every_n_by_class_and_by_regex() -> None:
    model = _model(6)
    assert apply_checkpointing(model, CheckpointingConfig(mode="ops", every_n=2)) == [
        "model.layers.1",
        "model.layers.3",
        "model.layers.5",
    ]
    by_class = CheckpointingConfig(mode="full", block_classes=("DecoderLayer",), every_n=3)
    assert apply_checkpointing(model, by_class) == ["model.layers.2", "model.layers.5"]
    assert apply_checkpointing(model, CheckpointingConfig(mode="full", name_regex=r"model\.layers\.[04]\.mlp")) == [
        "model.layers.0.mlp",
        "model.layers.4.mlp",
    ]


def test_attention_mode_targets_core_attention_inside_blocks() -> None:
    names = apply_checkpointing(_model(2), CheckpointingConfig(mode="attention"))
    assert names == ["model.layers.0.self_attn.core", "model.layers.1.self_attn.core"]


def test_apply_twice_does_not_nest_and_remove_restores() -> None:
    model = _model(2)
    apply_checkpointing(model, CheckpointingConfig(mode="full"))
    apply_checkpointing(model, CheckpointingConfig(mode="full"))
    layer = model.model.layers[0]
    assert layer.forward.__wrapped__.__func__ is type(layer).forward  # one wrapper around the bound method
    assert remove_checkpointing(model) == 2
    assert "forward" not in layer.__dict__
    assert apply_checkpointing(model, CheckpointingConfig(mode="none")) == []


def test_state_dict_names_do_not_change() -> None:
    model = _model(2)
    before = list(model.state_dict())
    apply_checkpointing(model, CheckpointingConfig(mode="ops"))
    assert list(model.state_dict()) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "selective"}, "checkpointing.mode"),
        ({"every_n": 0}, "checkpointing.every_n"),
        ({"name_regex": "("}, "checkpointing.name_regex"),
        ({"save_ops": ("aten.no_such_op",)}, "checkpointing.save_ops"),
        ({"save_ops": ("mm",)}, "checkpointing.save_ops"),
        ({"save_ops": ("aten.mm.bogus",)}, "no overload"),
    ],
)
def test_bad_configs_name_the_key(kwargs: dict, message: str) -> None:
    with pytest.raises(TrainingConfigError, match=message):
        CheckpointingConfig(**kwargs)


def test_nothing_to_checkpoint_is_an_error() -> None:
    with pytest.raises(TrainingConfigError, match="no blocks"):
        apply_checkpointing(nn.Linear(2, 2), CheckpointingConfig(mode="full"))
    with pytest.raises(TrainingConfigError, match="attention_classes"):
        apply_checkpointing(_model(2), CheckpointingConfig(mode="attention", attention_classes=("Nope",)))
    with pytest.raises(TrainingConfigError, match="hold parameters directly"):
        apply_checkpointing(
            _model(2), CheckpointingConfig(mode="full", name_regex=r".*q_proj", allow_direct_params=False)
        )


def test_resolve_ops_expands_overloads() -> None:
    ops = resolve_ops(["aten.mm", "aten.addmm.default"])
    assert torch.ops.aten.mm.default in ops and torch.ops.aten.addmm.default in ops


class _Lit(pl.LightningModule):
    """Any LightningModule: the callback knows nothing about it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build_model(tiny_config(num_layers=2))
        self.losses: list[float] = []
        self.wrapped_during_step: list[bool] = []

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        loss = F.cross_entropy(self.net(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        self.losses.append(loss.item())
        self.wrapped_during_step.append("forward" in self.net.model.layers[0].__dict__)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(callbacks: list) -> _Lit:
    torch.manual_seed(0)
    module = _Lit()
    data = torch.randint(0, 512, (6, 17), generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    return module


@pytest.mark.parametrize("mode", ["full", "ops"])
def test_callback_on_a_plain_strategy_trains_identically(mode: str) -> None:
    reference = _fit([])
    callback = SelectiveCheckpointing(mode=mode)
    checkpointed = _fit([callback])
    assert "forward" not in checkpointed.net.model.layers[0].__dict__  # undone at teardown ...
    assert callback.wrapped == ["net.model.layers.0", "net.model.layers.1"] and callback.num_wrapped == 2  # ... kept
    assert checkpointed.wrapped_during_step == [True] * 3 and reference.wrapped_during_step == [False] * 3
    assert checkpointed.losses == pytest.approx(reference.losses, rel=1e-6)


def test_callback_reports_what_it_wrapped_on_lightnings_logger() -> None:
    # Lightning's default logging shows its "lightning.pytorch" logger (INFO, its own handler when the root logger has
    # none, like "GPU available: ..."): the report must reach it, and stay readable on the callback after fit.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    lightning_logger = logging.getLogger("lightning.pytorch")
    lightning_logger.addHandler(handler)
    try:
        callback = SelectiveCheckpointing(mode="full")
        _fit([callback])
    finally:
        lightning_logger.removeHandler(handler)
    assert lightning_logger.getEffectiveLevel() <= logging.INFO
    lines = [r.getMessage() for r in records if "checkpointing" in r.getMessage()]
    assert lines == [
        "Activation checkpointing (mode=full): 2 module(s) wrapped: net.model.layers.0, net.model.layers.1"
    ], lines
    assert callback.summary() == lines[0] and callback.num_wrapped == 2


class _LateLit(_Lit):
    """Builds its layers in configure_model (as under ZeRO-3 init): the callback applies at fit start."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.losses: list[float] = []
        self.wrapped_during_step: list[bool] = []

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = build_model(tiny_config(num_layers=2))


def test_callback_waits_for_configure_model() -> None:
    callback = SelectiveCheckpointing(mode="full")
    module = _LateLit()
    data = torch.randint(0, 512, (4, 17), generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    assert module.wrapped_during_step == [True, True]
