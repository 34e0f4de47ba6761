"""The attention backend interface, and the plain causal backend used for training and reference runs.

Contract:
- The decoder computes q, k, v (after QK-norm and RoPE) and hands them to a backend, once per layer, with the
  layer index. The backend returns the attention output. It is the only place that knows how keys and values
  are stored: the training path attends within the given tokens; the inference engine's backends read and write
  a paged KV cache described by metadata the backend object carries (block tables, slots, lengths).
- Backends are passed to `forward` explicitly; the model reads no global state to choose one.
- Shapes: q `[batch, tokens, n_heads, head_dim]`, k and v `[batch, tokens, n_kv_heads, head_dim]`; output
  `[batch, tokens, n_heads, head_dim]`. n_heads is a multiple of n_kv_heads (grouped-query attention).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class AttentionBackend(Protocol):
    """Computes softmax(q·kᵀ·scale)·v for one layer; owns whatever K/V storage it needs."""

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor: ...


class CausalSelfAttention:
    """Causal attention among the given tokens only (no cache): training, evaluation, one-shot scoring.

    Uses torch SDPA, which picks a fused (flash / memory-efficient) kernel where the device has one.
    """

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] -> SDPA wants [B, H, T, D]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)  # [B, T, Hq, D]


CAUSAL = CausalSelfAttention()
"""The default backend: stateless, shared."""
