"""ZeroStrategy: DeepSpeed ZeRO stages 0-3 for any LightningModule, on CUDA (nccl) and on CPU (gloo).

Contract:
- `ZeroStrategy(stage=3)` or `ZeroStrategy(ZeroConfig(...), extra={...})`. DeepSpeed does the sharding; this class
  only builds its config from a typed `ZeroConfig` and lifts the three places where Lightning's DeepSpeedStrategy
  refuses the CPU: the CUDA-only accelerator check, the device-index validation and `device_rank=None`.
- `extra` (a dict or an OmegaConf DictConfig) is merged into the generated DeepSpeed config. It may add keys; a key
  that the typed config owns (`zero_optimization.stage`, the offload devices) with a different value is an error
  naming both. So is a key that the Trainer owns (`gradient_accumulation_steps` vs `accumulate_grad_batches`,
  `gradient_clipping` vs `gradient_clip_val`, `fp16`/`bf16` vs `precision`) set to a different value.
- `16-mixed` on CPU is refused at setup with a `PrecisionError`. fp32 master weights and optimizer state are kept
  by DeepSpeed in every mixed mode.
- Checkpoints are DeepSpeed's sharded directories; after every save, rank 0 writes `tandem_manifest.json` (files,
  sizes, SHA-256) so that export can tell a complete checkpoint from a partial or corrupt one.
- Nothing here knows about shared_model.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy

from lt_plugins.checkpoint_io import write_manifest
from lt_plugins.errors import PrecisionError, StrategyError, TrainingConfigError


@dataclass(frozen=True)
class ZeroConfig:
    """What ZeRO shards and where it keeps it. Everything else DeepSpeed takes goes through `extra`."""

    stage: int = 2
    """0: plain data parallel; 1: + optimizer state sharded; 2: + gradients sharded; 3: + parameters sharded."""
    offload_optimizer: bool = False
    """Keep the optimizer state (and fp32 master weights) in CPU memory and step there (stages 1-3)."""
    offload_params: bool = False
    """Keep the parameter shards in CPU memory between uses (stage 3 only)."""
    pin_memory: bool = False
    """Page-lock offloaded buffers (faster host-device copies on CUDA)."""
    overlap_comm: bool = False
    """Overlap gradient reduction with the backward pass (worth it on CUDA; costs memory)."""
    bucket_size: int = 50_000_000
    """Elements per all-gather / reduce bucket."""
    param_persistence_threshold: int = 100_000
    """Stage 3: parameters with fewer elements than this stay whole on every rank (0 = shard everything)."""
    timeout_s: int = 1800
    """Collective timeout of the process group, in seconds."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise TrainingConfigError(f"strategy.stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.offload_params and self.stage != 3:
            raise TrainingConfigError(f"strategy.offload_params needs strategy.stage=3, got stage={self.stage}")
        if self.offload_optimizer and self.stage == 0:
            raise TrainingConfigError("strategy.offload_optimizer needs strategy.stage >= 1, got stage=0")
        for name in ("bucket_size", "timeout_s"):
            if getattr(self, name) <= 0:
                raise TrainingConfigError(f"strategy.{name} must be > 0, got {getattr(self, name)}")
        if self.param_persistence_threshold < 0:
            raise TrainingConfigError(
                f"strategy.param_persistence_threshold must be >= 0, got {self.param_persistence_threshold}"
            )

    def to_deepspeed(self) -> dict[str, Any]:
        """The DeepSpeed config section this typed config owns."""
        zero: dict[str, Any] = {
            "stage": self.stage,
            "overlap_comm": self.overlap_comm,
            "contiguous_gradients": True,
            "allgather_bucket_size": self.bucket_size,
            "reduce_bucket_size": self.bucket_size,
        }
        if self.stage == 3:
            zero["stage3_param_persistence_threshold"] = self.param_persistence_threshold
            zero["stage3_prefetch_bucket_size"] = self.bucket_size
        if self.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": self.pin_memory}
        if self.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": self.pin_memory}
        return {"zero_optimization": zero, "zero_allow_untested_optimizer": True}


# Keys of the generated config that the typed ZeroConfig owns: extra may repeat them, never change them.
_OWNED = {
    ("zero_optimization", "stage"): "stage",
    ("zero_optimization", "offload_optimizer", "device"): "offload_optimizer",
    ("zero_optimization", "offload_param", "device"): "offload_params",
}


def _plain(extra: Mapping[str, Any] | Any | None) -> dict[str, Any]:
    """A plain dict from a dict or an OmegaConf DictConfig (resolved)."""
    if extra is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(extra, DictConfig):
            return OmegaConf.to_container(extra, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf is a train dependency
        pass
    if not isinstance(extra, Mapping):
        raise TrainingConfigError(f"strategy extra must be a mapping, got {type(extra).__name__}")
    return copy.deepcopy(dict(extra))


def merge_deepspeed_config(config: ZeroConfig, extra: Mapping[str, Any] | Any | None = None) -> dict[str, Any]:
    """Typed config + extra keys → one DeepSpeed dict. A changed owned key is an error naming both sides."""
    base = config.to_deepspeed()
    extra_dict = _plain(extra)
    for path, field_name in _OWNED.items():
        node: Any = extra_dict
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        if node is None:
            continue
        ours: Any = base
        for key in path:
            ours = ours.get(key) if isinstance(ours, Mapping) else None
        if node != ours:
            raise TrainingConfigError(
                f"DeepSpeed config key '{'.'.join(path)}'={node!r} conflicts with strategy.{field_name}="
                f"{getattr(config, field_name)!r}; set it in one place"
            )
    return _deep_merge(base, extra_dict)


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class ZeroStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO for any LightningModule, on CUDA and on CPU (gloo, several processes)."""

    strategy_name = "tandem_zero"

    def __init__(
        self,
        config: ZeroConfig | None = None,
        *,
        extra: Mapping[str, Any] | Any | None = None,
        **overrides: Any,
    ) -> None:
        """`config` or keyword overrides of ZeroConfig's fields (`ZeroStrategy(stage=3)`); `extra` adds raw
        DeepSpeed keys. Lightning's own arguments (accelerator, parallel_devices, cluster_environment,
        process_group_backend) pass through `overrides` too."""
        lightning_keys = {"accelerator", "parallel_devices", "cluster_environment", "process_group_backend"}
        lightning_kwargs = {k: overrides.pop(k) for k in list(overrides) if k in lightning_keys}
        fields = set(ZeroConfig.__dataclass_fields__)
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TrainingConfigError(
                f"ZeroStrategy got unknown argument(s) {unknown}; ZeroConfig fields are {sorted(fields)} "
                "(raw DeepSpeed keys go in extra=)"
            )
        base = config or ZeroConfig()
        self.zero_config = ZeroConfig(**{**asdict(base), **overrides})
        ds_config = merge_deepspeed_config(self.zero_config, extra)
        self._user_keys = set(_plain(extra))
        super().__init__(config=ds_config, timeout=timedelta(seconds=self.zero_config.timeout_s), **lightning_kwargs)

    # ------------------------------------------------------------------ CPU support (the three refusals)
    @property
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    def setup_environment(self) -> None:
        precision = getattr(self.precision_plugin, "precision", "32-true")
        if self._on_cpu:
            if precision in ("16-mixed", "16-true"):
                raise PrecisionError(
                    f"precision={precision!r} needs CUDA: fp16 with dynamic loss scaling is not supported on CPU. "
                    "Use precision='bf16-mixed' (or '32-true') on CPU."
                )
            _use_deepspeed_cpu_accelerator()
            DDPStrategy.setup_environment(self)  # skip DeepSpeedStrategy's CUDA-only check (refusal 1)
            return
        if not isinstance(self.accelerator, CUDAAccelerator):
            raise StrategyError(f"ZeroStrategy runs on CPU or CUDA, not on {type(self.accelerator).__name__}")
        super().setup_environment()

    def setup_distributed(self) -> None:
        if not self._on_cpu:
            super().setup_distributed()
            return
        # CPU devices have no index: Lightning's device-index validation does not apply (refusal 2).
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def _device_rank(self) -> int:
        """DeepSpeed's `device_rank`: the CUDA index, or the local rank on CPU (root_device.index is None there)."""
        index = self.root_device.index
        return self.local_rank if index is None else index  # refusal 3

    def _setup_model_and_optimizer(
        self, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model: torch.nn.Module) -> None:
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        assert isinstance(self.config, dict)
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                config[key] = self.config[key]
        if self.zero_stage_3:
            config["zero_optimization"] = self.config["zero_optimization"]
            config["zero_allow_untested_optimizer"] = True
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank),
            config=config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )

    # ------------------------------------------------------------------ Trainer ↔ DeepSpeed conflicts
    def _format_config(self) -> None:
        assert isinstance(self.config, dict)
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            self._check_trainer_conflicts(module.trainer)
        super()._format_config()

    def _check_trainer_conflicts(self, trainer: Any) -> None:
        """Keys of `extra` that the Trainer also sets must agree with it; agreeing duplicates are dropped."""
        assert isinstance(self.config, dict)
        accumulate = trainer.accumulate_grad_batches
        if "gradient_accumulation_steps" in self._user_keys and "gradient_accumulation_steps" in self.config:
            ours = self.config["gradient_accumulation_steps"]
            if ours != accumulate:
                raise TrainingConfigError(
                    f"DeepSpeed config key 'gradient_accumulation_steps'={ours} conflicts with "
                    f"Trainer(accumulate_grad_batches={accumulate}); set it in one place"
                )
            del self.config["gradient_accumulation_steps"]
        clip = trainer.gradient_clip_val
        if "gradient_clipping" in self._user_keys and clip is not None:
            ours = self.config.get("gradient_clipping")
            if ours != clip:
                raise TrainingConfigError(
                    f"DeepSpeed config key 'gradient_clipping'={ours} conflicts with "
                    f"Trainer(gradient_clip_val={clip}); set it in one place"
                )
        precision = getattr(self.precision_plugin, "precision", "32-true")
        wants = {"fp16": precision in ("16-mixed", "16-true"), "bf16": precision in ("bf16-mixed", "bf16-true")}
        for key, wanted in wants.items():
            section = self.config.get(key)
            enabled = isinstance(section, Mapping) and bool(section.get("enabled", False))
            if key in self._user_keys and enabled != wanted:
                raise TrainingConfigError(
                    f"DeepSpeed config key '{key}.enabled'={enabled} conflicts with Trainer(precision={precision!r})"
                )

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        path = Path(self.broadcast(str(filepath)))
        super().save_checkpoint(checkpoint, path, storage_options)
        self.barrier("tandem_checkpoint_saved")
        if self.is_global_zero:
            write_manifest(path)
        self.barrier("tandem_manifest_written")


def _use_deepspeed_cpu_accelerator() -> None:
    """DeepSpeed picks its accelerator once per process; on a CUDA machine training on CPU, choose the CPU one."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
