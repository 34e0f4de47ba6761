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
- Why: a decode step's attention per layer is a few hundred cached tokens per query; as a dozen small torch ops
  (views, casts, two stores, SDPA's set-up) it cost more than the attention itself (docs/benchmarks.md).
- `GraphDecode(cache, meta)`: one decode-only step's attention (every token a decode query: plain decodes, verify
  items) as a backend that a compiled decoder traces (`traced = True`, `shared_model.compiled`): each layer's call
  is the C++ operator `tandem::paged_attention(q, k, v, kv_cache, layer, slot_mapping, context_lens,
  block_tables, scale)`, which runs `decode_step` over that layer of the cache: the same function, so the same
  results, as the Python backend (`paged.PagedAttention` over the torch ops) would call, without Python per layer.
  The cache (the `KVCache`'s one tensor, `data`, which the operator writes in place: its schema says so) and the
  metadata are the object's tensors, so the graph takes them as inputs at every call: nothing is bound or
  registered anywhere, the `KVCache` stays their one owner. `mark_dynamic()` marks the metadata's sizes unbacked
  (for the compile). `GraphDecode.serves(cache)` says whether the C++ kernel reads this cache (unscaled, a dtype it
  has, a head size a multiple of 16, on the CPU, with the library built here); `GraphDecode.covers(meta)` whether
  a step is decode-only.
"""

from __future__ import annotations

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


class GraphDecode:
    """A decode-only step's attention over one cache, traced into a compiled graph (see the module docstring)."""

    traced = True
    """`shared_model.compiled` traces this backend's calls (tensor-only operators) instead of calling it opaquely."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata) -> None:
        own = _own_storage  # guards would pin a view's storage offset (the decode step's slots are one)
        self.kv_cache = cache.data  # [L, 2, num_blocks, block_size, Hkv, D], written in place
        self.slot_mapping = own(meta.slot_mapping)  # [T] int64
        self.context_lens = own(meta.decode_context_lens)  # [T] int32
        self.block_tables = own(meta.decode_block_tables)  # [T, max_blocks] int32

    @staticmethod
    def serves(cache: KVCache) -> bool:
        """Whether the C++ kernel reads `cache` here (else every step takes the Python backend)."""
        k_cache, _ = cache.layer(0)
        if not k_cache.is_cpu or cache.scales is not None or not reads(k_cache, k_cache.shape[-1]):
            return False
        return extension() is not None

    @staticmethod
    def covers(meta: AttentionMetadata) -> bool:
        """Whether the step is decode-only (every token a decode query)."""
        return meta.num_decode_tokens == int(meta.slot_mapping.shape[0])

    def mark_dynamic(self) -> None:
        """Mark every size of the metadata unbacked: the graph passes them to the operator only, so one graph
        serves every batch size and block-table width."""
        for t in (self.slot_mapping, self.context_lens, self.block_tables):
            for dim in range(t.dim()):
                torch._dynamo.decorators.mark_unbacked(t, dim)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q: [1, T, Hq, D]; k, v: [1, T, Hkv, D] -> [1, T, Hq, D]
        return torch.ops.tandem.paged_attention(
            q, k, v, self.kv_cache, layer_idx, self.slot_mapping, self.context_lens, self.block_tables, scale
        )


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.storage_offset() else t
