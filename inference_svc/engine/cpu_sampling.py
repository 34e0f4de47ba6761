"""Sampling on the CPU (C++, `tandem_native/csrc/sampling.cpp`): truncation thresholds and a one-call sampler,
for `engine.sampler`.

Contract:
- `extension()`: Tandem's native library (`tandem_native`), or None where it cannot run here; the sampler then
  computes the thresholds with a sort.
- `truncation_thresholds(probs, top_k, top_p, min_p)`: probs fp32 `[S, V]`, top_k int64 `[S]` (0: none), top_p and
  min_p fp64 `[S]` (1 and 0: none) → fp32 `[S]`, each row's smallest kept probability under top-k, then top-p over
  what top-k keeps, then min-p (ties at the boundary all kept); the rule of `sampler._thresholds_torch`, by
  selection instead of a sort (O(V) per row).
- `sample_rows(logits, temperature, greedy, top_k, top_p, min_p, u)`: logits fp32 `[S, V]` and Python lists of
  one entry per row → (tokens, the rows whose logits are not all finite), as lists: `sampler.probabilities` then
  `Sampler.draw` (argmax for a greedy row) in one call, the same tokens as that torch path (the sampler's tests hold
  it to them). Lists, not tensors: building five small tensors cost more than the call.
- `greedy_rows(logits)`: logits fp32 `[S, V]` → (each row's argmax, the first index of its largest value; the rows
  whose logits are not all finite, whose token is 0), as lists: the torch path's greedy tokens in one call.
- Why: torch's CPU sort of a row of logits was most of a sampled decode step's sampling time (figures:
  docs/benchmarks-archive.md §7, "Sampling without a sort").
"""

from __future__ import annotations

from typing import Any

import tandem_native


def extension() -> Any | None:
    """The built kernel, or None where it cannot run here (built on first call)."""
    return tandem_native.library()
