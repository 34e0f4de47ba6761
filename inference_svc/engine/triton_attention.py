"""The Triton kernels as the engine's attention backend (CUDA, or Triton's CPU interpreter in tests).

Contract: `triton_backend_factory(device)` returns (factory, reason): a per-step backend factory over the Triton
`AttentionOps` (`attention.PagedAttention`, the same backend every implementation runs under) when the kernels can
run here, else None and why.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inference_svc.engine.attention import AttentionMetadata, KVCache, PagedAttention, paged_attention_factory
from inference_svc.kernels.triton_backend import triton_available, triton_ops


def triton_backend_factory(
    device: torch.device, autotune: bool = False
) -> tuple[Callable[[KVCache, AttentionMetadata], PagedAttention] | None, str]:
    del device  # the kernels run wherever triton_available() says they can
    ok, reason = triton_available()
    if not ok:
        return None, reason
    return paged_attention_factory(triton_ops(autotune)), reason
