"""Per-rank training state in bytes, summed over the tensors this rank actually holds (not what a formula says).

Contract:
- `state_bytes(engine_or_module, optimizer)` returns `StateBytes(params, master, grads, optimizer)`:
  params: model parameters as stored (a ZeRO-3 parameter counts its own shard, `ds_tensor`);
  master: fp32 master copies kept by a DeepSpeed optimizer (its partition);
  grads: gradients held — `.grad` of parameters plus DeepSpeed's gradient partitions;
  optimizer: every tensor in the inner torch optimizer's `state` (Adam moments of this rank's partition).
- Storages are counted once however many views point at them. Read it between backward and the optimizer step
  for gradients, and after a step for optimizer state.
- Works with a plain torch optimizer too (DDP / single process), for the benchmarks' baselines.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

# DeepSpeed optimizer attributes holding fp32 master partitions / gradient partitions (stages 0-3, bf16 optimizer).
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")
_GRAD_ATTRS = ("averaged_gradients", "grad_partitions_flat_buffer", "fp32_groups_gradient_flat_partition")


@dataclass(frozen=True)
class StateBytes:
    params: int
    master: int
    grads: int
    optimizer: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once, at the view's extent)."""
    spans: dict[int, int] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        spans[key] = max(spans.get(key, 0), t.untyped_storage().nbytes())
    return sum(spans.values())


def _attr(obj: Any, name: str) -> Any:
    for candidate in (name, f"_DeepSpeedZeroOptimizer_Stage3__{name}"):
        if hasattr(obj, candidate):
            return getattr(obj, candidate)
    return None


def state_bytes(module: torch.nn.Module, optimizer: Any) -> StateBytes:
    """What this rank holds now (see the module contract)."""
    params = list({id(p): p for p in module.parameters()}.values())
    param_bytes = sum(
        (p.ds_tensor.numel() * p.ds_tensor.element_size()) if hasattr(p, "ds_tensor") else p.numel() * p.element_size()
        for p in params
    )
    inner = getattr(optimizer, "optimizer", optimizer)
    master = _unique_bytes(t for name in _MASTER_ATTRS for t in _tensors(_attr(optimizer, name)))
    grads = [p.grad for p in params if p.grad is not None]
    grads += [t for name in _GRAD_ATTRS for t in _tensors(_attr(optimizer, name))]
    opt_state = _unique_bytes(t for state in getattr(inner, "state", {}).values() for t in _tensors(state))
    return StateBytes(params=param_bytes, master=master, grads=_unique_bytes(grads), optimizer=opt_state)
