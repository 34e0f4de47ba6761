"""Activation checkpointing applied from outside a model: full, Megatron-style attention, and op-level selective.

Contract:
- `CheckpointingConfig` says what to recompute. `apply_checkpointing(module, config)` wraps the `forward` of the
  chosen submodules in place (no module is replaced, so parameter names and state dicts do not change) and returns
  the qualified names it wrapped; `remove_checkpointing(module)` undoes it. Applying twice re-applies, never nests.
- Blocks are chosen by class name (`block_classes`), by a regex on the qualified name (`name_regex`), or, when
  neither is given, as the children of the largest repeated stack (the `nn.ModuleList` with the most parameters
  whose children share one class). `every_n` keeps every n-th chosen block (1-based: blocks n, 2n, ...).
- Modes:
  - `none`: nothing is wrapped.
  - `full`: each chosen block is recomputed whole in backward; only its inputs are kept.
  - `attention`: inside each chosen block, the modules of class `attention_classes` (default `CoreAttention`:
    scores, softmax, weighted sum; no parameters) are recomputed; projections keep their saved activations.
  - `ops`: each chosen block runs under `torch.utils.checkpoint.create_selective_checkpoint_contexts`; outputs of
    the ops in `save_ops` (default: matmuls and fused attention) are kept, every other op is recomputed. A kept
    output that the forward later changes in place (`out += bias`) is kept as it was when saved, so the recompute
    repeats that change on the right value; ops issued by DeepSpeed's ZeRO-3 hooks are neither kept nor looked up.
- Non-reentrant checkpointing only (`use_reentrant=False`); with grad disabled the original forward runs.
- Nothing here knows about shared_model or DeepSpeed. Under ZeRO-3 a checkpointed module should reach its parameters
  through child modules (true of transformer blocks and of `CoreAttention`), so that recompute re-gathers them
  through DeepSpeed's submodule hooks; a target holding parameters directly is refused when `ops`/`full` is used
  with `allow_direct_params=False`.
- `SelectiveCheckpointing` is the Lightning callback: it applies the config to the LightningModule in `setup`, or at
  fit start when the module builds its layers in `configure_model`; it undoes it at teardown. What it wrapped is
  reported once on rank 0 through Lightning's own logger (shown with Lightning's default logging, like "GPU
  available: ...") and kept after fit in `wrapped` (qualified names) and `num_wrapped`.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    _detach_helper,
    _VersionWrapper,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from lt_plugins.activation_meter import note_cached
from lt_plugins.errors import TrainingConfigError
from lt_plugins.memory_model import CHECKPOINT_MODES

MODES: tuple[str, ...] = CHECKPOINT_MODES

DEFAULT_SAVE_OPS: tuple[str, ...] = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
)
"""Matmuls (the projections) and fused attention outputs: the expensive ops. Pointwise ops are recomputed."""

_ORIGINAL = "_tandem_checkpoint_original_forward"


@dataclass(frozen=True)
class CheckpointingConfig:
    """Which submodules to checkpoint and how. Mirrors the `checkpointing:` section of the training YAML."""

    mode: str = "none"
    """none | full | attention | ops."""
    block_classes: tuple[str, ...] = ()
    """Class names of the blocks to consider (e.g. DecoderLayer); empty: the largest repeated stack."""
    name_regex: str | None = None
    """Alternatively, a regex matched (re.fullmatch) against qualified module names."""
    every_n: int = 1
    """Checkpoint every n-th chosen block (blocks n, 2n, ...; 1 = all)."""
    attention_classes: tuple[str, ...] = ("CoreAttention",)
    """`attention` mode: class names of the core-attention modules recomputed inside each block."""
    save_ops: tuple[str, ...] = DEFAULT_SAVE_OPS
    """`ops` mode: ops whose outputs are kept, as 'aten.NAME' or 'aten.NAME.OVERLOAD'. Others are recomputed."""
    allow_direct_params: bool = True
    """Allow a checkpointed module that holds parameters itself (not only through children)."""
    _save_overloads: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise TrainingConfigError(f"checkpointing.mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.every_n < 1:
            raise TrainingConfigError(f"checkpointing.every_n must be >= 1, got {self.every_n}")
        if self.name_regex is not None:
            try:
                re.compile(self.name_regex)
            except re.error as exc:
                raise TrainingConfigError(f"checkpointing.name_regex {self.name_regex!r} is invalid: {exc}") from None
        for key in ("block_classes", "attention_classes", "save_ops"):
            object.__setattr__(self, key, tuple(getattr(self, key)))  # lists from YAML become tuples
        object.__setattr__(self, "_save_overloads", frozenset(resolve_ops(self.save_ops)))


def resolve_ops(names: tuple[str, ...] | list[str]) -> list[torch._ops.OpOverload]:
    """'aten.mm' → every overload of aten.mm; 'aten.mm.default' → that overload. Unknown names are errors."""
    out: list[torch._ops.OpOverload] = []
    for name in names:
        parts = name.split(".")
        if len(parts) not in (2, 3):
            raise TrainingConfigError(f"checkpointing.save_ops entry {name!r} must look like 'aten.mm[.default]'")
        try:
            packet = getattr(getattr(torch.ops, parts[0]), parts[1])
        except (AttributeError, RuntimeError):
            raise TrainingConfigError(f"checkpointing.save_ops entry {name!r} is not a known torch op") from None
        overloads = [parts[2]] if len(parts) == 3 else packet.overloads()
        for overload in overloads:
            try:
                out.append(getattr(packet, overload))
            except AttributeError:
                raise TrainingConfigError(f"checkpointing.save_ops: {name!r} has no overload {overload!r}") from None
    return out


# ----------------------------------------------------------------------------------------------- choosing
def _largest_stack(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children of the ModuleList with the most parameters whose children all share one class."""
    best: list[tuple[str, nn.Module]] = []
    best_params = -1
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.ModuleList) or not len(sub) or len({type(c) for c in sub}) != 1:
            continue
        n = sum(p.numel() for p in sub.parameters())
        if n > best_params:
            prefix = f"{name}." if name else ""
            best, best_params = [(f"{prefix}{i}", c) for i, c in enumerate(sub)], n
    return best


def select_blocks(module: nn.Module, config: CheckpointingConfig) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) pairs `config` chooses as blocks, before the mode picks inside them."""
    if config.block_classes or config.name_regex:
        pattern = re.compile(config.name_regex) if config.name_regex else None
        chosen = [
            (name, sub)
            for name, sub in module.named_modules()
            if name
            and (not config.block_classes or type(sub).__name__ in config.block_classes)
            and (pattern is None or pattern.fullmatch(name))
        ]
        # A chosen module nested inside another chosen one would be checkpointed twice: keep the outer one.
        chosen = [(n, m) for n, m in chosen if not any(n.startswith(o + ".") for o, _ in chosen if o != n)]
    else:
        chosen = _largest_stack(module)
    if not chosen:
        what = (
            f"block_classes={list(config.block_classes)} name_regex={config.name_regex!r}"
            if config.block_classes or config.name_regex
            else "a repeated nn.ModuleList stack"
        )
        raise TrainingConfigError(f"checkpointing found no blocks to checkpoint ({what}) in {type(module).__name__}")
    return [pair for i, pair in enumerate(chosen) if (i + 1) % config.every_n == 0]


def select_targets(module: nn.Module, config: CheckpointingConfig) -> list[tuple[str, nn.Module]]:
    """The modules whose forward the mode wraps: the blocks, or (attention mode) the core attention inside them."""
    if config.mode == "none":
        return []
    blocks = select_blocks(module, config)
    if config.mode != "attention":
        return blocks
    targets = [
        (f"{name}.{sub_name}" if sub_name else name, sub)
        for name, block in blocks
        for sub_name, sub in block.named_modules()
        if type(sub).__name__ in config.attention_classes
    ]
    if not targets:
        raise TrainingConfigError(
            f"checkpointing.mode=attention found no modules of class {list(config.attention_classes)} inside "
            f"the chosen blocks ({blocks[0][0]}, ...); set checkpointing.attention_classes"
        )
    return targets


# ----------------------------------------------------------------------------------------------- wrapping
_PASS_THROUGH = (
    os.path.dirname(torch.__file__) + os.sep,  # torch itself: dispatch, torch.distributed, hooks, checkpoint
    os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "typing_extensions.py"),  # @deprecated wrappers
)
_STDLIB = os.path.dirname(functools.__file__) + os.sep  # decorators, context managers


def _passed_over(filename: str) -> bool:
    if filename.startswith(_PASS_THROUGH):
        return True
    return filename.startswith(_STDLIB) and "site-packages" not in filename and "dist-packages" not in filename


_ZERO_LINEAR = os.path.join("deepspeed", "runtime", "zero", "linear.py")
_DEEPSPEED = os.sep + "deepspeed" + os.sep


def _issued_by_deepspeed() -> bool:
    """Whether the op being dispatched was called by DeepSpeed code (its ZeRO-3 hooks gathering, prefetching or
    releasing parameters) rather than by the model: the first caller outside torch is in `deepspeed/`
    (ZeRO-3's replacement of `F.linear`, `zero/linear.py`, is the model's own matmul and counts as the model).
    Frames of torch, the standard library and typing_extensions' wrappers are passed over."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _passed_over(filename):
            return _DEEPSPEED in filename and not filename.endswith(_ZERO_LINEAR)
        frame = frame.f_back
    return False


def _written_tensors(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The arguments an op writes into (`add_`'s self, an `out=`), from its schema's alias annotations."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


class _ZeroAwareCaching(_CachingTorchDispatchMode):
    """The forward half of torch's selective checkpoint, blind to the ops DeepSpeed's hooks issue, and safe against
    an in-place op on a saved output.

    torch keeps a saved op's output by reference; an in-place op on it later in the forward (DeepSpeed ZeRO-3's
    `LinearFunctionForZeroStage3` does `output = input.matmul(weight.t()); output += bias`) changes the saved value,
    and the recompute then hands back the mutated tensor and repeats the mutation (the bias added twice: wrong
    activations and gradients, no error; torch's version check does not see it). Before such an op runs, the saved
    entries that share its target's storage are replaced by copies of their current value."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _issued_by_deepspeed():
            return func(*args, **(kwargs or {}))
        if func._schema.is_mutable:
            self._copy_saved_before_write(_written_tensors(func, args, kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _copy_saved_before_write(self, targets: list[torch.Tensor]) -> None:
        written = {t.untyped_storage().data_ptr() for t in targets if t.numel()}
        if not written:
            return

        def copy_if_written(entry: Any) -> Any:
            val = entry.val if isinstance(entry, _VersionWrapper) else None
            if isinstance(val, torch.Tensor) and val.numel() and val.untyped_storage().data_ptr() in written:
                return _VersionWrapper(_detach_helper(val.clone()))
            return entry

        for entries in self.storage.values():
            for idx, entry in list(entries.items()):
                if isinstance(entry, (_VersionWrapper, tuple, list)):  # not torch's _RECOMPUTE / _CONSUMED markers
                    entries[idx] = tree_map(copy_if_written, entry)


class _ZeroAwareCached(_CachedTorchDispatchMode):
    """The recompute half of torch's selective checkpoint, blind to the ops DeepSpeed's hooks issue."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _issued_by_deepspeed():
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _ops_context_fn(save: frozenset) -> Callable[[], Any]:
    """torch's selective checkpoint contexts, except that ops called by DeepSpeed are neither cached nor looked up.

    Under ZeRO-3, DeepSpeed's submodule hooks gather, prefetch and release parameters inside a checkpointed block,
    and what they do depends on its state (the recorded module trace, prefetch, which parameters are available or
    persistent), not on the block: the forward and the recompute issue different ops (after the validation sanity
    check's forward, for one), and torch refuses the recompute ("aten.empty.memory_format encountered during
    backward but not found in storage"). Those ops run as they come, in both passes; the model's own are
    cached or recomputed by the policy."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in save:
            if not ctx.is_recompute:
                note_cached(getattr(ctx, "op_output", None))
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def contexts() -> tuple[Any, Any]:
        create_selective_checkpoint_contexts(policy)  # torch's own argument checks
        storage: dict[Any, dict[int, Any]] = defaultdict(dict)
        return _ZeroAwareCaching(policy, storage), _ZeroAwareCached(None, storage)

    return contexts


def _wrap(sub: nn.Module, context_fn: Callable[[], Any] | None) -> None:
    original = sub.__dict__.get(_ORIGINAL) or sub.forward
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn

    @functools.wraps(original)
    def forward(*args: Any, **kw: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kw)
        return checkpoint(original, *args, **kwargs, **kw)

    sub.forward = forward  # type: ignore[method-assign]
    setattr(sub, _ORIGINAL, original)


def remove_checkpointing(module: nn.Module) -> int:
    """Restore every forward wrapped by `apply_checkpointing`; returns how many were restored."""
    restored = 0
    for sub in module.modules():
        original = sub.__dict__.pop(_ORIGINAL, None)
        if original is not None:
            sub.__dict__.pop("forward", None)
            restored += 1
    return restored


def apply_checkpointing(module: nn.Module, config: CheckpointingConfig) -> list[str]:
    """Wrap the forwards `config` chooses inside `module`; returns their qualified names (empty for mode none)."""
    remove_checkpointing(module)
    targets = select_targets(module, config)
    if not config.allow_direct_params:
        direct = [name for name, sub in targets if any(True for _ in sub.parameters(recurse=False))]
        if direct:
            raise TrainingConfigError(
                f"checkpointing targets hold parameters directly ({', '.join(direct[:3])}); under ZeRO-3 choose "
                "their parent blocks instead, or set checkpointing.allow_direct_params=true"
            )
    context_fn = _ops_context_fn(config._save_overloads) if config.mode == "ops" else None
    for _, sub in targets:
        _wrap(sub, context_fn)
    return [name for name, _ in targets]


class SelectiveCheckpointing(Callback):
    """Applies a `CheckpointingConfig` to any LightningModule at `setup`, before the strategy wraps the model.

    `wrapped` holds the qualified names of the modules whose forward it wrapped (in the last fit, kept after it ends:
    the wrapping itself is undone at teardown) and `num_wrapped` their count."""

    def __init__(self, config: CheckpointingConfig | None = None, **fields: Any) -> None:
        super().__init__()
        self.config = config if config is not None else CheckpointingConfig(**fields)
        self.wrapped: list[str] = []
        self._deferred = False

    @property
    def num_wrapped(self) -> int:
        """How many modules the last fit checkpointed."""
        return len(self.wrapped)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        try:
            self._apply(trainer, pl_module)
        except TrainingConfigError:
            if not is_overridden("configure_model", pl_module):
                raise
            self._deferred = True  # the layers are created in configure_model, after this hook: retry at fit start

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._deferred:
            self._deferred = False
            self._apply(trainer, pl_module)

    def _apply(self, trainer: Any, pl_module: Any) -> None:
        self.wrapped = apply_checkpointing(pl_module, self.config)
        if trainer.is_global_zero:
            rank_zero_info(self.summary())

    def summary(self) -> str:
        """One line: the mode and the modules wrapped (the first few by name)."""
        if not self.wrapped:
            return f"Activation checkpointing (mode={self.config.mode}): no module wrapped"
        names = ", ".join(self.wrapped[:4]) + (f", ... ({len(self.wrapped) - 4} more)" if len(self.wrapped) > 4 else "")
        return f"Activation checkpointing (mode={self.config.mode}): {len(self.wrapped)} module(s) wrapped: {names}"

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        remove_checkpointing(pl_module)  # the forwards are restored; `wrapped` still says what was checkpointed
