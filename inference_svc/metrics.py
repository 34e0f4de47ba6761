"""Prometheus metrics of the inference service.

Contract:
- `ServiceMetrics` owns one `CollectorRegistry` (not the process-global one), so several servers can live in one
  process (tests) without clashing. `serve_http(host, port)` exposes it at `/metrics`.
- Latency histograms are in seconds and come from the engine's own `Timing` (monotonic clock, from the request's
  arrival in the engine): TTFT, time per output token, end-to-end and queue time are observed once per finished
  request; inter-token latency once per streamed increment after the first.
- Engine-wide gauges and counters are refreshed from `Engine.stats()` snapshots by `observe_stats`; the counters
  (preemptions, tokens in/out) advance by the difference from the previous snapshot, so they never go backwards.
- Requests are counted once at their end: by finish reason when they finish, by gRPC status code when they fail.
- Thread-safe (prometheus_client is): the engine thread and the event loop both record here. Nothing here blocks.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from inference_svc.engine.types import Timing

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)


class ServiceMetrics:
    """Every metric the service exports, on its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "Arrival in the engine until the first output token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "tandem_time_per_output_token_seconds",
            "Mean time per output token after the first, per finished request.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tandem_inter_token_latency_seconds",
            "Time between two consecutive streamed increments of one request.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds",
            "Arrival in the engine until the request finished.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "tandem_request_queue_time_seconds",
            "Arrival in the engine until first scheduled.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("tandem_requests_running", "Requests holding KV blocks in the engine.", registry=r)
        self.waiting = Gauge("tandem_requests_waiting", "Requests waiting in the engine's scheduler.", registry=r)
        self.admission_queue = Gauge(
            "tandem_admission_queue_requests", "Admitted requests that have not produced a token yet.", registry=r
        )
        self.admission_queue_tokens = Gauge(
            "tandem_admission_queue_tokens", "Prompt tokens of admitted requests without a token yet.", registry=r
        )
        self.kv_used = Gauge("tandem_kv_blocks_used", "KV-cache blocks in use.", registry=r)
        self.kv_total = Gauge("tandem_kv_blocks_total", "KV-cache blocks in the pool.", registry=r)
        self.kv_cached = Gauge("tandem_kv_blocks_cached", "KV blocks holding a registered prefix.", registry=r)
        self.prefix_hit_rate = Gauge(
            "tandem_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / tokens looked up.", registry=r
        )
        self.preemptions = Counter("tandem_preemptions", "Sequences preempted for lack of KV blocks.", registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens admitted (tokens in).", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Tokens generated (tokens out).", registry=r)
        self.cached_prompt_tokens = Counter(
            "tandem_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.finished = Counter(
            "tandem_requests_finished", "Requests that finished, by finish reason.", ["finish_reason"], registry=r
        )
        self.errors = Counter(
            "tandem_request_errors", "Requests that ended with an error status, by gRPC code.", ["code"], registry=r
        )
        self._last: dict[str, float] = {}

    # ------------------------------------------------------------------ per request
    def observe_finished(self, finish_reason: str, timing: Timing | None) -> None:
        self.finished.labels(finish_reason=finish_reason).inc()
        if timing is None:
            return
        if timing.ttft_ms > 0:
            self.ttft.observe(timing.ttft_ms / 1000.0)
        if timing.tpot_ms > 0:
            self.tpot.observe(timing.tpot_ms / 1000.0)
        self.e2e.observe(timing.total_ms / 1000.0)
        self.queue_time.observe(timing.queue_ms / 1000.0)

    def observe_error(self, code_name: str) -> None:
        self.errors.labels(code=code_name).inc()

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    # ------------------------------------------------------------------ engine-wide
    def observe_stats(self, stats: Any) -> None:
        """Refresh gauges and advance counters from an `EngineStats` snapshot."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.kv_cached.set(stats.kv_blocks_cached)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        for name, counter in (
            ("num_preemptions", self.preemptions),
            ("prompt_tokens_total", self.prompt_tokens),
            ("generation_tokens_total", self.generation_tokens),
            ("cached_prompt_tokens_total", self.cached_prompt_tokens),
        ):
            value = float(getattr(stats, name))
            delta = value - self._last.get(name, 0.0)
            if delta > 0:
                counter.inc(delta)
            self._last[name] = value

    def observe_admission(self, requests: int, tokens: int) -> None:
        self.admission_queue.set(requests)
        self.admission_queue_tokens.set(tokens)

    # ------------------------------------------------------------------ exposition
    def render(self) -> bytes:
        """The Prometheus text format of every metric (what /metrics serves)."""
        return generate_latest(self.registry)

    def serve_http(self, host: str, port: int) -> tuple[Any, int]:
        """Start the /metrics HTTP server in a daemon thread; return (server, bound port). `server.shutdown()`."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_address[1]
