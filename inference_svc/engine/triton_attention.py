"""The engine's attention backend over the kernel ops (`inference_svc.kernels`): Triton on CUDA.

Contract:
- Same cache layout and step metadata as `attention.TorchPagedAttention` (see `attention.py`); per layer it calls
  `store_kv` once, then `decode_attention` on the D decode tokens and `prefill_attention` on the packed prefill
  chunks. It reads nothing but the cache and the metadata it was built with.
- `triton_backend_factory(device)` returns (factory, reason): a factory when the kernels can run here (CUDA, or
  Triton's CPU interpreter under TRITON_INTERPRET=1), else None and why.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inference_svc.engine.attention import AttentionMetadata, KVCache
from inference_svc.kernels.triton_backend import AttentionOps, triton_available, triton_ops


class OpsPagedAttention:
    """An `AttentionBackend` for one step, built from kernel ops + cache + metadata."""

    def __init__(self, ops: AttentionOps, cache: KVCache, meta: AttentionMetadata) -> None:
        self.ops = ops
        self.cache = cache
        self.meta = meta
        self._prefill_cu = meta.cu_seqlens_q  # offsets relative to the first prefill token

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [1, T, Hq, D]; k, v: [1, T, Hkv, D]
        k_cache, v_cache = self.cache.layer(layer_idx)
        q, k, v = q[0], k[0], v[0]
        m = self.meta
        self.ops.store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, m.slot_mapping)
        d = m.num_decode_tokens
        parts: list[torch.Tensor] = []
        if d:
            parts.append(
                self.ops.decode_attention(
                    q[:d].contiguous(), k_cache, v_cache, m.decode_context_lens, m.decode_block_tables, scale
                )
            )
        if q.shape[0] > d:
            parts.append(
                self.ops.prefill_attention(
                    q[d:].contiguous(),
                    k_cache,
                    v_cache,
                    self._prefill_cu,
                    m.prefill_context_lens,
                    m.prefill_block_tables,
                    scale,
                )
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return out[None]  # [1, T, Hq, D]


def triton_backend_factory(
    device: torch.device,
) -> tuple[Callable[[KVCache, AttentionMetadata], OpsPagedAttention] | None, str]:
    ok, reason = triton_available()
    if not ok:
        return None, reason
    ops = triton_ops()
    return (lambda cache, meta: OpsPagedAttention(ops, cache, meta)), reason
