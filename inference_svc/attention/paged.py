"""The engine's one attention backend over any `AttentionOps`, and a step's metadata.

Contract:
- KV cache layout (shared with the Triton kernels; the cache itself is `engine.kv_cache.KVCache`): per layer
  `k_cache, v_cache: [num_blocks, block_size, Hkv, D]` in the stored dtype (`--kv-cache-dtype`), and for fp8/int8
  `k_scales, v_scales: [num_blocks, Hkv]` fp32 (`inference_svc.attention.kv_quant`). Token slot =
  block_id * block_size + offset. Block tables are int32 `[S, max_blocks]` padded with 0.
- One engine step is one flat batch of T tokens: the D decode queries first, each over its own context length and
  block table (a sequence's decoded token, or each token of a short chunk such as a speculative verify item,
  which sees its context up to itself), then the prefill chunks of P sequences back to back. `AttentionMetadata`
  describes it with tensors only (and the count D).
- `PagedAttention(ops, cache, meta)` is built per step; per layer it stores this step's K/V at `slot_mapping` (each
  token's K/V written exactly once), then calls the ops' decode attention on the D decode queries (each over its
  sequence's cached context) and their prefill attention on the packed chunks (causal over the cached prefix plus
  the chunk); every op gets the layer's scales as `k_scales`, `v_scales` (None for an unscaled cache).
- A decode-only step over an unscaled cache calls the ops' `decode_step` once per layer (the store, then decode
  attention, in one call where the ops have one); where it returns None, the two ops run.
- Shapes follow `shared_model.attention`: q `[1, T, Hq, D]`, k, v `[1, T, Hkv, D]`, output `[1, T, Hq, D]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from inference_svc.attention.interface import AttentionOps

if TYPE_CHECKING:  # the cache is the engine's (one owner); attention only reads and writes its tensors
    from inference_svc.engine.kv_cache import KVCache


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, as tensors on the model device (no host copies)."""

    slot_mapping: torch.Tensor  # [T] int64: each token's cache slot
    num_decode_tokens: int  # D: tokens [0, D) are decode queries (several may belong to one sequence)
    decode_context_lens: torch.Tensor  # [D] int32 (includes the token being decoded)
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [P+1] int32, offsets into the prefill tokens (which start at D)
    prefill_context_lens: torch.Tensor  # [P] int32 = cached prefix + chunk length
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32


class PagedAttention:
    """The `AttentionBackend` of one step over any `AttentionOps` (see the module docstring)."""

    def __init__(self, ops: AttentionOps, cache: KVCache, meta: AttentionMetadata) -> None:
        self.ops = ops
        self.cache = cache
        self.meta = meta
        # a decode-only step of an unscaled cache: the ops' one-call store and attention, where they have it
        decode_only = meta.num_decode_tokens == int(meta.slot_mapping.shape[0])
        self._decode_step = ops.decode_step if decode_only and cache.scales is None else None

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [1, T, Hq, D]; k, v: [1, T, Hkv, D]
        k_cache, v_cache = self.cache.layer(layer_idx)
        if self._decode_step is not None:
            m = self.meta
            out = self._decode_step(q, k, v, k_cache, v_cache, m.slot_mapping, m.decode_context_lens,
                                    m.decode_block_tables, scale)  # fmt: skip
            if out is not None:
                return out
        k_scales, v_scales = self.cache.layer_scales(layer_idx)  # [num_blocks, Hkv] fp32, or None
        q, k, v = q[0], k[0], v[0]
        m, ops = self.meta, self.ops
        ops.store_kv(k, v, k_cache, v_cache, m.slot_mapping, k_scales=k_scales, v_scales=v_scales)
        d = m.num_decode_tokens
        parts: list[torch.Tensor] = []
        if d:
            decode_q = q if d == q.shape[0] else q[:d]
            parts.append(
                ops.decode_attention(
                    decode_q,
                    k_cache,
                    v_cache,
                    m.decode_context_lens,
                    m.decode_block_tables,
                    scale,
                    k_scales=k_scales,
                    v_scales=v_scales,
                )
            )
        if q.shape[0] > d:
            parts.append(
                ops.prefill_attention(
                    q[d:],
                    k_cache,
                    v_cache,
                    m.cu_seqlens_q,
                    m.prefill_context_lens,
                    m.prefill_block_tables,
                    scale,
                    k_scales=k_scales,
                    v_scales=v_scales,
                )
            )
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return out[None]  # [1, T, Hq, D]


@dataclass(frozen=True)
class PagedAttentionFactory:
    """What the model runner calls once per step: (cache, metadata) -> that step's backend over `ops`."""

    ops: AttentionOps

    def __call__(self, cache: KVCache, meta: AttentionMetadata) -> PagedAttention:
        return PagedAttention(self.ops, cache, meta)


def paged_attention_factory(ops: AttentionOps) -> Callable[[KVCache, AttentionMetadata], PagedAttention]:
    """The per-step backend over `ops` (a `PagedAttentionFactory`: the runner can tell which ops it holds)."""
    return PagedAttentionFactory(ops)
