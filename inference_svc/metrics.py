"""Prometheus metrics of the inference service.

Contract:
- `ServiceMetrics(registry=None, model_name="")` owns one `CollectorRegistry` (not the process-global one), so
  several servers can live in one process (tests) without clashing. `MetricsHTTPServer` exposes `render()` at
  `/metrics`.
- Every series carries a `model_name` label: the served model's name (as vLLM does), given at construction (the
  server passes the model folder's base name, or `--served-model-name`). With the default `""` the label is left
  out: to Prometheus an empty label value and an absent label are the same series, so the output is the same data.
- `render()` has no `*_created` samples. prometheus_client adds them to counters and histograms; its
  `disable_created_metrics()` is process-global, so instead `render()` drops them from this registry's output
  alone (`registry` itself, read directly, still has them).
- `tandem_build_info` is 1, labelled with the `version` of the installed `tandem` distribution and `torch_version`
  (each "unknown" when its metadata is missing). `tandem_load_choice` is 1 for each lever of the engine's load plan
  (`inference_svc.executor`), labelled `lever` and `value`. The weights' dtype and quantization are labels of
  `tandem_model_weight_bytes`; the stored K/V dtype (`--kv-cache-dtype`, resolved) labels
  `tandem_kv_cache_bytes` (the pool) and `tandem_kv_bytes_per_token` (`EngineInfo`'s, which are the shared
  ledger's `kv_bytes_per_block` / `kv_bytes_per_token`, fp8/int8 scales included: GetModelInfo reports the same).
- `MetricsHTTPServer` is an asyncio server in the caller's event loop: no thread per connection (no thread at
  all), at most `max_connections` connections at once (one more is closed on accept), and each connection gets
  `timeout` seconds from accept to the end of its response, after which it is closed, so half-open or slow
  clients cannot pile up. One request per connection (`Connection: close`); GET/HEAD of `/metrics` (or `/`) only.
  It binds IPv4 and IPv6 addresses alike (`host` without brackets); a bind failure raises `ServerStartError`
  naming `HOST:PORT`.
- Latency histograms are in seconds and come from the engine's own `Timing` (monotonic clock, from the request's
  arrival in the engine): TTFT, time per output token, end-to-end and queue time are observed once per finished
  request; inter-token latency once per streamed increment after the first.
- Engine-wide gauges and counters are refreshed from `Engine.stats()` snapshots by `observe_stats`; the counters
  (preemptions, tokens in/out, cached prompt tokens, prefix-cache hits and queries) advance by the difference from
  the previous snapshot, so they never go backwards. The prefix cache is exported as two counters, tokens found
  (`tandem_prefix_cache_hits_total`) and tokens looked up (`tandem_prefix_cache_queries_total`), so a hit rate over
  any window is `rate(hits) / rate(queries)`. `tandem_kv_cache_usage_ratio` is used / total KV blocks (0 with no
  pool). Speculative decoding is four counters in the same spirit: the draft acceptance rate over a window is
  `rate(tandem_spec_decode_accepted_tokens_total) / rate(tandem_spec_decode_draft_tokens_total)`, and the tokens
  per verify step `rate(..._emitted_tokens_total) / rate(..._verify_steps_total)`.
- `tandem_cpu_threads_active` is the intra-op thread count the engine's steps run on now (the thread governor's,
  `inference_svc.executor.governor`: the load plan's `threads` unless other processes keep the CPUs busy), and
  `tandem_cpu_others_busy` the CPUs' worth of other processes' load it last measured (0 until it has).
- Requests are counted once at their end: by finish reason when they finish, by gRPC status code when they fail.
- `names` chooses the families exported: "tandem" (the `tandem_*` series), "vllm" (vLLM's names, from
  `inference_svc.metrics_vllm`, fed from the same observations) or "both" (the default). With "vllm" the `tandem_*`
  series are still kept in the registry but left out of `render()`.
- Thread-safe (prometheus_client is): the engine thread and the event loop both record here. Nothing here blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.metadata
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from inference_svc.engine.types import Timing
from inference_svc.metrics_vllm import VllmMetrics
from inference_svc.settings import METRIC_NAMES

log = logging.getLogger(__name__)

_MAX_REQUEST_HEAD_BYTES = 8192

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


def _version(distribution: str) -> str:
    """The installed version of `distribution`, or "unknown" when its metadata is missing."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _WithoutCreated(Collector):
    """`registry`'s metric families less their `<family>_created` samples (see the module docstring), and less the
    families whose name starts with one of `drop`."""

    def __init__(self, registry: CollectorRegistry, drop: tuple[str, ...] = ()) -> None:
        self._registry = registry
        self._drop = drop

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if self._drop and family.name.startswith(self._drop):
                continue
            created = family.name + "_created"
            if any(s.name == created for s in family.samples):
                family = copy.copy(family)
                family.samples = [s for s in family.samples if s.name != created]
            yield family


class ServiceMetrics:
    """Every metric the service exports, on its own registry, each series labelled with `model_name`."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "", names: str = "both") -> None:
        if names not in METRIC_NAMES:
            raise ValueError(f"metrics names must be one of {', '.join(METRIC_NAMES)}, got {names!r}")
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self.names = names
        self.vllm = None if names == "tandem" else VllmMetrics(self.registry, model_name)
        """vLLM's names for the same figures (None when `names` is "tandem")."""
        self._drop = ("tandem_",) if names == "vllm" else ()
        self._model: dict[str, str] = {"model_name": model_name} if model_name else {}
        """The `model_name` label of every series; empty (no label) when no name was given."""
        r = self.registry
        m = tuple(self._model)  # the label names every metric starts with

        def one(metric: Any) -> Any:
            """The metric's only series (the one of this model) when it has no other labels."""
            return metric.labels(**self._model) if self._model else metric

        self.ttft = one(
            Histogram(
                "tandem_time_to_first_token_seconds",
                "Arrival in the engine until the first output token.",
                m,
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.tpot = one(
            Histogram(
                "tandem_time_per_output_token_seconds",
                "Mean time per output token after the first, per finished request.",
                m,
                buckets=_TOKEN_BUCKETS,
                registry=r,
            )
        )
        self.itl = one(
            Histogram(
                "tandem_inter_token_latency_seconds",
                "Time between two consecutive streamed increments of one request.",
                m,
                buckets=_TOKEN_BUCKETS,
                registry=r,
            )
        )
        self.e2e = one(
            Histogram(
                "tandem_e2e_request_latency_seconds",
                "Arrival in the engine until the request finished.",
                m,
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.queue_time = one(
            Histogram(
                "tandem_request_queue_time_seconds",
                "Arrival in the engine until first scheduled.",
                m,
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.running = one(Gauge("tandem_requests_running", "Requests holding KV blocks in the engine.", m, registry=r))
        self.waiting = one(
            Gauge("tandem_requests_waiting", "Requests waiting in the engine's scheduler.", m, registry=r)
        )
        self.admission_queue = one(
            Gauge(
                "tandem_admission_queue_requests",
                "Admitted requests that have not produced a token yet.",
                m,
                registry=r,
            )
        )
        self.admission_queue_tokens = one(
            Gauge(
                "tandem_admission_queue_tokens",
                "Prompt tokens of admitted requests without a token yet.",
                m,
                registry=r,
            )
        )
        self.tokenizer_pending = one(
            Gauge(
                "tandem_tokenizer_pending_chars",
                "Characters of long texts accepted by the tokenizer, not done.",
                m,
                registry=r,
            )
        )
        self.tokenized_chars = one(
            Counter(
                "tandem_tokenized_chars",
                "Characters of text handed to the tokenizer (prompts and Tokenize).",
                m,
                registry=r,
            )
        )
        self.weight_bytes = Gauge(
            "tandem_model_weight_bytes",
            "Bytes the served weights occupy as held (quantized formats and their scales included).",
            (*m, "dtype", "quantization"),
            registry=r,
        )
        self.kv_cache_bytes = Gauge(
            "tandem_kv_cache_bytes",
            "Bytes of the KV-cache pool as allocated (fp8/int8 scales included).",
            (*m, "kv_cache_dtype"),
            registry=r,
        )
        self.kv_bytes_per_token = Gauge(
            "tandem_kv_bytes_per_token",
            "KV-cache bytes one token occupies across all layers (fp8/int8 scales included).",
            (*m, "kv_cache_dtype"),
            registry=r,
        )
        self.compile_seconds = one(
            Gauge(
                "tandem_compile_seconds",
                "Seconds the start-up compile of the decode step took (0: nothing compiled).",
                m,
                registry=r,
            )
        )
        self.kv_used = one(Gauge("tandem_kv_blocks_used", "KV-cache blocks in use.", m, registry=r))
        self.kv_total = one(Gauge("tandem_kv_blocks_total", "KV-cache blocks in the pool.", m, registry=r))
        self.kv_cached = one(Gauge("tandem_kv_blocks_cached", "KV blocks holding a registered prefix.", m, registry=r))
        self.kv_usage = one(
            Gauge("tandem_kv_cache_usage_ratio", "KV-cache blocks in use / blocks in the pool (0 to 1).", m, registry=r)
        )
        self.threads_active = one(
            Gauge("tandem_cpu_threads_active", "Intra-op CPU threads the engine's steps run on now.", m, registry=r)
        )
        self.others_cpu_busy = one(
            Gauge(
                "tandem_cpu_others_busy",
                "CPUs' worth of other processes' load on this process's CPUs (the thread governor's last reading).",
                m,
                registry=r,
            )
        )
        self.prefix_hits = one(
            Counter("tandem_prefix_cache_hits", "Prompt tokens found in the prefix cache.", m, registry=r)
        )
        self.prefix_queries = one(
            Counter("tandem_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m, registry=r)
        )
        self.preemptions = one(
            Counter("tandem_preemptions", "Sequences preempted for lack of KV blocks.", m, registry=r)
        )
        self.prompt_tokens = one(Counter("tandem_prompt_tokens", "Prompt tokens admitted (tokens in).", m, registry=r))
        self.generation_tokens = one(
            Counter("tandem_generation_tokens", "Tokens generated (tokens out).", m, registry=r)
        )
        self.cached_prompt_tokens = one(
            Counter("tandem_cached_prompt_tokens", "Prompt tokens served from the prefix cache.", m, registry=r)
        )
        self.spec_verify_steps = one(
            Counter("tandem_spec_decode_verify_steps", "Sequence-steps that verified drafted tokens.", m, registry=r)
        )
        self.spec_draft_tokens = one(
            Counter("tandem_spec_decode_draft_tokens", "Drafted tokens verified (speculative decoding).", m, registry=r)
        )
        self.spec_accepted_tokens = one(
            Counter("tandem_spec_decode_accepted_tokens", "Drafted tokens the model kept.", m, registry=r)
        )
        self.spec_emitted_tokens = one(
            Counter("tandem_spec_decode_emitted_tokens", "Tokens produced by verify steps.", m, registry=r)
        )
        self.finished = Counter(
            "tandem_requests_finished", "Requests that finished, by finish reason.", (*m, "finish_reason"), registry=r
        )
        self.errors = Counter(
            "tandem_request_errors", "Requests that ended with an error status, by gRPC code.", (*m, "code"), registry=r
        )
        self.build_info = Gauge(
            "tandem_build_info",
            "Always 1: the versions of Tandem and torch serving this model.",
            (*m, "version", "torch_version"),
            registry=r,
        )
        self.build_info.labels(**self._model, version=_version("tandem"), torch_version=_version("torch")).set(1)
        self.load_choice = Gauge(
            "tandem_load_choice",
            "Always 1: one series per serving lever, labelled with the value the executor chose at load.",
            (*m, "lever", "value"),
            registry=r,
        )
        self._last: dict[str, float] = {}

    # ------------------------------------------------------------------ per request
    def observe_finished(self, finish_reason: str, timing: Timing | None) -> None:
        if self.vllm is not None:
            self.vllm.observe_finished(finish_reason, timing)
        self.finished.labels(**self._model, finish_reason=finish_reason).inc()
        if timing is None:
            return
        if timing.ttft_ms > 0:
            self.ttft.observe(timing.ttft_ms / 1000.0)
        if timing.tpot_ms > 0:
            self.tpot.observe(timing.tpot_ms / 1000.0)
        self.e2e.observe(timing.total_ms / 1000.0)
        self.queue_time.observe(timing.queue_ms / 1000.0)

    def observe_error(self, code_name: str) -> None:
        self.errors.labels(**self._model, code=code_name).inc()

    def observe_inter_token(self, seconds: float) -> None:
        if self.vllm is not None:
            self.vllm.observe_inter_token(seconds)
        self.itl.observe(seconds)

    # ------------------------------------------------------------------ engine-wide
    def observe_stats(self, stats: Any) -> None:
        """Refresh gauges and advance counters from an `EngineStats` snapshot."""
        if self.vllm is not None:
            self.vllm.observe_stats(stats)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.kv_cached.set(stats.kv_blocks_cached)
        self.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total > 0 else 0.0)
        self.threads_active.set(stats.threads_active)
        if stats.others_cpu_busy is not None:
            self.others_cpu_busy.set(stats.others_cpu_busy)
        for name, counter in (
            ("num_preemptions", self.preemptions),
            ("prompt_tokens_total", self.prompt_tokens),
            ("generation_tokens_total", self.generation_tokens),
            ("cached_prompt_tokens_total", self.cached_prompt_tokens),
            ("prefix_cache_hit_tokens", self.prefix_hits),
            ("prefix_cache_queried_tokens", self.prefix_queries),
            ("spec_verify_steps_total", self.spec_verify_steps),
            ("spec_draft_tokens_total", self.spec_draft_tokens),
            ("spec_accepted_tokens_total", self.spec_accepted_tokens),
            ("spec_emitted_tokens_total", self.spec_emitted_tokens),
        ):
            value = float(getattr(stats, name))
            delta = value - self._last.get(name, 0.0)
            if delta > 0:
                counter.inc(delta)
            self._last[name] = value

    def observe_model(self, info: Any) -> None:
        """Once, when the engine is built: what its weights and its KV pool occupy (`EngineInfo`)."""
        if self.vllm is not None:
            self.vllm.observe_model(info)
        labels = {**self._model, "dtype": info.dtype, "quantization": info.quantization}
        self.weight_bytes.labels(**labels).set(info.weight_bytes)
        kv = {**self._model, "kv_cache_dtype": info.kv_cache_dtype}
        self.kv_cache_bytes.labels(**kv).set(info.kv_cache_bytes)
        self.kv_bytes_per_token.labels(**kv).set(info.kv_bytes_per_token)
        self.compile_seconds.set(info.compile_seconds)
        for choice in info.load_plan:
            self.load_choice.labels(**self._model, lever=choice.lever, value=choice.value).set(1)

    def observe_admission(self, requests: int, tokens: int) -> None:
        self.admission_queue.set(requests)
        self.admission_queue_tokens.set(tokens)

    def observe_tokenizer(self, pending_chars: int, tokenized_chars_total: int) -> None:
        """The `TokenizeGate`'s meters: characters in flight now, and all characters tokenized so far."""
        self.tokenizer_pending.set(pending_chars)
        delta = tokenized_chars_total - self._last.get("tokenized_chars", 0.0)
        if delta > 0:
            self.tokenized_chars.inc(delta)
        self._last["tokenized_chars"] = float(tokenized_chars_total)

    # ------------------------------------------------------------------ exposition
    def render(self) -> bytes:
        """The Prometheus text format of every metric, without `_created` samples (what /metrics serves)."""
        return generate_latest(_WithoutCreated(self.registry, self._drop))


class MetricsHTTPServer:
    """/metrics over HTTP from the event loop, bounded in connections and time (see the module docstring)."""

    def __init__(self, render: Callable[[], bytes], *, max_connections: int = 32, timeout: float = 10.0) -> None:
        self._render = render
        self.max_connections = max_connections
        self.timeout = timeout
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.Task] = set()
        self.refused = 0
        """Connections closed on accept because `max_connections` were already open."""
        self.timed_out = 0
        """Connections closed because they had not finished within `timeout`."""

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def start(self, host: str, port: int) -> int:
        """Bind `host` (no brackets) and `port` (0: any free one); return the bound port."""
        from inference_svc.errors import ServerStartError
        from inference_svc.settings import host_port

        try:
            self._server = await asyncio.start_server(
                self._accept, host, port, reuse_address=True, limit=_MAX_REQUEST_HEAD_BYTES
            )
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ServerStartError(f"metrics: cannot listen on {host_port(host, port)}: {reason}") from None
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop accepting, close every open connection, wait for them."""
        if self._server is not None:
            self._server.close()
        for task in list(self._open):
            task.cancel()
        if self._open:
            await asyncio.gather(*self._open, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._open) >= self.max_connections:
            self.refused += 1
            writer.transport.abort()
            return
        self._open.add(task)
        try:
            await asyncio.wait_for(self._serve_one(reader, writer), self.timeout)
        except asyncio.TimeoutError:
            self.timed_out += 1
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, UnicodeError):
            pass  # the client went away or sent something that is not an HTTP request: nothing to answer
        finally:
            self._open.discard(task)
            writer.transport.abort()  # no-op after a clean close; drops whatever a stalled client did not read

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")  # at most _MAX_REQUEST_HEAD_BYTES (the reader's limit)
        method, _, rest = head.split(b"\r\n", 1)[0].decode("ascii").partition(" ")
        path = rest.split(" ", 1)[0].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            status, body, ctype = "405 Method Not Allowed", b"only GET and HEAD\n", "text/plain; charset=utf-8"
        elif path not in ("/metrics", "/"):
            status, body, ctype = "404 Not Found", b"not found; try /metrics\n", "text/plain; charset=utf-8"
        else:
            status, body, ctype = "200 OK", self._render(), CONTENT_TYPE_LATEST
        head_out = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
        writer.write((head_out + "Connection: close\r\n\r\n").encode("ascii"))
        if method != "HEAD":
            writer.write(body)
        writer.close()  # flushes what is buffered, then closes
        await writer.wait_closed()
