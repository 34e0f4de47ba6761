"""`strategy.name: auto` in the training config: the planner's choice is applied and explained."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lt_plugins import auto_strategy
from lt_plugins.auto_strategy import resolve_auto, training_callbacks
from lt_plugins.checkpointing import SelectiveCheckpointing
from lt_plugins.config import load_config
from lt_plugins.errors import TrainingConfigError
from lt_plugins.ledger_callback import MemoryLedger

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"


def test_auto_applies_the_planner_choice_and_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(CONFIG, ["strategy.name=auto", "checkpointing.mode=auto", "trainer.devices=2"])
    with caplog.at_level(logging.WARNING, logger="lt_plugins.auto_strategy"):
        resolved = resolve_auto(cfg)
    assert resolved.strategy.name == "zero" and resolved.checkpointing.mode in ("none", "full", "attention", "ops")
    assert cfg.strategy.name == "auto"  # the input is not modified
    assert "strategy auto chose ZeRO stage" in caplog.text and "predicted per device" in caplog.text
    assert resolve_auto(resolved) is resolved


def test_auto_with_a_fixed_mode_keeps_it_and_reports_what_did_not_fit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(CONFIG, ["strategy.name=auto", "checkpointing.mode=full", "trainer.devices=2"])
    assert resolve_auto(cfg).checkpointing.mode == "full"
    # 150 MB (135 usable): the tiny model's state (~94 MB) + no-checkpointing activations (~47 MB) do not fit
    monkeypatch.setattr(auto_strategy, "device_memory", lambda *_: (150e6, "a 150 MB test device"))
    cfg = load_config(CONFIG, ["strategy.name=auto", "checkpointing.mode=auto", "trainer.devices=2"])
    with caplog.at_level(logging.WARNING, logger="lt_plugins.auto_strategy"):
        resolved = resolve_auto(cfg)
    assert resolved.checkpointing.mode != "none"
    assert "faster but does not fit" in caplog.text and "limited by Saved activations" in caplog.text


def test_nothing_fits_names_the_limiting_term(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto_strategy, "device_memory", lambda *_: (1e6, "a 1 MB test device"))
    cfg = load_config(CONFIG, ["strategy.name=auto"])
    with pytest.raises(TrainingConfigError, match=r"no configuration fits a 1 MB test device.*limited by"):
        resolve_auto(cfg)


def test_mode_auto_needs_strategy_auto() -> None:
    cfg = load_config(CONFIG, ["checkpointing.mode=auto"])
    with pytest.raises(TrainingConfigError, match=r"needs strategy\.name=auto"):
        resolve_auto(cfg)


def test_training_callbacks_follow_the_config(tmp_path: Path) -> None:
    assert training_callbacks(load_config(CONFIG), tmp_path) == []
    callbacks = training_callbacks(load_config(CONFIG, ["checkpointing.mode=ops", "ledger.enabled=true"]), tmp_path)
    assert [type(c) for c in callbacks] == [SelectiveCheckpointing, MemoryLedger]
    assert callbacks[0].config.mode == "ops" and callbacks[1].report_dir == tmp_path / "memory"


def test_yaml_sections_are_validated() -> None:
    with pytest.raises(TrainingConfigError, match=r"checkpointing\.every_n"):
        load_config(CONFIG, ["checkpointing.every_n=0"])
    with pytest.raises(TrainingConfigError, match=r"unknown config key 'ledger\.nope'"):
        load_config(CONFIG, ["ledger.nope=1"])
    cfg = load_config(CONFIG, ["checkpointing.save_ops=[aten.mm]"])
    assert cfg.checkpointing.to_config().save_ops == ("aten.mm",)
