"""The engine's door to the Triton kernels and the reference: availability, and their `AttentionOps`.

Contract:
- `triton_available()` returns (True, how) when the Triton kernels can run here: on a CUDA device, or in Triton's
  CPU interpreter when ``TRITON_INTERPRET=1`` is set (slow; for tests). Otherwise (False, reason), a sentence the
  engine can print when `--attention-backend triton` was asked for and cannot be honoured.
- `triton_ops(autotune)` is the Triton kernels as an `AttentionOps` (`inference_svc.attention.interface`; inputs
  made contiguous for them), `reference_ops()` the plain-torch reference; `triton_backend_factory` the per-step
  backend factory over the Triton ops, or None and why.
- Nothing here allocates, launches or reads device memory.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from inference_svc.attention import reference
from inference_svc.attention import triton as triton_kernels
from inference_svc.attention.paged import PagedAttentionFactory


def triton_available() -> tuple[bool, str]:
    """Whether the Triton kernels can run in this process, and how (or why not)."""
    if importlib.util.find_spec("triton") is None:
        return False, "the triton package is not installed (pip install 'tandem[serve]')"
    from inference_svc.attention import triton as triton_kernels

    if triton_kernels.IMPORT_ERROR is not None:
        return False, f"importing the Triton kernels failed: {triton_kernels.IMPORT_ERROR}"
    from inference_svc.attention.triton import configs

    if configs.interpret_mode():
        return True, "Triton interpreter on CPU (TRITON_INTERPRET=1; slow, for tests)"
    if torch.cuda.is_available():
        return True, f"CUDA device {torch.cuda.get_device_name()}"
    if configs.interpreter_requested():
        return False, "TRITON_INTERPRET=1 was set after triton had been imported; set it before the process starts"
    return False, "no CUDA device (set TRITON_INTERPRET=1 before starting to run the kernels interpreted on CPU)"


class TritonOps:
    """The Triton kernels as an `AttentionOps` (inputs made contiguous for them); no one-call decode step."""

    name = "triton"

    def __init__(self, autotune: bool = False) -> None:
        """Raises RuntimeError with the reason when the kernels cannot run here. `autotune`: the attention kernels
        autotune their tiles on CUDA (`EngineConfig.triton_autotune`)."""
        ok, why = triton_available()
        if not ok:
            raise RuntimeError(f"Triton attention backend unavailable: {why}")
        self.autotune = autotune

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
        **scales: Any,
    ) -> None:  # fmt: skip
        triton_kernels.store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, slots, **scales)  # dense indexing

    def prefill_attention(self, q: torch.Tensor, *args: Any, **scales: Any) -> torch.Tensor:
        return triton_kernels.prefill_attention(q.contiguous(), *args, **scales, autotune=self.autotune)

    def decode_attention(self, q: torch.Tensor, *args: Any, **scales: Any) -> torch.Tensor:
        return triton_kernels.decode_attention(q.contiguous(), *args, **scales, autotune=self.autotune)

    def decode_step(self, *args: Any) -> None:
        return None


def triton_ops(autotune: bool = False) -> TritonOps:
    """The Triton kernels' `AttentionOps` (see `TritonOps`)."""
    return TritonOps(autotune)


def triton_backend_factory(device: torch.device, autotune: bool = False) -> tuple[PagedAttentionFactory | None, str]:
    """(A per-step backend factory over the Triton ops, how they run) where they can run here, else (None, why)."""
    del device  # the kernels run wherever triton_available() says they can
    ok, reason = triton_available()
    if not ok:
        return None, reason
    return PagedAttentionFactory(triton_ops(autotune)), reason


class ReferenceOps:
    """The plain-torch reference as an `AttentionOps` (runs anywhere; computes in the inputs' dtype)."""

    name = "reference"

    def store_kv(self, *args: Any, **scales: Any) -> None:
        reference.store_kv(*args, **scales)

    def prefill_attention(self, *args: Any, **scales: Any) -> torch.Tensor:
        return reference.prefill_attention(*args, **scales)

    def decode_attention(self, *args: Any, **scales: Any) -> torch.Tensor:
        return reference.decode_attention(*args, **scales)

    def decode_step(self, *args: Any) -> None:
        return None


def reference_ops() -> ReferenceOps:
    return ReferenceOps()
