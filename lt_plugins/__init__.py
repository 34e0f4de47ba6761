"""Lightning plugins for Tandem: DeepSpeed ZeRO on CPU and CUDA, a precision policy, selective activation
checkpointing, a measured memory ledger, a planner, and export to a bundle.

Contract: importing `lt_plugins` is cheap (no DeepSpeed import); the strategy, callbacks and the example module live
in their own files: `strategy.ZeroStrategy`, `precision.PrecisionPolicy`, `checkpointing.SelectiveCheckpointing`,
`ledger_callback.MemoryLedger`, `planner` (+ `auto_strategy` for `strategy.name: auto`), `export.ExportBundle`,
`lit_module.LitCausalLM`, `data.CorpusDataModule`, `config.TrainConfig`, `cli.train_main` / `cli.export_main`.
"""

from __future__ import annotations

from lt_plugins.errors import CheckpointError, PrecisionError, StrategyError, TrainingConfigError, TrainingError

__all__ = ["CheckpointError", "PrecisionError", "StrategyError", "TrainingConfigError", "TrainingError"]
