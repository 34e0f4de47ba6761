"""The training config: an OmegaConf structured schema made of small dataclasses, one per section.

Contract:
- `load_config(path, overrides)` merges a YAML file and `a.b=c` dotlist overrides onto the schema. An unknown key,
  a wrong type or an invalid value raises `TrainingConfigError` naming the full key (`trainer.devices`); nothing
  is silently ignored.
- The result is a `TrainConfig` of plain dataclasses; `to_yaml(cfg)` writes the fully resolved config.
- Sections are independent dataclasses so later work can add one (e.g. `checkpointing` for activation
  recomputation, `ledger`) by adding a field to `TrainConfig` without touching the others.
- Config once: the `strategy` and `checkpointing` sections are derived from `ZeroConfig` (lt_plugins/strategy.py)
  and `CheckpointingConfig` (lt_plugins/checkpointing.py). `section_fields(source)` generates a mutable base with
  every init field of the frozen dataclass, its default and its docstring (tuples as lists, as OmegaConf spells
  them); a section subclasses it, adds its own keys (`strategy.name`, `strategy.extra`) and may re-declare a field
  to widen it (`checkpointing.mode` also takes `auto`). A field added to a dataclass is a YAML key at once, with
  its docs. `build_from_section` turns a section back into its dataclass, whose `__post_init__` validates it.
- `model.init_from` (a Hugging Face folder), `model.class_path`/`model.init_args` (your own LightningModule) and
  their conflicts with other keys are checked here, naming both keys.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import math
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lt_plugins.autocast import check_autocast
from lt_plugins.checkpointing import MODES, CheckpointingConfig
from lt_plugins.errors import TrainingConfigError
from lt_plugins.ledger_callback import LedgerSection
from lt_plugins.lora import LoraConfig
from lt_plugins.precision import SUPPORTED_PRECISIONS
from lt_plugins.zero_config import ZeroConfig, merge_deepspeed_config

FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32: optimizer step sizes beyond it cannot be applied to the weights."""


def _positive(section: str, obj: Any, *names: str) -> None:
    """Each named field is None or a finite number > 0 (NaN and inf pass a bare `<= 0` test, so check them first)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise TrainingConfigError(f"{section}.{name} must be a finite number > 0, got {value}")


def _in_range(key: str, value: float, low: float, high: float, *, high_open: bool = False) -> None:
    """`value` is finite and in [low, high] (or [low, high) with `high_open`); the message names `key`."""
    inside = math.isfinite(value) and low <= value and (value < high if high_open else value <= high)
    if not inside:
        interval = f"[{low}, {high})" if high_open else f"[{low}, {high}]"
        raise TrainingConfigError(f"{key} must be a finite number in {interval}, got {value}")


def _default_of(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _yaml_value(value: Any) -> Any:
    """A dataclass value as OmegaConf spells it: tuples become lists."""
    return list(value) if isinstance(value, tuple) else value


def _yaml_hint(hint: Any) -> Any:
    """A dataclass field type as OmegaConf takes it: tuple[X, ...] becomes list[X]."""
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        return list[args[0]] if len(args) == 2 and args[1] is Ellipsis else list[Any]  # type: ignore[valid-type]
    return hint


def section_fields(source: type, name: str) -> type:
    """A mutable dataclass `name` declaring every init field of the dataclass `source`: the same names, defaults
    and docstrings (read by the docs generator through `__field_docs_from__`), tuples as lists."""
    hints = typing.get_type_hints(source)
    specs: list[tuple[str, Any, Any]] = []
    for f in fields(source):
        if not f.init:
            continue
        default = _yaml_value(_default_of(f))
        if isinstance(default, (list, dict, set)):  # a fresh copy per instance, as dataclasses require
            spec = field(default_factory=functools.partial(copy.deepcopy, default))
        else:
            spec = field(default=default)
        specs.append((f.name, _yaml_hint(hints[f.name]), spec))
    base = make_dataclass(name, specs, namespace={"__module__": __name__, "__field_docs_from__": source})
    base.__doc__ = f"The fields of {source.__name__}, as a YAML section declares them."
    return base


def build_from_section(source: type, section: Any) -> Any:
    """The `source` dataclass from the section's fields of the same names (lists become tuples)."""
    values = {f.name: getattr(section, f.name) for f in fields(source) if f.init}
    return source(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


ZeroFields = section_fields(ZeroConfig, "ZeroFields")
CheckpointingFields = section_fields(CheckpointingConfig, "CheckpointingFields")
LoraFields = section_fields(LoraConfig, "LoraFields")


INJECTED_ARGS = ("vocab_size", "optim")
"""Constructor arguments of a `model.class_path` module that `tandem train` fills when the constructor declares
them and `model.init_args` does not set them: `vocab_size` (ids the tokenizer emits), `optim` (the OptimSection)."""


@dataclass
class ModelSection:
    """Which decoder to train: a preset from scratch, a Hugging Face folder to fine-tune, or your own module."""

    preset: str = "tiny"
    """A shared_model preset name (`tiny`, `small`, …); ignored when model.init_from is set."""
    seed: int = 0
    """Seed of the weight initialisation (from scratch only)."""
    init_from: str | None = None
    """A Llama/Qwen2/Qwen3 Hugging Face folder (config.json, safetensors, tokenizer.json) to start from: its config
    and tokenizer are used (no tokenizer training) and its weights are loaded shard by shard in configure_model."""
    class_path: str | None = None
    """Your own LightningModule, `package.module.ClassName` (as LightningCLI spells it); None: LitCausalLM."""
    init_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of class_path's constructor (vocab_size and optim are filled in when it declares them)."""
    loss_chunk_tokens: int = 0
    """The built-in LitCausalLM's training loss in chunks of this many tokens (0: unchunked): the LM head and the
    cross-entropy never hold the [tokens, vocab] logits whole, and each chunk's gradients are formed while it is in
    cache (lt_plugins/lm_loss.py). Not with class_path (your module computes its own loss)."""

    def __post_init__(self) -> None:
        from shared_model.config import PRESETS

        if self.preset not in PRESETS:
            raise TrainingConfigError(f"model.preset={self.preset!r} is unknown; choose one of {sorted(PRESETS)}")
        if isinstance(self.loss_chunk_tokens, bool) or not isinstance(self.loss_chunk_tokens, int):
            raise TrainingConfigError(f"model.loss_chunk_tokens must be an integer, got {self.loss_chunk_tokens!r}")
        if self.loss_chunk_tokens < 0:
            raise TrainingConfigError(
                f"model.loss_chunk_tokens must be 0 (unchunked) or more, got {self.loss_chunk_tokens}"
            )
        if self.loss_chunk_tokens and self.class_path is not None:
            raise TrainingConfigError(
                f"model.loss_chunk_tokens={self.loss_chunk_tokens} sets the built-in LitCausalLM's loss; "
                f"model.class_path={self.class_path!r} computes its own"
            )
        if self.init_from is not None and not (Path(self.init_from) / "config.json").is_file():
            what = "has no config.json" if Path(self.init_from).is_dir() else "is not a folder"
            raise TrainingConfigError(f"model.init_from={self.init_from!r} {what} (a Hugging Face model folder)")
        if self.class_path is None:
            if self.init_args:
                raise TrainingConfigError(f"model.init_args={self.init_args} needs model.class_path (None given)")
            return
        if self.init_from is not None:
            raise TrainingConfigError(
                f"model.init_from={self.init_from!r} loads into the built-in LitCausalLM; it conflicts with "
                f"model.class_path={self.class_path!r} (load the folder in your module's configure_model instead)"
            )
        check_init_args(resolve_class(self.class_path), self.init_args)


def resolve_class(class_path: str) -> type:
    """`package.module.ClassName` → the class, which must subclass lightning's LightningModule."""
    import lightning.pytorch as pl

    module_name, _, name = class_path.rpartition(".")
    if not module_name:
        raise TrainingConfigError(f"model.class_path={class_path!r} must be 'package.module.ClassName'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError or whatever the user's module raises while importing
        raise TrainingConfigError(
            f"model.class_path={class_path!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})"
        ) from None
    cls = getattr(module, name, None)
    if cls is None:
        raise TrainingConfigError(f"model.class_path={class_path!r}: module {module_name!r} has no {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule)):
        raise TrainingConfigError(
            f"model.class_path={class_path!r} is not a LightningModule subclass (got {type(cls).__name__} {cls!r})"
        )
    return cls


def check_init_args(cls: type, init_args: dict[str, Any]) -> None:
    """`init_args` names only parameters of cls's constructor and, with the injected ones, covers the required."""
    params = dict(inspect.signature(cls.__init__).parameters)
    params.pop("self", None)
    open_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {k: p for k, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    unknown = sorted(set(init_args) - set(named))
    if unknown and not open_kwargs:
        raise TrainingConfigError(
            f"model.init_args.{unknown[0]}: {cls.__qualname__}.__init__ has no parameter {unknown[0]!r} "
            f"(it takes {sorted(named)})"
        )
    missing = [k for k, p in named.items() if p.default is p.empty and k not in init_args and k not in INJECTED_ARGS]
    if missing:
        raise TrainingConfigError(f"model.init_args: {cls.__qualname__}.__init__ needs {missing[0]!r}; set it there")


DATA_FORMATS = ("auto", "text", "jsonl")


@dataclass
class DataSection:
    """The corpus, its tokenizer and how it is packed into blocks."""

    include_stdlib: bool = True
    """Train on the interpreter's standard-library sources."""
    extra: list[str] = field(default_factory=list)
    """Your own files or glob patterns (`/data/**/*.txt`, `**` allowed): text files or JSONL (see data.format)."""
    format: str = "auto"
    """How data.extra files are read: text (a file is a document) | jsonl (a line is a document, its
    data.jsonl_field) | auto (jsonl for *.jsonl files, text otherwise)."""
    jsonl_field: str = "text"
    """The field of each JSONL line that holds the document's text."""
    val_fraction: float = 0.02
    """Share of documents held out for validation."""
    max_documents: int | None = None
    """Use only the first N documents (fast tests)."""
    tokenizer: str | None = None
    """Folder or tokenizer.json to load; None trains a byte-level BPE on the training split (cached in the run)."""
    vocab_size: int | None = None
    """Vocabulary of a trained tokenizer; None means the model's vocab_size."""
    block_size: int = 256
    """Tokens per training sequence."""
    batch_size: int = 8
    """Sequences per process per micro-batch."""
    seed: int = 0
    """Seed of the block shuffle."""

    def __post_init__(self) -> None:
        if self.format not in DATA_FORMATS:
            raise TrainingConfigError(f"data.format must be one of {', '.join(DATA_FORMATS)}, got {self.format!r}")
        if not self.jsonl_field:
            raise TrainingConfigError("data.jsonl_field must not be empty")
        _in_range("data.val_fraction", self.val_fraction, 0, 1, high_open=True)
        _positive("data", self, "max_documents", "vocab_size", "block_size", "batch_size")


@dataclass
class OptimSection:
    """AdamW with linear warm-up and cosine decay."""

    lr: float = 1e-3
    """Peak learning rate (finite, > 0, and lr/(1-beta1) within float32)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr, in [0, 1]."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms or biases); finite, >= 0, with lr·weight_decay <= 1."""
    beta1: float = 0.9
    """Adam beta1, in [0, 1)."""
    beta2: float = 0.95
    """Adam beta2, in [0, 1)."""

    def __post_init__(self) -> None:
        _positive("optim", self, "lr")
        _in_range("optim.min_lr_ratio", self.min_lr_ratio, 0, 1)
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise TrainingConfigError(f"optim.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        _in_range("optim.beta1", self.beta1, 0, 1, high_open=True)
        _in_range("optim.beta2", self.beta2, 0, 1, high_open=True)
        first_update = self.lr / (1 - self.beta1)  # AdamW's bias-corrected step size is largest at step 1
        if first_update > FLOAT32_MAX:
            raise TrainingConfigError(
                f"optim.lr={self.lr} is too large: AdamW's first step size lr/(1-optim.beta1)={first_update:.3g} "
                "overflows float32"
            )
        if self.lr * self.weight_decay > 1:  # AdamW scales the weights by 1 - lr·weight_decay every step
            raise TrainingConfigError(
                f"optim.weight_decay={self.weight_decay} is too large for optim.lr={self.lr}: lr·weight_decay must be "
                "<= 1 (AdamW multiplies the weights by 1 - lr·weight_decay each step)"
            )
        if self.warmup_steps < 0:
            raise TrainingConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass
class StrategySection(ZeroFields):
    """How the processes share the work: ZeroConfig's fields, plus `name` and `extra`. `zero` is ZeroStrategy;
    `ddp` is Lightning's own; `auto` is ZeroStrategy with the stage, offload (and, with checkpointing.mode=auto, the
    checkpointing mode) chosen by the memory planner."""

    name: str = "zero"
    """zero | ddp | auto (the planner's choice, logged with its reason: lt_plugins/auto_strategy.py)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Raw DeepSpeed config keys merged on top (conflicts with the fields above or the Trainer are errors)."""

    def __post_init__(self) -> None:
        if self.name not in ("zero", "ddp", "auto"):
            raise TrainingConfigError(f"strategy.name must be zero, ddp or auto, got {self.name!r}")
        merge_deepspeed_config(self.zero_config(), self.extra)  # validates the ZeRO fields and extra's conflicts

    def zero_config(self) -> ZeroConfig:
        return build_from_section(ZeroConfig, self)


@dataclass
class CheckpointingSection(CheckpointingFields):
    """The `checkpointing:` section (activation recomputation, not saved checkpoints): CheckpointingConfig's fields,
    with mode `auto` added."""

    mode: str = "none"
    """none | full | attention | ops, or auto (with strategy.name=auto: the planner chooses)."""

    def __post_init__(self) -> None:
        if self.mode not in (*MODES, "auto"):
            raise TrainingConfigError(f"checkpointing.mode must be one of {', '.join(MODES)}, auto; got {self.mode!r}")
        if self.mode != "auto":
            self.to_config()  # validates the other keys, naming them

    def to_config(self) -> CheckpointingConfig:
        return build_from_section(CheckpointingConfig, self)


@dataclass
class LoraSection(LoraFields):
    """The `lora:` section: LoraConfig's fields (lt_plugins/lora.py); with `enabled` only the adapters train."""

    def __post_init__(self) -> None:
        self.to_config()  # validates every key, naming it

    def to_config(self) -> LoraConfig:
        return build_from_section(LoraConfig, self)


@dataclass
class TrainerSection:
    """Arguments passed to lightning.Trainer."""

    accelerator: str = "cpu"
    """cpu | cuda | gpu | auto."""
    devices: int = 1
    """Processes per node."""
    num_nodes: int = 1
    """Nodes (multi-node through torchrun or SLURM; see docs/training.md)."""
    precision: str = "bf16-mixed"
    """bf16-mixed | 16-mixed (CUDA only) | 32-true."""
    autocast: str = "none"
    """none | bf16 | auto: with precision 32-true, run the matmuls in bf16 under torch.autocast over fp32 weights,
    gradients and optimizer state; auto: bf16 on a CPU with AMX-BF16 or AVX-512 BF16 or a CUDA device with bf16,
    else none (lt_plugins/autocast.py; the run's config.yaml records the choice)."""
    max_steps: int = 100
    """Optimizer steps to train."""
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step."""
    gradient_clip_val: float | None = 1.0
    """Clip the global gradient norm to this finite value >= 0 (None or 0: no clipping)."""
    val_check_interval: int = 50
    """Validate every N training batches."""
    limit_val_batches: int = 8
    """Validation batches per check."""
    log_every_n_steps: int = 10
    """Logging interval."""
    seed: int = 0
    """Global seed (seed_everything)."""
    enable_progress_bar: bool = True
    """Show the progress bar (loss, lr, tokens/s)."""

    def __post_init__(self) -> None:
        if self.accelerator not in ("cpu", "cuda", "gpu", "auto"):
            raise TrainingConfigError(f"trainer.accelerator must be cpu, cuda, gpu or auto, got {self.accelerator!r}")
        if self.precision not in SUPPORTED_PRECISIONS:
            raise TrainingConfigError(
                f"trainer.precision={self.precision!r} is not supported; choose one of {SUPPORTED_PRECISIONS}"
            )
        check_autocast(self.autocast, self.precision)
        _positive(
            "trainer",
            self,
            "devices",
            "num_nodes",
            "max_steps",
            "accumulate_grad_batches",
            "val_check_interval",
            "log_every_n_steps",
        )
        if self.limit_val_batches < 0:
            raise TrainingConfigError(f"trainer.limit_val_batches must be >= 0, got {self.limit_val_batches}")
        clip = self.gradient_clip_val
        if clip is not None and (not math.isfinite(clip) or clip < 0):
            raise TrainingConfigError(f"trainer.gradient_clip_val must be a finite number >= 0 or null, got {clip}")


@dataclass
class CheckpointsSection:
    """Sharded training checkpoints (saving and resuming; not activation checkpointing)."""

    every_n_steps: int = 50
    """Save a sharded checkpoint every N optimizer steps (and always at the end)."""
    keep_last: int = 2
    """Checkpoints kept on disk: the newest by step, counting those of earlier attempts (a resumed run's too); older
    ones and crashed partial saves are deleted."""
    resume: str | None = "auto"
    """auto: continue from the newest complete checkpoint of the run dir if any; a path; or None."""

    def __post_init__(self) -> None:
        _positive("checkpoints", self, "every_n_steps", "keep_last")


@dataclass
class ExportSection:
    """The bundle written when training ends."""

    enabled: bool = True
    """Export the final checkpoint to `<run_dir>/bundle`."""
    dtype: str = "bfloat16"
    """Weights dtype in the bundle: float32 | bfloat16 | float16."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise TrainingConfigError(f"export.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass
class LoggingSection:
    """Where metrics go."""

    csv: bool = True
    """CSV logger under <run_dir>/logs: metrics.csv, then metrics.attempt-N.csv for each resumed attempt."""
    tensorboard: bool = True
    """TensorBoard logger too, when tensorboard is installed."""


@dataclass
class TrainConfig:
    """One training run."""

    run_name: str = "run"
    """Prefix of the default run directory name."""
    run_dir: str | None = None
    """Output directory (checkpoints, logs, bundle); default ./runs/<run_name>-<timestamp>."""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    strategy: StrategySection = field(default_factory=StrategySection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    checkpoints: CheckpointsSection = field(default_factory=CheckpointsSection)
    export: ExportSection = field(default_factory=ExportSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    # the memory planner's levers: activation checkpointing and the memory ledger
    checkpointing: CheckpointingSection = field(default_factory=CheckpointingSection)
    ledger: LedgerSection = field(default_factory=LedgerSection)
    # low-rank adapters: only they train, the base stays frozen
    lora: LoraSection = field(default_factory=LoraSection)

    def __post_init__(self) -> None:
        if self.trainer.autocast != "none" and "torch_autocast" in self.strategy.extra:
            raise TrainingConfigError(
                f"trainer.autocast={self.trainer.autocast} and strategy.extra.torch_autocast both set autocast; "
                "set it in one place (trainer.autocast)"
            )
        if self.lora.enabled and self.strategy.name == "auto":
            raise TrainingConfigError(
                "lora.enabled=true conflicts with strategy.name=auto (the planner sizes full training; run `tandem "
                "plan --lora` and set strategy.stage)"
            )
        if self.lora.base_dtype != "model" and self.lora.enabled and self.strategy.stage == 3:
            raise TrainingConfigError(
                f"lora.base_dtype={self.lora.base_dtype} needs strategy.stage <= 2 (ZeRO-3 partitions keep the "
                "training dtype; trainer.precision=bf16-mixed holds the frozen base in bf16)"
            )
        init_from = self.model.init_from
        if init_from is None:
            return
        for key, value in (("data.tokenizer", self.data.tokenizer), ("data.vocab_size", self.data.vocab_size)):
            if value is not None:
                raise TrainingConfigError(
                    f"{key}={value!r} conflicts with model.init_from={init_from!r}, whose tokenizer is used; "
                    f"remove {key}"
                )
        if self.strategy.name == "auto":
            raise TrainingConfigError(
                f"strategy.name=auto plans for model.preset, not for model.init_from={init_from!r}; "
                "set strategy.name=zero and strategy.stage"
            )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Schema ← YAML file ← dotlist overrides, validated; errors name the key."""
    try:
        merged: DictConfig = OmegaConf.structured(TrainConfig)
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise TrainingConfigError(f"config file not found: {path}")
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise TrainingConfigError(f"overrides must look like key=value, got {bad}")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise TrainingConfigError(_describe(exc)) from None
    assert isinstance(cfg, TrainConfig)
    return cfg


def _describe(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    msg = str(exc).splitlines()[0]
    if type(exc).__name__ == "ConfigKeyError" and key:
        return f"unknown config key '{key}' ({msg})"
    return f"config key '{key}': {msg}" if key else msg


def to_yaml(cfg: TrainConfig) -> str:
    """The fully resolved config as YAML."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
