"""Measure the bytes a forward pass keeps alive for backward, with `torch.autograd.graph.saved_tensors_hooks`.

Contract:
- `with SavedActivationMeter(exclude=model.parameters()) as meter: loss = step()` records every tensor autograd
  saves during the forward (outermost hooks: what is saved outside checkpointed regions, plus the inputs that
  non-reentrant checkpointing saves for its recompute) and every op output that selective checkpointing caches
  (`note_cached`, called by the `ops` policy in `lt_plugins.checkpointing`). Bytes are counted once per storage,
  so views and tensors saved twice count once; parameters and their views, and the storages of the excluded
  tensors (parameters, buffers), count zero.
- `meter.bytes` is the total; `meter.by_dtype` splits it. Deterministic on CPU: it sums tensor sizes, it does not
  read an allocator.
- Only forward passes are metered: the recompute in backward runs under checkpoint's own hooks.
- `flop_counter()` is torch's FlopCounterMode plus the CPU fused-attention kernel, for counting recomputed FLOPs.
- The only shared state is a context variable naming the active meter, set while the `with` block runs.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

_ACTIVE: contextvars.ContextVar[SavedActivationMeter | None] = contextvars.ContextVar(
    "tandem_saved_activation_meter", default=None
)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (weights saved by matmul backward are not activations, wherever ZeRO-3 has
    gathered them to)."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class SavedActivationMeter:
    """Counts unique storages saved for backward during the forward passes run inside it."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t) for t in exclude if isinstance(t, torch.Tensor)}
        self._seen: dict[tuple[str, int], tuple[int, torch.dtype]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._token: contextvars.Token | None = None

    # --------------------------------------------------------------------------- recording
    def _record(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or t.is_sparse or _is_parameter(t):
            return
        key = _storage_key(t)
        if key in self._excluded or key in self._seen:
            return
        nbytes = t.untyped_storage().nbytes()
        if nbytes:
            self._seen[key] = (nbytes, t.dtype)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._record(t)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def note_cached(self, output: object) -> None:
        """Count the tensors of an op output that selective checkpointing keeps instead of recomputing."""
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor):
                self._record(leaf)

    # --------------------------------------------------------------------------- results
    @property
    def bytes(self) -> int:
        return sum(n for n, _ in self._seen.values())

    @property
    def tensors(self) -> int:
        return len(self._seen)

    @property
    def by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n, dtype in self._seen.values():
            name = str(dtype).removeprefix("torch.")
            out[name] = out.get(name, 0) + n
        return out

    # --------------------------------------------------------------------------- context manager
    def __enter__(self) -> SavedActivationMeter:
        self._hooks.__enter__()
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None
        self._hooks.__exit__(exc_type, exc, tb)


def note_cached(output: object) -> None:
    """Report an op output cached by selective checkpointing to the active meter, if any (cheap no-op otherwise)."""
    meter = _ACTIVE.get()
    if meter is not None:
        meter.note_cached(output)


def _sdpa_forward_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward_flops(grad_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *a: Any, **k: Any) -> int:
    return sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape)


def flop_counter() -> FlopCounterMode:
    """`torch.utils.flop_counter.FlopCounterMode` that also counts the CPU fused attention kernel (torch's table
    covers only the CUDA kernels), so that attention FLOPs and their recompute are counted on CPU too."""
    aten = torch.ops.aten
    return FlopCounterMode(
        display=False,
        custom_mapping={
            aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_flops,
        },
    )
