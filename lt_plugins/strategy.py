"""ZeroStrategy: DeepSpeed ZeRO stages 0-3 for any LightningModule, on CUDA (nccl) and on CPU (gloo).

Contract:
- `ZeroStrategy(stage=3)` or `ZeroStrategy(ZeroConfig(...), extra={...})`, or by name:
  `Trainer(strategy="tandem_zero_stage_3")` (the names are `lt_plugins.STRATEGY_NAMES`, registered with Lightning
  when this module is imported, or by `lt_plugins.register_strategies()`). DeepSpeed does the sharding; this class
  only builds its config from a typed `ZeroConfig` and lifts the three places where Lightning's DeepSpeedStrategy
  refuses the CPU: the CUDA-only accelerator check, the device-index validation and `device_rank=None`.
- DeepSpeedStrategy's argument names are accepted where ZeroConfig has the field: `offload_parameters`
  (offload_params), `allgather_bucket_size` / `reduce_bucket_size` (bucket_size), `timeout` (timeout_s),
  `zero_optimization=False` (stage 0), `offload_*_device="cpu"`; Lightning's own (`precision_plugin`, `loss_scale`,
  ...) pass through. One without a typed equivalent is an error naming it and the `extra=` key to set instead.
- `config=` may also be a DeepSpeed config dict or JSON path, as for DeepSpeedStrategy: its zero_optimization
  section sets ZeroConfig's fields (read as DeepSpeed reads it: no section means stage 0) and it is merged onto the
  generated config like `extra`.
- `extra` (a dict or an OmegaConf DictConfig) is merged into the generated DeepSpeed config. It may add keys; a key
  that the typed config owns (`zero_optimization.stage`, the offload devices) with a different value is an error
  naming both. So is a key that the Trainer owns (`gradient_accumulation_steps` vs `accumulate_grad_batches`,
  `gradient_clipping` vs `gradient_clip_val`, `fp16`/`bf16` vs `precision`) set to a different value.
- Both are validated when the strategy is built: a top-level key DeepSpeed does not read (`DEEPSPEED_TOP_LEVEL_KEYS`;
  DeepSpeed itself ignores those) and an unknown or invalid key inside a section (DeepSpeed's own config models) are
  one-line `TrainingConfigError`s naming the key.
- Offload works with the optimizer the LightningModule returns: with `offload_optimizer` the generated config sets
  `zero_force_ds_cpu_optimizer: false`, so DeepSpeed steps a torch optimizer on the CPU copies of its partitions
  instead of refusing it; `deepspeed.ops.adam.DeepSpeedCPUAdam` from configure_optimizers is the faster choice.
  Offload at stage 0 and parameter offload below stage 3 are refused when the config is built, in one line.
- `16-mixed` on CPU is refused at setup with a `PrecisionError`. fp32 master weights and optimizer state are kept
  by DeepSpeed in every mixed mode.
- Checkpoints are DeepSpeed's sharded directories; after every save, rank 0 writes `tandem_manifest.json` (files,
  sizes, SHA-256) so that export can tell a complete checkpoint from a partial or corrupt one. A save that fails
  for lack of space (or a read-only file system, a file size limit, no permission) is one `WriteError` line naming
  the reason and the folder, instead of torch's zip-writer trace ("unexpected pos 6272 vs 6164"); rank 0 removes
  the partial directory (it has no manifest, so resume and export never used it) and the line names the last
  complete checkpoint.
- Before DeepSpeed builds any op, build locks left by a process killed mid-build are removed
  (`lt_plugins.op_builds`): torch's builder would wait on them for ever.
- The process group the strategy starts (`setup_distributed`, when none was running) lives as long as the process
  (Lightning reuses it across fit/validate/test) and is ended at process exit, by an `atexit` handler, while the
  interpreter is still whole: DeepSpeed's `destroy_process_group` (torch's, and DeepSpeed's own references to its
  groups), then a garbage collection of what still refers to it (ZeRO-3 parameters do), which joins the backend's
  threads (gloo's work and transport loops). Left running into interpreter finalization, those threads can abort
  the process after a run that succeeded ("terminate called without an active exception", exit -6). No barrier is
  made at exit: ending a group is local, and a barrier would hold a rank whose peer failed until the timeout.
- A single process on CPU starts DeepSpeed's communication backend without its shared-memory allreduce op
  (`_without_shm_allreduce`): DeepSpeed would build that C++ op (about 40 s in a new environment) to reduce across
  processes that a one-process run does not have. Two or more processes keep it.
- Nothing here knows about shared_model.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy

from lt_plugins.checkpoint_io import MANIFEST, latest_checkpoint, write_manifest
from lt_plugins.errors import PrecisionError, StrategyError, TrainingConfigError
from lt_plugins.op_builds import drop_stale_build_locks
from lt_plugins.write_errors import WriteError, write_problem
from lt_plugins.zero_config import (
    LIGHTNING_ARGS,
    ZeroConfig,
    fields_from_deepspeed,
    load_deepspeed_config,
    merge_deepspeed_config,
    plain_mapping,
    zero_fields,
)


@contextmanager
def _without_shm_allreduce() -> Iterator[None]:
    """DeepSpeed's communication backend on CPU JIT-builds its shared-memory allreduce (a C++ op, `deepspeed_shm_comm`)
    when it starts, rebuilt for every new environment since its build hash holds the sources' paths: about 40 s on 2
    cores, for a single process that never reduces across processes. Within this block DeepSpeed sees the op as
    unavailable and keeps torch.distributed's own collectives (gloo); its compatibility table is restored after."""
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    name = "deepspeed_shm_comm"  # ShareMemCommBuilder.NAME (deepspeed/ops/op_builder/cpu/comm.py)
    had, before = name in compatible, compatible.get(name)
    compatible[name] = False
    try:
        yield
    finally:
        if had:
            compatible[name] = before
        else:
            compatible.pop(name, None)


class ZeroStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO for any LightningModule, on CUDA and on CPU (gloo, several processes)."""

    strategy_name = "tandem_zero"

    def __init__(
        self,
        config: ZeroConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        extra: Mapping[str, Any] | Any | None = None,
        **overrides: Any,
    ) -> None:
        """`config` is a ZeroConfig, or (as for DeepSpeedStrategy) a DeepSpeed config dict or JSON path, whose
        zero_optimization section sets ZeroConfig's fields; keyword arguments override ZeroConfig's fields
        (`ZeroStrategy(stage=3)`, DeepSpeedStrategy's names too: `offload_parameters`, `allgather_bucket_size`,
        `reduce_bucket_size`, `timeout`, ...); `extra` adds raw DeepSpeed keys. Lightning's own arguments
        (accelerator, parallel_devices, cluster_environment, process_group_backend, precision_plugin, ...) pass
        through. Unknown arguments and unknown DeepSpeed keys are errors naming them."""
        lightning_kwargs = {k: overrides.pop(k) for k in list(overrides) if k in LIGHTNING_ARGS}
        fields = zero_fields(overrides)
        given: dict[str, Any] | None = None
        label = "ZeroStrategy config"
        if config is None or isinstance(config, ZeroConfig):
            base = asdict(config or ZeroConfig())
        else:
            given, label = load_deepspeed_config(config)
            from_config = fields_from_deepspeed(given, label)
            for name in sorted(set(from_config) & set(fields)):
                if from_config[name] != fields[name]:
                    raise TrainingConfigError(
                        f"ZeroStrategy got {name}={fields[name]!r} but its DeepSpeed config ({label}) sets "
                        f"{name}={from_config[name]!r}; set it in one place"
                    )
            base = {**asdict(ZeroConfig()), **from_config}
        self.zero_config = ZeroConfig(**{**base, **fields})
        ds_config = merge_deepspeed_config(self.zero_config, extra, deepspeed_config=given, deepspeed_label=label)
        self._user_keys = set(plain_mapping(extra)) | set(given or {})
        super().__init__(config=ds_config, timeout=timedelta(seconds=self.zero_config.timeout_s), **lightning_kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Lightning's convention (DeepSpeedStrategy.register_strategies): add this class's names,
        `lt_plugins.STRATEGY_NAMES` (done when this module is imported)."""
        from lt_plugins import register_strategies

        register_strategies(strategy_registry, cls, override=True)

    # ------------------------------------------------------------------ CPU support (the three refusals)
    @property
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    def setup_environment(self) -> None:
        drop_stale_build_locks()  # before DeepSpeed builds its ops: a dead builder's lock would hang it
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
        starts_group = not torch.distributed.is_initialized()
        if self._on_cpu:
            # CPU devices have no index: Lightning's device-index validation does not apply (refusal 2).
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            if self.world_size == 1:
                with _without_shm_allreduce():
                    self._init_deepspeed_distributed()
            else:
                self._init_deepspeed_distributed()
        else:
            super().setup_distributed()
        if starts_group and torch.distributed.is_initialized():
            atexit.unregister(end_process_group)  # once per process, however many strategies start one
            atexit.register(end_process_group)

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
        try:
            super().save_checkpoint(checkpoint, path, storage_options)
            self.barrier("tandem_checkpoint_saved")
            if self.is_global_zero:
                write_manifest(path)
        except Exception as exc:
            problem = write_problem(exc, path.parent)
            if problem is None:
                raise
            raise WriteError(self._failed_save(path, problem)) from exc
        self.barrier("tandem_manifest_written")

    def _failed_save(self, path: Path, problem: str) -> str:
        """The one line of a checkpoint save that hit `problem`; rank 0 removes the partial directory."""
        removed = ""
        if self.is_global_zero and path.is_dir() and not (path / MANIFEST).is_file():
            shutil.rmtree(path, ignore_errors=True)
            removed = f"; the partial {path.name} was removed"
        last = latest_checkpoint(path.parent)
        kept = f"the last complete checkpoint is {last.name}" if last is not None else "no complete checkpoint exists"
        return f"checkpoint {path.name} not saved: {problem}{removed}; {kept}"


def end_process_group() -> None:
    """Destroy the default process group and every group DeepSpeed made, then collect the objects that still refer
    to them, so that the backend's threads are joined now (registered at exit by `setup_distributed`; a no-op when
    no group runs)."""
    if not torch.distributed.is_initialized():
        return
    import deepspeed.comm as ds_comm

    if getattr(ds_comm, "cdb", None) is not None:
        ds_comm.destroy_process_group()  # torch's, and DeepSpeed's references to its groups
    else:
        torch.distributed.destroy_process_group()
    gc.collect()  # ZeRO-3 parameters hold their group (ds_process_group): its threads are joined when it is freed


def _use_deepspeed_cpu_accelerator() -> None:
    """DeepSpeed picks its accelerator once per process; on a CUDA machine training on CPU, choose the CPU one."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


ZeroStrategy.register_strategies(StrategyRegistry)  # the names, explicitly, now that the class exists
