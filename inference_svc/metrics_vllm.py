"""vLLM-compatible Prometheus metrics, beside Tandem's own `tandem_*` ones, so routers and dashboards built for vLLM
(the Gateway API Inference Extension's endpoint picker, llm-d, Grafana boards) read a Tandem replica unchanged.

Contract:
- `VllmMetrics(registry, model_name, engine="0")` registers on the caller's registry (the `ServiceMetrics` one) the
  series vLLM's v1 engine exports, with vLLM's names, types, help-independent semantics, units, label names
  (`model_name`, `engine`) and histogram bucket edges (`VLLM_*_BUCKETS`; see docs/operations.md for the side-by-side
  table and where each figure comes from in Tandem):
  gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a fraction 0..1 of
  the pool's blocks in use, cached-but-free blocks counted free, as vLLM's block pool does) and its deprecated
  twin `vllm:gpu_cache_usage_perc` (same value: endpoint pickers before the Gateway API Inference Extension v1.0
  read that name);
  counters (in tokens) `vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`, and `vllm:prompt_tokens`,
  `vllm:generation_tokens`, `vllm:num_preemptions`, `vllm:request_success{finished_reason}`;
  histograms in seconds `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
  `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`;
  info gauges `vllm:cache_config_info` (value 1; labels `engine`, `block_size`, `num_gpu_blocks`, `cache_dtype`,
  `enable_prefix_caching`, no `model_name`, as vLLM's) and `vllm:lora_requests_info` (labels `max_lora`,
  `running_lora_adapters`, `waiting_lora_adapters`; no `model_name`/`engine`, as vLLM's; its value is the Unix time
  of the last update, which is how the endpoint picker finds the newest; the lists are the comma-joined names of
  the adapters the running and the waiting requests use, `max_lora` the adapter slots, "0" with LoRA off; one series
  at a time: when the labels change, the old series is removed).
- The figures are fed by `ServiceMetrics` from the same sources as the `tandem_*` ones (`Engine.stats()` snapshots,
  the engine's `Timing`, the async engine's per-increment clock): counters advance by the difference from the
  previous snapshot, so they never go backwards.
- Finish reasons map to vLLM's: stop → "stop", length → "length", cancelled → "abort"; every one of them has a
  series from the start (value 0), as vLLM's.
- Thread-safe as prometheus_client is; nothing here blocks.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from inference_svc.engine.types import Timing

VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""vLLM's `vllm:time_to_first_token_seconds` edges (22)."""
VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""vLLM's `vllm:inter_token_latency_seconds` edges (19)."""
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM's request-latency edges (21): `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`."""

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}
"""Tandem's finish reason → vLLM's `finished_reason` label."""

_COUNTERS = (
    ("prefix_cache_queried_tokens", "prefix_queries"),
    ("prefix_cache_hit_tokens", "prefix_hits"),
    ("prompt_tokens_total", "prompt_tokens"),
    ("generation_tokens_total", "generation_tokens"),
    ("num_preemptions", "preemptions"),
)
"""`EngineStats` field → the counter attribute it advances."""


class VllmMetrics:
    """The vLLM-named series of one engine (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str = "0") -> None:
        r = registry
        names = ("model_name", "engine")
        self._labels = {"model_name": model_name, "engine": engine}
        self.engine = engine

        def one(metric: Any) -> Any:
            return metric.labels(**self._labels)

        self.running = one(Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                                 names, registry=r))  # fmt: skip
        self.waiting = one(Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                 names, registry=r))  # fmt: skip
        self.kv_usage = one(Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  names, registry=r))  # fmt: skip
        self.gpu_usage = one(Gauge("vllm:gpu_cache_usage_perc",
                                   "GPU KV-cache usage. 1 means 100 percent usage. "
                                   "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
                                   names, registry=r))  # fmt: skip
        self.prefix_queries = one(Counter("vllm:prefix_cache_queries",
                                          "Prefix cache queries, in terms of number of queried tokens.",
                                          names, registry=r))  # fmt: skip
        self.prefix_hits = one(Counter("vllm:prefix_cache_hits",
                                       "Prefix cache hits, in terms of number of cached tokens.",
                                       names, registry=r))  # fmt: skip
        self.prompt_tokens = one(Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                         names, registry=r))  # fmt: skip
        self.generation_tokens = one(Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                             names, registry=r))  # fmt: skip
        self.preemptions = one(Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                       names, registry=r))  # fmt: skip
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*names, "finished_reason"), registry=r)  # fmt: skip
        self.success = {reason: success.labels(**self._labels, finished_reason=reason)
                        for reason in sorted(set(FINISH_REASONS.values()))}  # fmt: skip
        self.ttft = one(Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                  names, buckets=VLLM_TTFT_BUCKETS, registry=r))  # fmt: skip
        self.itl = one(Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                 names, buckets=VLLM_ITL_BUCKETS, registry=r))  # fmt: skip
        self.e2e = one(Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                 names, buckets=VLLM_REQUEST_LATENCY_BUCKETS, registry=r))  # fmt: skip
        self.queue_time = one(Histogram("vllm:request_queue_time_seconds",
                                        "Histogram of time spent in WAITING phase for request.",
                                        names, buckets=VLLM_REQUEST_LATENCY_BUCKETS, registry=r))  # fmt: skip
        self.cache_config = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                  ("block_size", "cache_dtype", "enable_prefix_caching", "engine", "num_gpu_blocks"),
                                  registry=r)  # fmt: skip
        self.lora = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                          ("max_lora", "running_lora_adapters", "waiting_lora_adapters"), registry=r)  # fmt: skip
        self._lora_labels = ("0", "", "")
        self.lora.labels(*self._lora_labels).set(time.time())
        self._last: dict[str, float] = {}

    def observe_stats(self, stats: Any) -> None:
        """Refresh the gauges and advance the counters from an `EngineStats` snapshot."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        total = stats.kv_blocks_total
        usage = stats.kv_blocks_used / total if total > 0 else 0.0
        self.kv_usage.set(usage)
        self.gpu_usage.set(usage)
        for field, attr in _COUNTERS:
            value = float(getattr(stats, field))
            delta = value - self._last.get(field, 0.0)
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last[field] = value
        labels = (
            str(getattr(stats, "max_lora", 0)),
            ",".join(getattr(stats, "running_lora_adapters", ())),
            ",".join(getattr(stats, "waiting_lora_adapters", ())),
        )
        if labels != self._lora_labels:
            self.lora.remove(*self._lora_labels)
            self._lora_labels = labels
        self.lora.labels(*labels).set(time.time())

    def observe_finished(self, finish_reason: str, timing: Timing | None) -> None:
        reason = FINISH_REASONS.get(finish_reason)
        if reason is not None:
            self.success[reason].inc()
        if timing is None:
            return
        if timing.ttft_ms > 0:
            self.ttft.observe(timing.ttft_ms / 1000.0)
        self.e2e.observe(timing.total_ms / 1000.0)
        self.queue_time.observe(timing.queue_ms / 1000.0)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_model(self, info: Any) -> None:
        """Once, when the engine is built (`EngineInfo`): `vllm:cache_config_info`."""
        config = info.config
        self.cache_config.labels(
            block_size=str(config.block_size),
            cache_dtype=str(info.kv_cache_dtype),
            enable_prefix_caching=str(bool(config.enable_prefix_caching)),
            engine=self.engine,
            num_gpu_blocks=str(info.kv_blocks_total),
        ).set(1)
