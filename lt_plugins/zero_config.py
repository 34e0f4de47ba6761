"""The ZeRO settings of a training run, typed and validated, and their DeepSpeed config; no Lightning.

Contract:
- `ZeroConfig` is the typed form of `strategy.*` (stage, offload, buckets, timeout, ...): frozen, every field checked
  at construction (`TrainingConfigError` naming it); `to_deepspeed()` is the DeepSpeed config it stands for.
- `merge_deepspeed_config(zero, extra)` overlays a user's DeepSpeed config (`strategy.extra`, a dict or a JSON file)
  on it: top-level keys DeepSpeed does not know, sections that contradict the typed fields, and keys the
  strategy owns are refused naming the key (`DEEPSPEED_TOP_LEVEL_KEYS`, `check_sections`).
- `zero_fields(arguments)` maps DeepSpeedStrategy's argument names onto `ZeroConfig` fields (`LIGHTNING_ARGS` are
  Lightning's own, passed through), for `lt_plugins.strategy.ZeroStrategy`.
- Loading a YAML training config (`lt_plugins.config`) imports this module, not the strategy: Lightning's DeepSpeed
  strategy loads when a strategy is built (DeepSpeed's config classes are read to check `strategy.extra` keys).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from lt_plugins.errors import TrainingConfigError, one_line


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
            raise TrainingConfigError(
                f"strategy.offload_params=true with strategy.stage={self.stage}: only stage 3 partitions (and can "
                "offload) parameters; use strategy.stage=3, or strategy.offload_optimizer=true alone at stage 1-2"
            )
        if self.offload_optimizer and self.stage == 0:
            raise TrainingConfigError(
                "strategy.offload_optimizer=true with strategy.stage=0: stage 0 keeps no partitioned optimizer state "
                "to offload; use strategy.stage >= 1"
            )
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
        out: dict[str, Any] = {"zero_optimization": zero, "zero_allow_untested_optimizer": True}
        if self.offload_optimizer:
            # DeepSpeed refuses a client optimizer under ZeRO-Offload unless it is its own DeepSpeedCPUAdam/Lion
            # ("You are using ZeRO-Offload with a client provided optimizer"), but a LightningModule always
            # brings its own from configure_optimizers. With this switch off DeepSpeed steps that optimizer on the
            # CPU copies of the fp32 partitions; returning deepspeed.ops.adam.DeepSpeedCPUAdam there is the
            # faster choice where its C++ op builds (docs/training.md, "Offload").
            out["zero_force_ds_cpu_optimizer"] = False
        return out


# Keys of the generated config that the typed ZeroConfig owns: extra may repeat them, never change them.
_OWNED = {
    ("zero_optimization", "stage"): "stage",
    ("zero_optimization", "offload_optimizer", "device"): "offload_optimizer",
    ("zero_optimization", "offload_param", "device"): "offload_params",
}

DEEPSPEED_TOP_LEVEL_KEYS = frozenset(
    {
        # deepspeed/runtime/config.py (DeepSpeedConfig._initialize_params and the section parsers it calls) and
        # deepspeed/runtime/constants.py, DeepSpeed 0.19; the removed ones (amp, nebula, elasticity, ...) are not here.
        "activation_checkpointing",
        "aio",
        "autotuning",
        "bf16",
        "bfloat16",
        "checkpoint",
        "comet",
        "comms_logger",
        "communication_data_type",
        "compile",
        "csv_monitor",
        "data_efficiency",
        "data_types",
        "dataloader_drop_last",
        "datastates_ckpt",
        "disable_allgather",
        "disable_python_gc",
        "dump_state",
        "expert_parallel",
        "flops_profiler",
        "fp16",
        "gradient_accumulation_steps",
        "gradient_allreduce_op",
        "gradient_clipping",
        "gradient_predivide_factor",
        "hybrid_engine",
        "log_level",
        "managed_gradient_accumulation",
        "memory_breakdown",
        "optimizer",
        "pipeline",
        "prescale_gradients",
        "scheduler",
        "seq_parallel_communication_data_type",
        "steps_per_print",
        "tensor_parallel",
        "tensorboard",
        "timers",
        "torch_autocast",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "use_data_before_expert_parallelism",
        "vocabulary_size",
        "wall_clock_breakdown",
        "wandb",
        "weight_quantization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "zero_optimization",
        # read by deepspeed.initialize (deepspeed/__init__.py) for sequence / data parallel meshes
        "data_parallel_size",
        "sequence_parallel_size",
    }
)
"""The top-level keys DeepSpeed reads. DeepSpeed ignores any other top-level key (its section models reject unknown
keys, its top level does not), so ZeroStrategy refuses them itself."""

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def plain_mapping(extra: Mapping[str, Any] | Any | None, label: str = "strategy.extra") -> dict[str, Any]:
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
        raise TrainingConfigError(f"{label} must be a mapping, got {type(extra).__name__}")
    return copy.deepcopy(dict(extra))


def load_deepspeed_config(config: Mapping[str, Any] | Any | str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """A DeepSpeed config given as a dict (or DictConfig) or as the path of a JSON file → (dict, how to name it)."""
    if not isinstance(config, (str, os.PathLike)):
        return plain_mapping(config, "ZeroStrategy config"), "ZeroStrategy config"
    path = Path(config)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TrainingConfigError(f"ZeroStrategy config: no such DeepSpeed config file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainingConfigError(f"ZeroStrategy config: cannot read {path}: {one_line(exc)}") from None
    except json.JSONDecodeError as exc:
        raise TrainingConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TrainingConfigError(f"{path}: a DeepSpeed config must be a JSON object, got {type(data).__name__}")
    return data, str(path)


def check_top_level_keys(ds_config: Mapping[str, Any], label: str = "strategy.extra") -> None:
    """Refuse a top-level key DeepSpeed does not know (it would be ignored silently), naming it."""
    for key in ds_config:
        if key not in DEEPSPEED_TOP_LEVEL_KEYS:
            close = difflib.get_close_matches(str(key), DEEPSPEED_TOP_LEVEL_KEYS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else " (see https://www.deepspeed.ai/docs/config-json/)"
            raise TrainingConfigError(f"{label}: unknown DeepSpeed config key '{key}'{hint}")


def _paths(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, Mapping):
        for key, value in node.items():
            out += _paths(value, (*prefix, str(key)))
    return out


def _find_path(root: Mapping[str, Any], tail: tuple[str, ...]) -> tuple[str, ...]:
    """The full path of a key that DeepSpeed's section model names relative to its section."""
    found = [p for p in _paths(root) if p[-len(tail) :] == tail] if tail else []
    return found[0] if len(found) == 1 else tail


def check_sections(ds_config: Mapping[str, Any], sources: list[tuple[str, Mapping[str, Any]]]) -> None:
    """Run DeepSpeed's own config parser over `ds_config` (its section models reject unknown keys and bad values) and
    turn its errors into one-line TrainingConfigErrors naming the key and where it came from (`sources`)."""
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from pydantic import ValidationError

    # The batch keys are filled in at setup (Lightning: micro batch from the dataloader, accumulation from the
    # Trainer) and checked against the world size there; here only a placeholder that satisfies the parser.
    probe = {k: v for k, v in copy.deepcopy(dict(ds_config)).items() if k not in _BATCH_KEYS}
    probe["train_micro_batch_size_per_gpu"] = 1

    def where(path: tuple[str, ...]) -> str:
        for label, source in sources:
            node: Any = source
            for key in path:
                node = node.get(key) if isinstance(node, Mapping) else None
            if node is not None:
                return label
        return "DeepSpeed config"

    try:
        DeepSpeedConfig(probe)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = _find_path(probe, tuple(str(part) for part in error["loc"]))
        dotted = ".".join(path)
        if error["type"] == "extra_forbidden":
            raise TrainingConfigError(
                f"{where(path)}: unknown DeepSpeed config key '{dotted}' ({exc.title} has no such field)"
            ) from None
        raise TrainingConfigError(
            f"{where(path)}: DeepSpeed config key '{dotted}': {error['msg']} (got {error.get('input')!r})"
        ) from None
    except (DeepSpeedConfigError, ValueError, AssertionError, TypeError, KeyError) as exc:
        raise TrainingConfigError(f"DeepSpeed refuses the config: {one_line(exc)}") from None


def merge_deepspeed_config(
    config: ZeroConfig,
    extra: Mapping[str, Any] | Any | None = None,
    *,
    deepspeed_config: Mapping[str, Any] | None = None,
    deepspeed_label: str = "ZeroStrategy config",
) -> dict[str, Any]:
    """Typed config + a DeepSpeed config (ZeroStrategy's `config=`) + extra keys → one DeepSpeed dict, validated:
    an unknown key (top level, or inside a section DeepSpeed checks) and a changed owned key are errors naming it."""
    base = config.to_deepspeed()
    extra_dict = plain_mapping(extra)
    given = copy.deepcopy(dict(deepspeed_config or {}))
    check_top_level_keys(given, deepspeed_label)
    check_top_level_keys(extra_dict, "strategy.extra")
    user = _deep_merge(given, extra_dict)
    for path, field_name in _OWNED.items():
        node: Any = user
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        if node is None:
            continue
        ours: Any = base
        for key in path:
            ours = ours.get(key) if isinstance(ours, Mapping) else None
        if node != ours and not (path[-1] == "device" and node == "none" and ours is None):
            raise TrainingConfigError(
                f"DeepSpeed config key '{'.'.join(path)}'={node!r} conflicts with strategy.{field_name}="
                f"{getattr(config, field_name)!r}; set it in one place"
            )
    merged = _deep_merge(base, user)
    check_sections(merged, [("strategy.extra", extra_dict), (deepspeed_label, given)])
    return merged


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def fields_from_deepspeed(ds_config: Mapping[str, Any], label: str) -> dict[str, Any]:
    """The ZeroConfig fields a DeepSpeed config sets, read as DeepSpeed reads it (no zero_optimization: stage 0)."""
    zero = ds_config.get("zero_optimization", {})
    if not isinstance(zero, Mapping):
        raise TrainingConfigError(f"{label}: 'zero_optimization' must be an object, got {type(zero).__name__}")
    out: dict[str, Any] = {"stage": zero.get("stage", 0)}
    pins = []
    for key, field_name in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
        section = zero.get(key)
        if not isinstance(section, Mapping):
            continue
        device = section.get("device", "none")
        if device not in ("none", "cpu"):
            raise TrainingConfigError(
                f"{label}: zero_optimization.{key}.device={device!r} is not supported: ZeroStrategy offloads to CPU "
                "memory only ('cpu' or 'none')"
            )
        out[field_name] = device == "cpu"
        if "pin_memory" in section:
            pins.append(bool(section["pin_memory"]))
    if pins and len(set(pins)) == 1:
        out["pin_memory"] = pins[0]
    if "overlap_comm" in zero:
        out["overlap_comm"] = bool(zero["overlap_comm"])
    if "allgather_bucket_size" in zero and zero.get("reduce_bucket_size") == zero["allgather_bucket_size"]:
        out["bucket_size"] = int(zero["allgather_bucket_size"])  # ZeroConfig has one size for both
    if "stage3_param_persistence_threshold" in zero:
        out["param_persistence_threshold"] = int(zero["stage3_param_persistence_threshold"])
    return out


# ------------------------------------------------------------------ ZeroStrategy's arguments
_FIELDS = tuple(ZeroConfig.__dataclass_fields__)

LIGHTNING_ARGS = frozenset(
    {
        "accelerator",
        "parallel_devices",
        "cluster_environment",
        "process_group_backend",
        "precision_plugin",
        "logging_level",
        "remote_device",
        "load_full_weights",
        "exclude_frozen_parameters",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "min_loss_scale",
    }
)
"""DeepSpeedStrategy arguments that Lightning itself uses (not part of the DeepSpeed config): passed through."""

_ALIASES = {
    "offload_parameters": "offload_params",
    "allgather_bucket_size": "bucket_size",
    "reduce_bucket_size": "bucket_size",
}
"""DeepSpeedStrategy's names for ZeroConfig's fields (`stage`, `offload_optimizer`, `pin_memory`, `overlap_comm` are
spelt the same; `timeout`, `zero_optimization`, `config` and the offload devices are handled on their own)."""

_RAW_KEYS: dict[str, tuple[tuple[str, ...], Any]] = {
    "contiguous_gradients": (("zero_optimization", "contiguous_gradients"), True),
    "allgather_partitions": (("zero_optimization", "allgather_partitions"), None),
    "reduce_scatter": (("zero_optimization", "reduce_scatter"), None),
    "sub_group_size": (("zero_optimization", "sub_group_size"), None),
    "zero_allow_untested_optimizer": (("zero_allow_untested_optimizer",), True),
    "logging_batch_size_per_gpu": (("train_micro_batch_size_per_gpu",), "auto"),
    "partition_activations": (("activation_checkpointing", "partition_activations"), None),
    "cpu_checkpointing": (("activation_checkpointing", "cpu_checkpointing"), None),
    "contiguous_memory_optimization": (("activation_checkpointing", "contiguous_memory_optimization"), None),
    "synchronize_checkpoint_boundary": (("activation_checkpointing", "synchronize_checkpoint_boundary"), None),
}
"""DeepSpeedStrategy arguments with no ZeroConfig field: the DeepSpeed key to set through `extra=` instead, and the
value ZeroStrategy already uses (that value is accepted as is)."""

_NVME_ARGS = frozenset(
    {
        "nvme_path",
        "params_buffer_count",
        "params_buffer_size",
        "max_in_cpu",
        "optimizer_buffer_count",
        "block_size",
        "queue_depth",
        "single_submit",
        "overlap_events",
        "thread_count",
    }
)
"""DeepSpeedStrategy's NVMe-offload arguments: ZeroStrategy offloads to CPU memory only."""


def _nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out: Any = value
    for key in reversed(path):
        out = {key: out}
    return out


def zero_fields(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """ZeroStrategy's keyword arguments (ZeroConfig fields and DeepSpeedStrategy's names) → ZeroConfig fields."""
    given: dict[str, tuple[str, Any]] = {}  # field → (argument as written, value)

    def put(field_name: str, written: str, value: Any) -> None:
        if field_name in given and given[field_name][1] != value:
            raise TrainingConfigError(
                f"ZeroStrategy got {given[field_name][0]} and {written}, which both set ZeroConfig.{field_name}; "
                "give one"
            )
        given[field_name] = (written, value)

    unknown = []
    for name, value in arguments.items():
        if name in _FIELDS:
            put(name, f"{name}={value!r}", value)
        elif name in _ALIASES:
            put(_ALIASES[name], f"{name}={value!r}", value)
        elif name == "timeout":
            seconds = value.total_seconds() if isinstance(value, timedelta) else value
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
                raise TrainingConfigError(f"ZeroStrategy timeout must be a timedelta or seconds, got {value!r}")
            put("timeout_s", f"timeout={value!r}", int(seconds))
        elif name == "zero_optimization":
            if not value:  # DeepSpeedStrategy(zero_optimization=False): no ZeRO section, i.e. DeepSpeed's stage 0
                put("stage", "zero_optimization=False", 0)
        elif name in ("offload_optimizer_device", "offload_params_device"):
            if value != "cpu":
                raise TrainingConfigError(
                    f"ZeroStrategy {name}={value!r} is not supported: ZeroStrategy offloads to CPU memory only "
                    "(offload_optimizer=True, offload_params=True)"
                )
        elif name in _RAW_KEYS:
            path, ours = _RAW_KEYS[name]
            if value != ours:
                raise TrainingConfigError(
                    f"ZeroStrategy has no argument {name!r} (a DeepSpeedStrategy argument without a ZeroConfig "
                    f"field); set the DeepSpeed key instead: extra={_nested(path, value)!r}"
                )
        elif name in _NVME_ARGS:
            raise TrainingConfigError(
                f"ZeroStrategy has no argument {name!r}: it configures DeepSpeedStrategy's NVMe offload, which "
                "ZeroStrategy does not support (it offloads to CPU memory: offload_optimizer=True, offload_params=True)"
            )
        else:
            unknown.append(name)
    if unknown:
        known = [*_FIELDS, *_ALIASES, "timeout", "zero_optimization", "config", "extra", *sorted(LIGHTNING_ARGS)]
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TrainingConfigError(
            f"ZeroStrategy got unknown argument(s) {sorted(unknown)}{hint}; ZeroConfig fields are {sorted(_FIELDS)}, "
            f"DeepSpeedStrategy's names {sorted(_ALIASES)} are accepted for them, and raw DeepSpeed keys go in extra="
        )
    return {field_name: value for field_name, (_, value) in given.items()}
