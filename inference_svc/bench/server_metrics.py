"""The server's own view: scrape Prometheus `/metrics` before and after a level and check it against the client's.

Contract:
- `scrape(url, timeout)` fetches the text exposition and returns a flat `{sample_name{labels}: value}` dict
  (parsed with prometheus_client's parser). It raises `ScrapeError` when the endpoint cannot be read. The
  `model_name` label every series of the server carries is left out of the keys (one server serves one model;
  series of several would be summed), so the keys are the same whether or not the server names its model.
- `server_delta(before, after)` turns two scrapes into what happened between them: requests finished, tokens in
  and out, errors by code, and the mean TTFT / TPOT / e2e / ITL (ms) from the histograms' sum and count.
- `cross_check(client_summary, delta, rtt_ms, records)` compares the two views. The server times TTFT from the
  request's arrival in its engine, the client from the call, so client TTFT = server TTFT + the trip from client
  to engine and of the first token back (network, gRPC or HTTP, both event loops). `rtt_ms` is the p99 round trip of
  health checks measured under the same load: that delay. They agree when the client's mean TTFT exceeds the
  Prometheus mean by at least −1 ms and at most 2 ms + 2 × rtt_ms + 5 % of the client's mean (the 2× covers a
  burst of first tokens leaving one engine step together, which a periodic probe samples only now and then).
  The per-request overhead (client TTFT − the server's TTFT in the stream's last message) is reported as median and p99.
  Tokens out agree when the server generated exactly as many tokens as the client received (every request
  completed) or at least as many (some failed mid-stream, so tokens were made but not delivered).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = {
    "ttft": "tandem_time_to_first_token_seconds",
    "tpot": "tandem_time_per_output_token_seconds",
    "e2e": "tandem_e2e_request_latency_seconds",
    "itl": "tandem_inter_token_latency_seconds",
    "queue": "tandem_request_queue_time_seconds",
}
GENERATION_TOKENS = "tandem_generation_tokens_total"
PROMPT_TOKENS = "tandem_prompt_tokens_total"
FINISHED = "tandem_requests_finished_total"
ERRORS = "tandem_request_errors_total"


class ScrapeError(RuntimeError):
    """The metrics endpoint could not be read or parsed."""


def parse(text: str) -> dict[str, float]:
    """Flatten a Prometheus text exposition into {'name{k="v",...}': value}, without the `model_name` label."""
    flat: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "le" in s.labels:
                continue  # buckets: not needed for means
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            key = f"{s.name}{{{labels}}}" if labels else s.name
            flat[key] = flat.get(key, 0.0) + float(s.value)
    return flat


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode("utf-8")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ScrapeError(f"cannot read {url}: {exc}") from exc
    try:
        return parse(text)
    except ValueError as exc:
        raise ScrapeError(f"{url} is not Prometheus text format: {exc}") from exc


def _labelled(snapshot: dict[str, float], name: str, label: str) -> dict[str, float]:
    prefix = f'{name}{{{label}="'
    return {k[len(prefix) : -2]: v for k, v in snapshot.items() if k.startswith(prefix)}


def server_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    out: dict[str, Any] = {
        "generation_tokens": d(GENERATION_TOKENS),
        "prompt_tokens": d(PROMPT_TOKENS),
        "finished": {
            k: v - _labelled(before, FINISHED, "finish_reason").get(k, 0.0)
            for k, v in _labelled(after, FINISHED, "finish_reason").items()
        },
        "errors": {
            k: v - _labelled(before, ERRORS, "code").get(k, 0.0) for k, v in _labelled(after, ERRORS, "code").items()
        },
    }
    out["finished"] = {k: v for k, v in out["finished"].items() if v}
    out["errors"] = {k: v for k, v in out["errors"].items() if v}
    for short, name in HISTOGRAMS.items():
        count = d(f"{name}_count")
        out[f"{short}_count"] = count
        out[f"{short}_mean_ms"] = d(f"{name}_sum") / count * 1000.0 if count > 0 else None
    return out


def cross_check(
    client: dict[str, Any], delta: dict[str, Any], rtt_ms: float, records: Sequence[Any] = ()
) -> dict[str, Any]:
    """Compare client and server figures of one level; `agrees` is the verdict, the rest says why."""
    client_ttft = client["ttft_ms"]["mean"]
    server_ttft = delta.get("ttft_mean_ms")
    result: dict[str, Any] = {
        "client_ttft_mean_ms": client_ttft,
        "server_ttft_mean_ms": server_ttft,
        "rtt_ms": rtt_ms,
        "client_output_tokens": client["client_output_tokens_all"],
        "server_generation_tokens": delta["generation_tokens"],
        "client_completed": client["completed"],
        "server_finished": sum(delta["finished"].values()),
    }
    ttft_ok = None
    if client_ttft is not None and server_ttft is not None:
        overhead = client_ttft - server_ttft
        tolerance = 2.0 + 2.0 * rtt_ms + 0.05 * client_ttft
        result.update(ttft_overhead_ms=overhead, ttft_tolerance_ms=tolerance)
        ttft_ok = -1.0 <= overhead <= tolerance
    per_request = [
        r.ttft * 1000 - r.server_ttft_ms for r in records if r.ok and r.ttft is not None and r.server_ttft_ms
    ]
    if per_request:
        result["ttft_overhead_per_request_ms"] = {
            "median": float(np.median(per_request)),
            "p99": float(np.percentile(per_request, 99)),
        }
    all_done = client["failed"] == 0
    server_tokens, client_tokens = delta["generation_tokens"], client["client_output_tokens_all"]
    tokens_ok = server_tokens == client_tokens if all_done else server_tokens >= client_tokens
    result.update(ttft_agrees=ttft_ok, tokens_agree=tokens_ok, agrees=bool(ttft_ok is not False and tokens_ok))
    return result
