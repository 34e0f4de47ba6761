"""Summaries of one sweep level, the way the serving field reports them.

Contract:
- `summarize(records, wall_s, percentiles)` returns a plain dict (JSON-ready; milliseconds for latencies):
  request throughput (completed requests / wall seconds), output and total token throughput, and for TTFT, TPOT,
  ITL and end-to-end latency the mean, median, std and each requested percentile (default: p99) over the
  requests that completed; errors are counted by status (the gRPC code name, or over HTTP the record's status:
  see `loadgen.RequestRecord.status`).
- TPOT is per request: (e2e − TTFT) / (output tokens − 1), requests with one output token excluded. ITL pools every
  gap between consecutive token-carrying stream messages of every completed request.
- Percentiles interpolate linearly between order statistics (numpy's default), so the median of [1, 2] is 1.5.
- Throughput counts only completed requests' tokens; an empty or all-failed level gives zeros and `None` latencies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from inference_svc.bench.loadgen import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2e")


def distribution(values_s: Iterable[float], percentiles: Sequence[float] = (99,)) -> dict[str, float | None]:
    """mean, median, std and p<N> of `values_s` (seconds) in milliseconds; None for each when there are none."""
    arr = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    keys = ["mean", "median", "std", *(f"p{p:g}" for p in percentiles)]
    if arr.size == 0:
        return dict.fromkeys(keys)
    out: dict[str, float | None] = {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "std": float(arr.std()),
    }
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(arr, p))
    return out


def metric_values(records: Sequence[RequestRecord], metric: str) -> list[float]:
    """Seconds of `metric` (ttft | tpot | itl | e2e) over the completed requests."""
    done = [r for r in records if r.ok]
    if metric == "itl":
        return [x for r in done for x in r.itls]
    values = [getattr(r, metric) for r in done]
    return [v for v in values if v is not None]


def summarize(records: Sequence[RequestRecord], wall_s: float, percentiles: Sequence[float] = (99,)) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    wall = max(wall_s, 1e-9)
    errors = Counter(r.status for r in records if not r.ok)
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": dict(sorted(errors.items())),
        "duration_s": wall_s,
        "request_throughput": len(done) / wall if records else 0.0,
        "output_throughput": out_tokens / wall if records else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / wall if records else 0.0,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "client_output_tokens_all": sum(r.output_tokens for r in records),
    }
    for metric in METRICS:
        summary[f"{metric}_ms"] = distribution(metric_values(records, metric), percentiles)
    return summary
