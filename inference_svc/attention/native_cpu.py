"""Paged attention kernels for the CPU's decode step (C++, `tandem_native/csrc/paged_attention.cpp`), used by the
torch ops' CPU path.

Contract:
- `extension()`: Tandem's native library (`tandem_native`), or None where it cannot run here; the torch ops then
  run as before.
- `decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale)`: q `[S, Hq, D]`, caches
  `[num_blocks, block_size, Hkv, D]` in fp32/bf16/fp16 (unscaled), int32 lengths and block tables as in
  `inference_svc.attention` → `[S, Hq, D]` in q's dtype. Each query's heads score its sequence's cached
  tokens in place (no gather, no mask), softmax and value sums in fp32, the output rounded once. Consecutive
  queries of one sequence (a verify item's rows: one block table, lengths growing by one) read each K/V row once
  for all of them. A query's result does not depend on the others in the batch, bit for bit. Lengths and block
  ids are checked against the cache.
- `store_kv(k, v, k_cache, v_cache, slot_mapping)`: both caches' stores in one call (cast to the cache's dtype).
- Why: on the 82M model a decode step spent about 150-200 µs per layer in attention under torch's profiler
  (2026-12-02), most of it a dozen small torch ops (views, casts, two stores, SDPA's set-up) for one query over a
  few hundred cached tokens.
- `GraphAttention.bind(handle, cache)`: the C++ operator `torch.ops.tandem.paged_attention`, which a compiled
  decoder's graph calls in place of `tandem::attention` (`shared_model.compiled.CompiledDecoder(attention_op=)`),
  bound to that decoder's KV cache (once per decoder: a second binding is refused). Between `begin(meta)` and
  `end()` of a decode-only step (every token a decode query: plain decodes, verify items), each layer's call
  runs `decode_step` over the bound caches in C++: the same function, so the same results, as the Python backend
  would call, without the per-layer Python (the custom op's dispatch into Python and the backend's own code,
  about 30 µs a layer in the profiler, 2026-12-03). Every other call goes to `tandem::attention`. `calls()`
  counts the layer calls that ran in C++. The caches stay bound until the `GraphAttention` is collected.
  `GraphAttention.bind` returns None where the C++ kernels cannot run, or cannot read this cache (fp8/int8 with
  scales, a dtype they lack, a head size not a multiple of 16).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

import tandem_native

if TYPE_CHECKING:
    from inference_svc.attention.paged import AttentionMetadata
    from inference_svc.engine.kv_cache import KVCache

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Cache dtypes the C++ decode kernel reads (fp8/int8 caches, with scales, take the torch ops; so do head sizes
that are not a multiple of 16)."""


def extension() -> Any | None:
    """The built kernels, or None where they cannot run here (built on first call)."""
    return tandem_native.library()


def reads(cache: torch.Tensor, head_dim: int) -> bool:
    """Whether the C++ decode kernel reads a cache of this dtype and head size (an unscaled one)."""
    return cache.dtype in NATIVE_DTYPES and head_dim % 16 == 0


class GraphAttention:
    """One compiled decoder's `tandem::paged_attention`, bound to its KV cache (see the module docstring)."""

    def __init__(self, native: Any, handle: int, cache: KVCache) -> None:
        self._native = native
        self.handle = handle
        layers = [cache.layer(i) for i in range(cache.data.shape[0])]  # [num_blocks, block_size, Hkv, D] each
        native.bind_caches(handle, [k for k, _ in layers], [v for _, v in layers])
        weakref.finalize(self, native.unbind, handle)

    @classmethod
    def operator(cls, cache: KVCache) -> Any | None:
        """The graph operator for decoders over `cache`, or None where the C++ kernels cannot serve it."""
        k_cache, _ = cache.layer(0)
        if not k_cache.is_cpu or cache.scales is not None or not reads(k_cache, k_cache.shape[-1]):
            return None
        if extension() is None:
            return None
        return torch.ops.tandem.paged_attention

    @classmethod
    def bind(cls, handle: int, cache: KVCache) -> GraphAttention | None:
        """Decoder `handle`'s operator bound to `cache`, or None where `operator(cache)` is None."""
        return cls(extension(), handle, cache) if cls.operator(cache) is not None else None

    def begin(self, meta: AttentionMetadata) -> bool:
        """Open a step: True (its layers then run in C++) for a decode-only step, False for any other."""
        if meta.num_decode_tokens != int(meta.slot_mapping.shape[0]):
            return False
        self._native.begin_decode(self.handle, meta.slot_mapping, meta.decode_context_lens, meta.decode_block_tables)
        return True

    def end(self) -> None:
        """Close the open step (its metadata released)."""
        self._native.end_decode(self.handle)

    def calls(self) -> int:
        """Layer calls that ran in C++ so far."""
        return int(self._native.graph_calls(self.handle))
