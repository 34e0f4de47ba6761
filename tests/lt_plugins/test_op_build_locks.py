"""Build locks left by a process killed while DeepSpeed built an op are removed before DeepSpeed starts (a live
build's lock is kept); torch's builder would otherwise wait on them for ever."""

from __future__ import annotations

import os
import time

import pytest
from lightning.pytorch import Trainer

from lt_plugins import op_builds
from lt_plugins import strategy as strategy_module
from lt_plugins.strategy import ZeroStrategy


def _lock(path, age_s: float):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_only_locks_older_than_a_build_are_removed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = [
        _lock(tmp_path / "deepspeed_shm_comm" / "lock", 1200),
        _lock(tmp_path / "py311_cpu" / "cpu_adam" / "lock", 900),
    ]
    live = _lock(tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", 30)
    built = tmp_path / "py311_cpu" / "cpu_adam" / "cpu_adam.so"
    built.touch()
    assert sorted(op_builds.drop_stale_build_locks()) == sorted(stale)
    assert not any(p.exists() for p in stale)
    assert live.exists() and built.exists()
    assert op_builds.drop_stale_build_locks() == []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "missing"))
    assert op_builds.drop_stale_build_locks() == []


def test_the_strategy_drops_them_before_anything_else(monkeypatch) -> None:
    class Called(Exception):
        pass

    def called() -> None:
        raise Called

    monkeypatch.setattr(strategy_module, "drop_stale_build_locks", called)
    trainer = Trainer(strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=1, logger=False)
    with pytest.raises(Called):
        trainer.strategy.setup_environment()
