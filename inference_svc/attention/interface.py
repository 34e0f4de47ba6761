"""The one attention-ops interface every implementation satisfies (torch, native CPU, Triton, reference).

Contract:
- `AttentionOps` is a `typing.Protocol`: `name`, and four operations over tensors only, the paged-KV layout of
  `inference_svc.attention.paged` (caches `[num_blocks, block_size, Hkv, D]`, int32 block tables padded with 0,
  token slot = block * block_size + offset). Each takes the keyword arguments `k_scales`, `v_scales` (the
  `[num_blocks, Hkv]` fp32 scales of an fp8/int8 cache, `inference_svc.attention.kv_quant`; None otherwise).
  - `store_kv(k, v, k_cache, v_cache, slot_mapping)`: k, v `[T, Hkv, D]`, slot_mapping `[T]` int64 (< 0: skip).
  - `prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale) -> [T, Hq, D]`:
    packed causal chunks; query j of sequence s is at position context_lens[s] - q_len_s + j.
  - `decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale) -> [S, Hq, D]`: one query each.
  - `decode_step(q, k, v [1, T, ...], k_cache, v_cache, slot_mapping, context_lens, block_tables, scale)`: a
    decode-only step's store and decode attention for one layer in one call -> `[1, T, Hq, D]`, the same results
    as `store_kv` then `decode_attention`; or None where the implementation has no such call (the two then run).
- The engine runs any implementation under the same per-step backend (`paged.PagedAttention`) without branching
  on which; `isinstance(ops, AttentionOps)` holds for each (runtime-checkable: it checks the names only).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionOps(Protocol):
    """The paged-KV attention ops of one implementation (see the module docstring for shapes)."""

    name: str
    """"torch" (the CPU path, `torch_ops`), "triton" (`triton_ops`) or "reference" (`reference`)."""

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None: ...

    def prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def decode_step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
    ) -> torch.Tensor | None: ...
