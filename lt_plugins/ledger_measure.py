"""What one rank actually holds, term by term: tensor bytes read from the model, the optimizer and DeepSpeed.

Contract:
- `held_state_bytes(module, optimizer)` returns bytes per ledger term (`memory_model.TERMS` names) for the
  training state: 16-bit (or model-dtype) trainable weights, frozen weights (parameters without requires_grad and a
  LoRA layer's int8 buffers), fp32 master weights, gradients, optimizer moments. It works for
  DeepSpeed's optimizers (ZeRO stages 1-3, and the stage-0 mixed-precision wrapper) and for plain torch optimizers,
  reading only what they hold: parameter data and stage-3 shards (`ds_tensor`), the inner optimizer's parameters
  (the fp32 master copy, when they are not the model's own tensors), gradients in `param.grad` and DeepSpeed's
  gradient partitions (`averaged_gradients`), and the inner optimizer's state.
- `held_bytes_by_role(module, optimizer)` is the same measurement keyed `params`, `master`, `grads`, `optimizer`
  (the benchmarks' and the ZeRO tests' JSON field names).
- This is the one measurer of held bytes: DeepSpeed's private attribute names are listed here only
  (`_MASTER_ATTRS`, `_GRAD_ATTRS`, `ipg_buckets`), checked against DeepSpeed 0.19.
- `bucket_bytes_held(optimizer)` sums DeepSpeed's reduce-bucket buffers (`ipg_buckets`) alive at the call.
- Bytes are the union of the byte ranges the tensors cover in each storage: views count once, a shard counts its
  own range, not the flat buffer around it; a tensor already counted under an earlier term is not counted again.
- Read-only: nothing here allocates, frees or moves a tensor. Nothing imports DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lt_plugins.memory_model import FROZEN, GRADS, MASTER, MOMENTS, WEIGHTS


class ByteRanges:
    """Union of [start, end) byte ranges per storage; `claim` counts only bytes no earlier tensor covered."""

    def __init__(self) -> None:
        self._ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}

    def claim(self, tensors: Iterable[torch.Tensor]) -> int:
        added = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device.type == "meta":
                continue
            key = (str(t.device), t.untyped_storage().data_ptr())
            start = t.storage_offset() * t.element_size()
            end = start + _extent(t) * t.element_size()
            added += self._insert(key, start, end)
        return added

    def _insert(self, key: tuple[str, int], start: int, end: int) -> int:
        ranges = self._ranges.setdefault(key, [])
        covered = sum(max(0, min(end, e) - max(start, s)) for s, e in ranges)
        merged = [(s, e) for s, e in ranges if e < start or s > end]
        lo = min([start] + [s for s, e in ranges if not (e < start or s > end)])
        hi = max([end] + [e for s, e in ranges if not (e < start or s > end)])
        self._ranges[key] = [*merged, (lo, hi)]
        return end - start - covered


def _extent(t: torch.Tensor) -> int:
    """Elements between the first and one past the last element a (possibly strided) view touches."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True) if size > 0)


def innermost_optimizer(optimizer: Any) -> Any:
    """Unwrap LightningOptimizer → DeepSpeed optimizer → the torch optimizer that owns the state."""
    seen = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


def _tensors(obj: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth - 1)
    elif depth and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth - 1)


_MASTER_ATTRS = ("fp32_groups", "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
"""Where DeepSpeed keeps the fp32 master copy: stage-0 mixed precision, stages 1-2, stage 3."""

_GRAD_ATTRS = ("averaged_gradients", "grad_partitions_flat_buffer")
"""Where DeepSpeed keeps gradient partitions between backward and step: stages 1-3 (`averaged_gradients`, views
into the flat buffer at stage 3) and stage 3's flat buffer of this rank's partitions."""


def _deepspeed_optimizer(optimizer: Any) -> Any:
    """The DeepSpeed optimizer under a LightningOptimizer wrapper (or the optimizer itself)."""
    while getattr(optimizer, "_optimizer", None) is not None:
        optimizer = optimizer._optimizer
    return optimizer


def _weights(module: nn.Module, trainable: bool) -> Iterator[torch.Tensor]:
    for p in module.parameters():
        if p.requires_grad != trainable:
            continue
        shard = getattr(p, "ds_tensor", None)
        if shard is not None:
            yield shard
        yield p.data


def frozen_buffers(module: nn.Module) -> list[torch.Tensor]:
    """Frozen weights held as buffers: a LoRA layer's int8 base and its row scales."""
    from lt_plugins.lora import LoraLinear

    return [b for m in module.modules() if isinstance(m, LoraLinear) for b in m.buffers(recurse=False)]


def held_state_bytes(module: nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes this rank holds for each training-state term (see the module contract)."""
    inner = innermost_optimizer(optimizer)
    ranges = ByteRanges()
    out = {WEIGHTS: ranges.claim(_weights(module, trainable=True))}
    out[FROZEN] = ranges.claim([*_weights(module, trainable=False), *frozen_buffers(module)])
    masters = [p for g in inner.param_groups for p in g["params"]]
    outer = _deepspeed_optimizer(optimizer)
    copies = [t for name in _MASTER_ATTRS for t in _tensors(getattr(outer, name, None), 1)]
    out[MASTER] = ranges.claim([*(p.data for p in masters), *copies])
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    grads += [p.grad for p in masters if p.grad is not None]
    grads += [t for name in _GRAD_ATTRS for t in _tensors(getattr(outer, name, None))]
    out[GRADS] = ranges.claim(grads)
    out[MOMENTS] = ranges.claim(t for state in inner.state.values() for t in _tensors(state, 1))
    return out


_ROLES = {WEIGHTS: "params", FROZEN: "frozen", MASTER: "master", GRADS: "grads", MOMENTS: "optimizer"}


def held_bytes_by_role(module: nn.Module, optimizer: Any) -> dict[str, int]:
    """`held_state_bytes` keyed params / master / grads / optimizer."""
    return {_ROLES[term]: value for term, value in held_state_bytes(module, optimizer).items()}


def bucket_bytes_held(optimizer: Any) -> int:
    """Bytes of DeepSpeed's gradient-reduction bucket buffers alive now (0 for optimizers without them)."""
    buckets = getattr(_deepspeed_optimizer(optimizer), "ipg_buckets", None) or {}
    ranges = ByteRanges()
    return ranges.claim(t for b in buckets.values() for t in _tensors(getattr(b, "buffer", None), 1))
