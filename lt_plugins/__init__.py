"""Lightning plugins for Tandem: DeepSpeed ZeRO on CPU and CUDA, a precision policy, selective activation
checkpointing, a measured memory ledger, a planner, and export to a bundle.

Contract:
- Importing `lt_plugins` is cheap: it imports neither Lightning nor DeepSpeed. The public classes live in their own
  files and are also reachable from here, imported on first use (`from lt_plugins import ZeroStrategy`):
  `strategy.ZeroStrategy`, `zero_config.ZeroConfig`, `precision.PrecisionPolicy` / `PrecisionPolicyCallback`,
  `checkpointing.SelectiveCheckpointing` / `CheckpointingConfig`, `ledger_callback.MemoryLedger`,
  `finite.NonFiniteLossGuard`, `checkpoint_io.PeriodicCheckpoint`, `export.ExportBundle` / `export_bundle`,
  `lit_module.LitCausalLM`, `lora.apply_lora` / `LoraConfig`, `export_lora.export_adapter`,
  `data.CorpusDataModule`, `config.TrainConfig` / `load_config`,
  `cli.train_main` / `cli.export_main`; `planner` (+ `auto_strategy` for `strategy.name: auto`) are modules.
- ZeroStrategy's names (`STRATEGY_NAMES`: `Trainer(strategy="tandem_zero_stage_3")`) are registered in Lightning's
  `StrategyRegistry` explicitly: by `register_strategies()` (which imports Lightning's strategies module, not
  DeepSpeed; the registered entry imports `lt_plugins.strategy` only when a Trainer asks for the name), and when
  `lt_plugins.strategy` itself is imported. Importing `lt_plugins` changes nothing outside it (no import hook).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lt_plugins.errors import CheckpointError, PrecisionError, StrategyError, TrainingConfigError, TrainingError

if TYPE_CHECKING:  # what the lazy attributes below resolve to, for type checkers and IDEs
    from lt_plugins.checkpoint_io import PeriodicCheckpoint
    from lt_plugins.checkpointing import CheckpointingConfig, SelectiveCheckpointing
    from lt_plugins.cli import export_main, train_main
    from lt_plugins.config import TrainConfig, load_config
    from lt_plugins.data import CorpusDataModule
    from lt_plugins.export.adapter import export_adapter
    from lt_plugins.export.bundle import ExportBundle, export_bundle
    from lt_plugins.finite import NonFiniteLossGuard
    from lt_plugins.ledger_callback import MemoryLedger
    from lt_plugins.lit_module import LitCausalLM
    from lt_plugins.lora import LoraConfig, apply_lora
    from lt_plugins.precision import PrecisionPolicy, PrecisionPolicyCallback
    from lt_plugins.strategy import ZeroStrategy
    from lt_plugins.zero_config import ZeroConfig

_LAZY: dict[str, str] = {
    "ZeroStrategy": "lt_plugins.strategy",
    "ZeroConfig": "lt_plugins.zero_config",
    "PrecisionPolicy": "lt_plugins.precision",
    "PrecisionPolicyCallback": "lt_plugins.precision",
    "SelectiveCheckpointing": "lt_plugins.checkpointing",
    "CheckpointingConfig": "lt_plugins.checkpointing",
    "MemoryLedger": "lt_plugins.ledger_callback",
    "NonFiniteLossGuard": "lt_plugins.finite",
    "PeriodicCheckpoint": "lt_plugins.checkpoint_io",
    "ExportBundle": "lt_plugins.export.bundle",
    "export_bundle": "lt_plugins.export.bundle",
    "LitCausalLM": "lt_plugins.lit_module",
    "apply_lora": "lt_plugins.lora",
    "LoraConfig": "lt_plugins.lora",
    "export_adapter": "lt_plugins.export.adapter",
    "CorpusDataModule": "lt_plugins.data",
    "TrainConfig": "lt_plugins.config",
    "load_config": "lt_plugins.config",
    "train_main": "lt_plugins.cli",
    "export_main": "lt_plugins.cli",
}
"""Public name → the module that defines it (imported on first access)."""

__all__ = [
    "STRATEGY_NAMES",
    "CheckpointError",
    "CheckpointingConfig",
    "CorpusDataModule",
    "ExportBundle",
    "LitCausalLM",
    "LoraConfig",
    "MemoryLedger",
    "NonFiniteLossGuard",
    "PeriodicCheckpoint",
    "PrecisionError",
    "PrecisionPolicy",
    "PrecisionPolicyCallback",
    "SelectiveCheckpointing",
    "StrategyError",
    "TrainConfig",
    "TrainingConfigError",
    "TrainingError",
    "ZeroConfig",
    "ZeroStrategy",
    "apply_lora",
    "export_adapter",
    "export_bundle",
    "export_main",
    "load_config",
    "register_strategies",
    "train_main",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lt_plugins' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# ---------------------------------------------------------------------------------------- strategy registry
STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "tandem_zero": ("Tandem ZeroStrategy: DeepSpeed ZeRO on CPU (gloo) or CUDA, stage 2", {}),
    "tandem_zero_stage_1": ("Tandem ZeroStrategy, ZeRO stage 1 (optimizer state sharded)", {"stage": 1}),
    "tandem_zero_stage_2": ("Tandem ZeroStrategy, ZeRO stage 2 (+ gradients sharded)", {"stage": 2}),
    "tandem_zero_stage_2_offload": (
        "Tandem ZeroStrategy, ZeRO stage 2, optimizer state offloaded to CPU memory",
        {"stage": 2, "offload_optimizer": True},
    ),
    "tandem_zero_stage_3": ("Tandem ZeroStrategy, ZeRO stage 3 (+ parameters sharded)", {"stage": 3}),
    "tandem_zero_stage_3_offload": (
        "Tandem ZeroStrategy, ZeRO stage 3, optimizer state and parameters offloaded to CPU memory",
        {"stage": 3, "offload_optimizer": True, "offload_params": True},
    ),
}
"""The names `Trainer(strategy=...)` accepts for ZeroStrategy: name → (description, ZeroStrategy arguments)."""


def _zero_strategy(**kwargs: Any) -> Any:
    """The registry's entry for the names above: imports the strategy (and Lightning, DeepSpeed) only when used."""
    from lt_plugins.strategy import ZeroStrategy

    return ZeroStrategy(**kwargs)


def register_strategies(
    registry: Any | None = None, strategy: Callable[..., Any] | None = None, *, override: bool = False
) -> None:
    """Add `STRATEGY_NAMES` to a Lightning `StrategyRegistry` (Lightning's own when None). Names already there are
    kept unless `override`."""
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry as registry
    for name, (description, params) in STRATEGY_NAMES.items():
        if name in registry and not override:
            continue
        registry.register(name, strategy or _zero_strategy, description=description, override=True, **params)
