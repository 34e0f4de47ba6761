"""The engine's door to the Triton kernels: availability check and the three ops, without kernel internals.

Contract:
- `triton_available()` returns (True, how) when the Triton kernels can run here: on a CUDA device, or in Triton's
  CPU interpreter when ``TRITON_INTERPRET=1`` is set (slow; for tests). Otherwise (False, reason), a sentence the
  engine can print when `--attention-backend triton` was asked for and cannot be honoured.
- `AttentionOps` is the one attention-ops interface: `store_kv`, `prefill_attention` and `decode_attention`, the
  signatures documented in `inference_svc.kernels`, over tensors only (each takes the keyword arguments
  `k_scales`, `v_scales` for fp8/int8 caches, None otherwise). `triton_ops()` returns the Triton kernels
  (inputs made contiguous for them), `reference_ops()` the plain-torch reference, and
  `inference_svc.engine.attention.torch_ops()` the engine's CPU path; the engine runs any of them under the same
  per-step backend (`attention.PagedAttention`) without branching on which.
- Nothing here allocates, launches or reads device memory.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from inference_svc.kernels import reference


@dataclass(frozen=True)
class AttentionOps:
    """The three paged-KV attention ops of one backend (see `inference_svc.kernels` for the shapes)."""

    name: str
    """"triton", "torch" (`inference_svc.engine.attention.torch_ops`, the CPU path) or "reference"."""
    store_kv: Callable[..., None]
    prefill_attention: Callable[..., torch.Tensor]
    decode_attention: Callable[..., torch.Tensor]
    decode_step: Callable[..., torch.Tensor | None] | None = None
    """Optional: a decode-only step's store and decode attention for one layer in one call, (q, k, v [1, T, ...],
    k_cache, v_cache, slot_mapping, context_lens, block_tables, scale) -> [1, T, Hq, D], or None where it does not
    apply (the two ops then run); the same results as `store_kv` then `decode_attention`."""


def triton_available() -> tuple[bool, str]:
    """Whether the Triton kernels can run in this process, and how (or why not)."""
    if importlib.util.find_spec("triton") is None:
        return False, "the triton package is not installed (pip install 'tandem[serve]')"
    from inference_svc import kernels

    if kernels.IMPORT_ERROR is not None:
        return False, f"importing the Triton kernels failed: {kernels.IMPORT_ERROR}"
    from inference_svc.kernels import configs

    if configs.interpret_mode():
        return True, "Triton interpreter on CPU (TRITON_INTERPRET=1; slow, for tests)"
    if torch.cuda.is_available():
        return True, f"CUDA device {torch.cuda.get_device_name()}"
    if configs.interpreter_requested():
        return False, "TRITON_INTERPRET=1 was set after triton had been imported; set it before the process starts"
    return False, "no CUDA device (set TRITON_INTERPRET=1 before starting to run the kernels interpreted on CPU)"


def triton_ops(autotune: bool = False) -> AttentionOps:
    """The Triton kernels as an `AttentionOps`; raises RuntimeError with the reason when they cannot run.
    `autotune`: the attention kernels autotune their tiles on CUDA (`EngineConfig.triton_autotune`)."""
    ok, why = triton_available()
    if not ok:
        raise RuntimeError(f"Triton attention backend unavailable: {why}")
    from inference_svc import kernels

    def store_kv(
        k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, **scales
    ) -> None:
        kernels.store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, slots, **scales)  # dense indexing

    def prefill_attention(q: torch.Tensor, *args: Any, **scales: Any) -> torch.Tensor:
        return kernels.prefill_attention(q.contiguous(), *args, **scales, autotune=autotune)

    def decode_attention(q: torch.Tensor, *args: Any, **scales: Any) -> torch.Tensor:
        return kernels.decode_attention(q.contiguous(), *args, **scales, autotune=autotune)

    return AttentionOps(
        name="triton", store_kv=store_kv, prefill_attention=prefill_attention, decode_attention=decode_attention
    )


def reference_ops() -> AttentionOps:
    """The plain-torch reference as an `AttentionOps` (runs anywhere; computes in the inputs' dtype)."""
    return AttentionOps(
        name="reference",
        store_kv=reference.store_kv,
        prefill_attention=reference.prefill_attention,
        decode_attention=reference.decode_attention,
    )
