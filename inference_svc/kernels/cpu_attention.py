"""Paged attention kernels for the CPU's decode step (C++, `cpu_attention.cpp`), used by the torch ops' CPU path.

Contract:
- `extension()`: the built module, or None where Tandem's CPU kernels cannot run (`shared_model.cpu_kernels`: the
  same rules, flags, cache and `TANDEM_CPU_KERNELS=0`); the torch ops then run as before.
- `decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale)`: q `[S, Hq, D]`, caches
  `[num_blocks, block_size, Hkv, D]` in fp32/bf16/fp16 (unscaled), int32 lengths and block tables as in
  `inference_svc.engine.attention` → `[S, Hq, D]` in q's dtype. Each query's heads score its sequence's cached
  tokens in place (no gather, no mask), softmax and value sums in fp32, the output rounded once. Consecutive
  queries of one sequence (a verify item's rows: one block table, lengths growing by one) read each K/V row once
  for all of them. A query's result does not depend on the others in the batch, bit for bit. Lengths and block
  ids are checked against the cache.
- `store_kv(k, v, k_cache, v_cache, slot_mapping)`: both caches' stores in one call (cast to the cache's dtype).
- Why: on the 82M model a decode step spent about 150-200 µs per layer in attention under torch's profiler
  (2026-12-02), most of it a dozen small torch ops (views, casts, two stores, SDPA's set-up) for one query over a
  few hundred cached tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared_model import cpu_kernels

SOURCE = Path(__file__).with_name("cpu_attention.cpp")


def extension() -> Any | None:
    """The built kernels, or None where they cannot run here (built on first call)."""
    return cpu_kernels.build("tandem_cpu_attention", (SOURCE,))
