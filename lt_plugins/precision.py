"""Precision policy: keep numerically sensitive modules (norms, softmax, losses) in fp32 inside any LightningModule.

Contract:
- `PrecisionPolicy(classes=..., names=...)` selects modules by class name (the class or any base class) or by
  qualified module name (fnmatch patterns such as `model.layers.*.input_layernorm`). `apply(module)` wraps the
  outermost selected modules so that their forward runs with autocast off, floating inputs cast to fp32 and their
  low-precision parameters seen as fp32 (gradients still reach the stored parameters). Outputs are cast back to the
  input dtype, except for loss modules (`fp32_output_classes`), whose result stays fp32. Idempotent.
- `PrecisionPolicyCallback(policy)` applies it at `setup` and again when each stage starts (fit, validate, test,
  predict): after Lightning's `configure_model`, so layers a module builds there (as under ZeRO-3's zero.Init) are
  covered, and before the first forward. `wrapped` lists the qualified names it wrapped and survives the run. It
  works with Lightning's autocast precisions and with DeepSpeed's bf16/fp16 modes (where parameters themselves are
  16-bit): only `forward` is replaced, so the strategy's module hooks are untouched.
- `check_precision(precision, accelerator)` refuses combinations that cannot run (`16-mixed` on CPU) with a
  `PrecisionError` that says what to use instead. `SUPPORTED_PRECISIONS` lists the accepted names.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lt_plugins.errors import PrecisionError

SUPPORTED_PRECISIONS = ("bf16-mixed", "16-mixed", "32-true")
_MARK = "_tandem_fp32_policy"


def check_precision(precision: str, accelerator: str) -> None:
    """Raise PrecisionError for a precision this accelerator cannot run; accelerator is 'cpu', 'cuda' or 'gpu'."""
    if precision not in SUPPORTED_PRECISIONS:
        raise PrecisionError(f"trainer.precision={precision!r} is not supported; choose one of {SUPPORTED_PRECISIONS}")
    if precision == "16-mixed" and accelerator == "cpu":
        raise PrecisionError(
            "trainer.precision='16-mixed' needs CUDA (fp16 with dynamic loss scaling); on CPU use 'bf16-mixed' or "
            "'32-true'"
        )


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which modules run in fp32 under mixed precision."""

    classes: tuple[str, ...] = ("RMSNorm", "LayerNorm", "GroupNorm", "Softmax", "LogSoftmax", "CrossEntropyLoss")
    """Class names (matched against the module's class and its bases)."""
    names: tuple[str, ...] = ()
    """fnmatch patterns on qualified module names, e.g. 'model.norm' or '*.q_norm'."""
    fp32_output_classes: tuple[str, ...] = ("CrossEntropyLoss", "NLLLoss", "MSELoss")
    """Selected classes whose output stays fp32 (losses); other outputs return to the input dtype."""

    def selects(self, name: str, module: nn.Module) -> bool:
        mro = {cls.__name__ for cls in type(module).__mro__}
        return bool(mro & set(self.classes)) or any(fnmatch.fnmatchcase(name, p) for p in self.names)

    def apply(self, root: nn.Module) -> list[str]:
        """Wrap the outermost selected submodules of `root`; return their qualified names."""
        chosen: list[str] = []
        for name, module in root.named_modules():
            if any(name.startswith(prefix + ".") for prefix in chosen if prefix):
                continue  # an ancestor already runs in fp32
            if self.selects(name, module):
                chosen.append(name)
                if not getattr(module, _MARK, False):
                    keep = bool({c.__name__ for c in type(module).__mro__} & set(self.fp32_output_classes))
                    module.forward = _fp32_forward(module, module.forward, keep_fp32_output=keep)  # type: ignore[method-assign]
                    setattr(module, _MARK, True)
        return chosen


class PrecisionPolicyCallback(Callback):
    """Applies a PrecisionPolicy to the LightningModule (any strategy, any precision), before its first forward."""

    def __init__(self, policy: PrecisionPolicy | None = None) -> None:
        self.policy = policy or PrecisionPolicy()
        self.wrapped: list[str] = []

    def _apply(self, pl_module: LightningModule) -> None:
        self.wrapped = self.policy.apply(pl_module)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._apply(pl_module)  # modules built in __init__

    # Lightning calls configure_model after `setup` and before these: layers built there are wrapped here.
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._apply(pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._apply(pl_module)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._apply(pl_module)

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._apply(pl_module)


def _first_float_dtype(values: Any) -> torch.dtype | None:
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.dtype
    return None


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


@contextmanager
def _fp32_parameters(module: nn.Module) -> Iterator[None]:
    """Within the block, every low-precision parameter of `module` (and below) reads as an fp32 copy whose
    gradient flows back to the stored parameter."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for sub in module.modules():
            for pname, param in list(sub._parameters.items()):
                if param is None or not param.is_floating_point() or param.dtype == torch.float32:
                    continue
                del sub._parameters[pname]
                object.__setattr__(sub, pname, param.float())
                swapped.append((sub, pname, param))
        yield
    finally:
        for sub, pname, param in reversed(swapped):
            object.__delattr__(sub, pname)
            sub._parameters[pname] = param


def _fp32_forward(module: nn.Module, forward: Callable[..., Any], keep_fp32_output: bool) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        in_dtype = _first_float_dtype(list(args) + list(kwargs.values()))
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with torch.autocast(device_type=device, enabled=False), _fp32_parameters(module):
            out = forward(*_cast(args, torch.float32), **_cast(kwargs, torch.float32))
        if keep_fp32_output or in_dtype is None or in_dtype == torch.float32:
            return out
        return _cast(out, in_dtype)

    return run
