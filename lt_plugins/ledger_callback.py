"""MemoryLedger: predict every memory term of a training run on each rank, measure it, log both, warn on gaps.

Contract:
- Works with any LightningModule, under ZeroStrategy / DeepSpeedStrategy (any stage, offload, precision) and under
  plain strategies (single device, DDP).
- At fit start it predicts, per rank: frozen weights (LoRA's base: whole below stage 3, the rank's shard at
  stage 3, from their element counts and dtype), and 16-bit (model-dtype) weights, fp32 master weights, gradients
  and optimizer moments from the trainable parameter sizes, the ZeRO stage, world size, precision and offload
  (`memory_model.deepspeed_state_terms`; plain strategies hold weights, gradients and Adam moments whole in the
  parameter dtype and no master copy), and the communication buckets from the DeepSpeed config. Saved activations
  are predicted by measuring the first micro-step's forward with `SavedActivationMeter`.
- At optimizer step `measure_at_step` (>= 1, so that the optimizer state exists) it measures the same terms on
  each rank: activations of that step's first micro-batch, bucket buffers at the start of its backward, and the
  state tensors actually held (`ledger_measure.held_state_bytes`) just before the optimizer step; on CUDA also
  `torch.cuda` allocated and peak bytes against the predicted total.
- It logs one row per term (predicted, measured, ratio), warns (logging.WARNING) for each term off by more than
  `tolerance`, keeps the rows in `self.rows` and, with `report_dir`, writes `memory_ledger_rank{R}.json`.
- It never changes training: it only reads tensors and installs saved-tensor hooks for two forward passes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from lt_plugins.activation_meter import SavedActivationMeter
from lt_plugins.errors import TrainingConfigError
from lt_plugins.ledger_measure import bucket_bytes_held, frozen_buffers, held_state_bytes, innermost_optimizer
from lt_plugins.memory_model import (
    ACTIVATIONS,
    BUCKETS,
    FROZEN,
    GRADS,
    MASTER,
    MOMENTS,
    TERMS,
    WEIGHTS,
    ZeroLayout,
    bucket_bytes,
    deepspeed_state_terms,
    frozen_weight_bytes,
)

log = logging.getLogger(__name__)

_MOMENT_ARRAYS = {"Adam": 2, "AdamW": 2, "FusedAdam": 2, "DeepSpeedCPUAdam": 2, "Adamax": 2, "RMSprop": 1}


@dataclass
class LedgerRow:
    term: str
    predicted: float | None
    measured: float | None
    rank: int

    @property
    def ratio(self) -> float | None:
        if self.predicted is None or self.measured is None:
            return None
        if self.predicted == 0:
            return 1.0 if self.measured == 0 else float("inf")
        return self.measured / self.predicted

    def off_by_more_than(self, tolerance: float) -> bool:
        return self.ratio is not None and abs(self.ratio - 1.0) > tolerance

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


@dataclass
class LedgerSection:
    """The `ledger:` section of the training YAML."""

    enabled: bool = False
    """Add the MemoryLedger callback (writes <run_dir>/memory/memory_ledger_rank*.json)."""
    measure_at_step: int = 1
    """Optimizer step at which the terms are measured (>= 1)."""
    tolerance: float = 0.10
    """Warn when a term is off its prediction by more than this fraction."""

    def __post_init__(self) -> None:
        if self.measure_at_step < 1:
            raise TrainingConfigError(f"ledger.measure_at_step must be >= 1, got {self.measure_at_step}")
        if not 0 < self.tolerance < 1:
            raise TrainingConfigError(f"ledger.tolerance must be in (0, 1), got {self.tolerance}")


def zero_layout(strategy: Any, precision: str, world: int) -> ZeroLayout | None:
    """The ZeRO layout of a DeepSpeed-based strategy, from its DeepSpeed config; None for other strategies."""
    config = getattr(strategy, "config", None)
    if not isinstance(config, dict) or "zero_optimization" not in config:
        return None
    zero = config["zero_optimization"]
    return ZeroLayout(
        stage=int(zero.get("stage", 0)),
        world=world,
        precision=precision,
        offload_optimizer=(zero.get("offload_optimizer") or {}).get("device", "none") == "cpu",
        offload_params=(zero.get("offload_param") or {}).get("device", "none") == "cpu",
        bucket_elements=int(zero.get("reduce_bucket_size", 500_000_000)),
        overlap_comm=bool(zero.get("overlap_comm", False)),
        persistence_threshold=int(zero.get("stage3_param_persistence_threshold", 100_000)),
    )


def _numels(module: torch.nn.Module) -> list[int]:
    return [int(getattr(p, "ds_numel", p.numel())) for p in module.parameters() if p.requires_grad]


def predict_state(
    module: torch.nn.Module, layout: ZeroLayout | None, optimizer: Any
) -> dict[str, tuple[float | None, float]]:
    """Predicted (gpu-or-rank bytes, host bytes) per state term and buckets. Plain strategies: weights, grads and
    moments whole in the parameter dtype, no master copy; moments None for an optimizer of unknown kind."""
    numels = _numels(module)
    frozen = [(int(getattr(p, "ds_numel", p.numel())), p.element_size()) for p in module.parameters()
              if not p.requires_grad]  # fmt: skip
    frozen += [(b.numel(), b.element_size()) for b in frozen_buffers(module)]  # whole on every rank
    if layout is not None:
        terms = {t.name: (t.gpu_bytes, t.cpu_bytes) for t in deepspeed_state_terms(numels, layout)}
        held = frozen_weight_bytes(frozen, layout)
        terms[FROZEN] = (held.gpu_bytes, held.cpu_bytes)
        terms[BUCKETS] = (bucket_bytes(sum(numels), layout), 0.0)
        return terms
    params = [p for p in module.parameters() if p.requires_grad]
    size = float(sum(p.numel() * p.element_size() for p in params))
    arrays = _MOMENT_ARRAYS.get(type(innermost_optimizer(optimizer)).__name__)
    inner = innermost_optimizer(optimizer)
    if type(inner).__name__ == "SGD":
        arrays = 1 if any(g.get("momentum", 0) for g in inner.param_groups) else 0
    return {
        WEIGHTS: (size, 0.0),
        FROZEN: (float(sum(n * b for n, b in frozen)), 0.0),
        MASTER: (0.0, 0.0),
        GRADS: (size, 0.0),
        MOMENTS: (None if arrays is None else arrays * size, 0.0),
        BUCKETS: (0.0, 0.0),
    }


class MemoryLedger(Callback):
    """Predicted vs measured bytes per term on every rank (see the module contract)."""

    def __init__(self, measure_at_step: int = 1, tolerance: float = 0.10, report_dir: str | Path | None = None):
        super().__init__()
        if measure_at_step < 1:
            raise TrainingConfigError(
                f"ledger.measure_at_step must be >= 1 (optimizer state exists), got {measure_at_step}"
            )
        self.measure_at_step = measure_at_step
        self.tolerance = tolerance
        self.report_dir = Path(report_dir) if report_dir is not None else None
        self.predicted: dict[str, float | None] = {}
        self.measured: dict[str, float | None] = {}
        self.rows: list[LedgerRow] = []
        self.layout: ZeroLayout | None = None
        self._meter: SavedActivationMeter | None = None
        self._metering: str | None = None
        self._done_steps: set[int] = set()
        self._bucket_samples: list[int] = []
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------------------------- prediction
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.layout = zero_layout(trainer.strategy, str(trainer.precision), trainer.world_size)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        for term, (gpu, cpu) in predict_state(pl_module, self.layout, optimizer).items():
            self.predicted[term] = None if gpu is None else gpu + cpu
        self.measured = {}
        self.rows = []
        self._done_steps = set()

    # ------------------------------------------------------------------------------------- activations
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step in self._done_steps or step not in (0, self.measure_at_step):
            return
        self._done_steps.add(step)
        self._metering = "predicted" if step == 0 else "measured"
        self._meter = SavedActivationMeter(exclude=[*pl_module.parameters(), *pl_module.buffers()])
        self._meter.__enter__()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._meter is None:
            return
        self._close_meter()
        if trainer.global_step == self.measure_at_step and loss.requires_grad:
            optimizer = trainer.optimizers[0]

            def sample(*_: Any) -> None:
                self._bucket_samples.append(bucket_bytes_held(optimizer))

            # DeepSpeed allocates its reduce buckets in its own gradient hooks and frees them at the end of
            # backward: sample after each parameter's gradient is accumulated (our hooks run after DeepSpeed's).
            loss.register_hook(lambda g: sample() or g)
            params = [p for p in pl_module.parameters() if p.requires_grad]
            self._hooks = [p.register_post_accumulate_grad_hook(sample) for p in params]

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _close_meter(self) -> None:
        meter, self._meter = self._meter, None
        if meter is None:
            return
        meter.__exit__(None, None, None)
        target = self.predicted if self._metering == "predicted" else self.measured
        target[ACTIVATIONS] = float(meter.bytes)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close_meter()

    # ------------------------------------------------------------------------------------- measurement
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step != self.measure_at_step or WEIGHTS in self.measured:
            return
        self.measured.update({k: float(v) for k, v in held_state_bytes(pl_module, optimizer).items()})
        self.measured[BUCKETS] = float(max([bucket_bytes_held(optimizer), *self._bucket_samples]))
        self._report(trainer)

    def _cuda_rows(self, trainer: Any, rank: int) -> list[LedgerRow]:
        device = trainer.strategy.root_device
        if device.type != "cuda":
            return []
        total = sum(v for v in self.predicted.values() if v is not None)
        return [
            LedgerRow("CUDA allocated (state + buckets)", total - (self.predicted.get(ACTIVATIONS) or 0.0),
                      float(torch.cuda.memory_allocated(device)), rank),
            LedgerRow("CUDA peak allocated", total, float(torch.cuda.max_memory_allocated(device)), rank),
        ]  # fmt: skip

    def _report(self, trainer: Any) -> None:
        rank = trainer.global_rank
        self.rows = [LedgerRow(t, self.predicted.get(t), self.measured.get(t), rank) for t in TERMS]
        self.rows += self._cuda_rows(trainer, rank)
        log.info("%s", format_rows(self.rows, self.layout, trainer.world_size))
        for row in self.rows:
            if row.off_by_more_than(self.tolerance):
                log.warning(
                    "memory ledger rank %d: %s measured %s vs predicted %s (x%.2f, more than %.0f%% off)",
                    rank, row.term, _mb(row.measured), _mb(row.predicted), row.ratio, 100 * self.tolerance,
                )  # fmt: skip
        if trainer.logger is not None:
            metrics = {
                f"memory/{_key(r.term)}_{kind}_mb": v / 1e6
                for r in self.rows
                for kind, v in (("predicted", r.predicted), ("measured", r.measured))
                if v is not None
            }
            trainer.logger.log_metrics(metrics, step=trainer.global_step)
        if self.report_dir is not None:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            layout = None if self.layout is None else asdict(self.layout)
            data = {
                "rank": rank,
                "world": trainer.world_size,
                "layout": layout,
                "rows": [r.to_dict() for r in self.rows],
            }
            path = self.report_dir / f"memory_ledger_rank{rank}.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)


def _key(term: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in term.lower()).strip("_")


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:,.1f} MB"


def format_rows(rows: list[LedgerRow], layout: ZeroLayout | None, world: int) -> str:
    what = "plain strategy" if layout is None else f"ZeRO stage {layout.stage}, offload {layout.offload}"
    rank = rows[0].rank if rows else 0
    lines = [
        f"Memory ledger, rank {rank} of {world} ({what}):",
        f"  {'term':<36}{'predicted':>14}{'measured':>14}  ratio",
    ]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        lines.append(f"  {r.term:<36}{_mb(r.predicted):>14}{_mb(r.measured):>14}  {ratio}")
    return "\n".join(lines)
