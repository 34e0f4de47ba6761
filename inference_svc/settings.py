"""Server settings: plain, frozen, validated dataclasses (no OmegaConf: the service starts without Lightning).

Contract:
- `ServerSettings` holds everything `tandem serve` takes besides the engine's own `EngineConfig`; `AdmissionLimits`
  holds the bounded-queue limits the async engine enforces. Every field is checked at construction; an invalid
  value raises `SettingsError` whose message (and `field` attribute) names the field.
- TLS needs both `tls_cert` and `tls_key`, or neither. Files named here must exist when the settings are built.
- Hosts (`host`, `metrics_host`) are an IP address (IPv6 with or without brackets: `::1` and `[::1]` are the same)
  or `localhost`. `bare_host` / `host_port` are the one place that turns them into a socket address or `HOST:PORT`.
- Metrics are exposed on `metrics_host` (loopback by default), never implicitly on the gRPC `host`: /metrics is
  plaintext and unauthenticated, so making it reachable from elsewhere is an explicit choice.
- `ScaleOutSettings` (a section of `ServerSettings`) holds what a replica publishes for routers: the metric
  families (`metrics_names`) and the KV-cache event stream. `OpenAIApiSettings` (another section) holds the
  OpenAI-compatible API's request-field policy and output parsers.
- Nothing here reads files' contents or opens sockets; `server.py` does that.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from inference_svc.errors import InferenceError
from inference_svc.openai_api.reasoning import REASONING_PARSERS

if TYPE_CHECKING:
    from inference_svc.kv_events import KVEventsConfig


class SettingsError(InferenceError, ValueError):
    """A server setting has an invalid value; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def bare_host(host: str) -> str:
    """`host` without IPv6 brackets, as sockets take it: '[::1]' → '::1'; '127.0.0.1' and 'localhost' unchanged."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_port(host: str, port: int) -> str:
    """`HOST:PORT` as gRPC targets, URLs and log lines write it: IPv6 in brackets ('[::1]:50051')."""
    bare = bare_host(host)
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def _check_host(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise SettingsError(name, f"must be a host name or address, got {value!r}")
    bare = bare_host(value)
    if bare == "localhost":
        return
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        raise SettingsError(name, f"must be an IP address or 'localhost', got {value!r}") from None
    if bare != value and address.version != 6:
        raise SettingsError(name, f"brackets are for IPv6 addresses only, got {value!r}")


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SettingsError(name, f"must be an integer >= {minimum}, got {value!r}")


def _check_port(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 65535:
        raise SettingsError(name, f"must be a port number in [0, 65535] (0 = any free port), got {value!r}")


BURST_WINDOW_SPAN = 20
"""The longest wait for a burst, in burst windows (`AdmissionLimits.burst_window_ms`): 20 ms at the default 1 ms."""
MAX_BURST_WINDOW_MS = 1000.0


@dataclass(frozen=True)
class AdmissionLimits:
    """The bounded queue in front of the engine: requests admitted but not yet producing tokens."""

    max_queued_requests: int = 256
    """Most requests waiting for their first token (queued or prefilling); one more gets RESOURCE_EXHAUSTED."""
    max_queued_tokens: int = 262144
    """Most prompt tokens summed over those waiting requests; a request that would exceed it is refused."""
    max_tokenizing_chars: int = 2 * 1024 * 1024
    """Most characters of long texts being tokenized at once (prompts and Tokenize calls summed, one at a time in
    a tokenizer process at lower CPU priority: about 1 s of one core per million characters); beyond it a request
    gets RESOURCE_EXHAUSTED before any work is done (before it is parsed when its bytes prove it), and a single
    text longer than this gets INVALID_ARGUMENT."""

    burst_window_ms: float = 1.0
    """An idle engine's first step waits for a burst: after the first request, the engine loop goes on taking the
    requests that follow, each within this many milliseconds of the one before, for at most
    `BURST_WINDOW_SPAN` times this in all. Requests sent together (a client's concurrent batch) are then prefilled
    in one step instead of the first arrivals' step making the others wait for it (TTFT at 16 streams:
    docs/benchmarks.md §33). A lone request after an idle spell starts this much later. 0: at once."""

    def __post_init__(self) -> None:
        _check_int("max_queued_requests", self.max_queued_requests, 1)
        _check_int("max_queued_tokens", self.max_queued_tokens, 1)
        _check_int("max_tokenizing_chars", self.max_tokenizing_chars, 1)
        w = self.burst_window_ms
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= MAX_BURST_WINDOW_MS:
            raise SettingsError(
                "burst_window_ms", f"must be a number of milliseconds in [0, {MAX_BURST_WINDOW_MS:g}], got {w!r}"
            )


METRIC_NAMES = ("tandem", "vllm", "both")
"""The metric families /metrics can export (`ScaleOutSettings.metrics_names`)."""


@dataclass(frozen=True)
class ScaleOutSettings:
    """What one replica publishes for the routers and scrapers in front of several (docs/scale-out.md)."""

    metrics_names: str = "both"
    """Metric families /metrics exports: tandem (`tandem_*`), vllm (vLLM's `vllm:*` names, which the Gateway API
    Inference Extension's endpoint picker reads) or both."""
    kv_events_config: str | None = None
    """KV-cache events as vLLM publishes them, configured by the JSON vLLM's flag takes, e.g.
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}'. None:
    no events (see inference_svc/kv_events.py and docs/scale-out.md)."""

    def __post_init__(self) -> None:
        if self.metrics_names not in METRIC_NAMES:
            raise SettingsError(
                "metrics_names", f"must be one of {', '.join(METRIC_NAMES)}, got {self.metrics_names!r}"
            )
        if self.kv_events_config is not None:
            try:
                self.kv_events  # noqa: B018  # parsed and validated
            except ValueError as exc:
                raise SettingsError("kv_events_config", str(exc)) from None

    @property
    def kv_events(self) -> KVEventsConfig:
        """`kv_events_config` parsed (disabled when it is None)."""
        from inference_svc.kv_events import KVEventsConfig

        if self.kv_events_config is None:
            return KVEventsConfig()
        return KVEventsConfig.from_json(self.kv_events_config)


@dataclass(frozen=True)
class HttpLimits:
    """How the OpenAI-compatible HTTP listener bounds its connections and chat-template rendering."""

    max_connections: int = 1024
    """Most HTTP connections open at once. A new one beyond it closes the oldest connection still waiting for a
    request head; when none is waiting it gets 503."""
    max_connections_per_client: int = 512
    """Most HTTP connections open at once from one IP address; beyond it that address's oldest connection still
    waiting for a request head is closed (503 when none is waiting). Half the total by default: one address can
    hold at most half the slots, and a load generator on one host may keep up to this many requests in flight."""
    head_timeout: float = 5.0
    """Seconds an HTTP connection may take to send a complete request head, from its accept or its previous
    response; then it is closed (408 when part of a head had arrived)."""
    chat_template_timeout: float = 5.0
    """Seconds the chat template may take to render one request (in the tokenizer process); a slower render is
    stopped and the request gets 400 naming chat_template."""

    def __post_init__(self) -> None:
        _check_int("max_connections", self.max_connections, 1)
        _check_int("max_connections_per_client", self.max_connections_per_client, 1)
        for name in ("head_timeout", "chat_template_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise SettingsError(name, f"must be seconds > 0, got {value!r}")


@dataclass(frozen=True)
class OpenAIApiSettings:
    """How the OpenAI-compatible HTTP API treats request fields and model output (docs/api.md)."""

    strict_request_fields: bool = False
    """Answer a request field the API does not know with 400 naming it, instead of ignoring it and naming it once in
    the log (vLLM's behaviour, the default)."""

    reasoning_parser: str | None = None
    """Move a chat answer's <think>...</think> block into message.reasoning_content (delta.reasoning_content when
    streaming): qwen3 (a block the output opens) or deepseek_r1 (the template opened it); None: off, the block stays
    in the content (see inference_svc/openai_api/reasoning.py)."""

    def __post_init__(self) -> None:
        if not isinstance(self.strict_request_fields, bool):
            raise SettingsError("strict_request_fields", f"must be true or false, got {self.strict_request_fields!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise SettingsError(
                "reasoning_parser", f"must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}"
            )


@dataclass(frozen=True)
class ServerSettings:
    """How `tandem serve` listens, protects itself and shuts down."""

    model: str
    """Tandem bundle or Hugging Face Llama/Qwen2/Qwen3 folder."""
    host: str = "127.0.0.1"
    """Interface to bind. Loopback unless told otherwise."""
    port: int = 50051
    """gRPC port (0: any free port; the bound one is logged and available as `TandemServer.port`)."""
    metrics_port: int | None = 9464
    """Prometheus /metrics HTTP port; None disables it; 0 picks a free port. (Not 9090: Prometheus's own.)"""
    http_port: int | None = 8000
    """OpenAI-compatible HTTP API port on `host`; None disables it; 0 picks a free port."""
    chat_template: str | None = None
    """A Jinja chat template file used instead of the model folder's own (`chat_template`)."""
    tool_call_parser: str | None = None
    """How tool calls are read from chat output (vLLM's `--tool-call-parser`): "hermes" (Qwen2.5/Qwen3, Hermes:
    `<tool_call>` JSON blocks) or "llama3_json" (Llama 3.1 JSON calls); None: tool calls are not parsed, and a
    request whose `tool_choice` is not "none" gets 400."""
    http_body_timeout: float = 30.0
    """Seconds an HTTP request body may take to arrive; a slower (or stalled) client gets 408 and is dropped."""
    metrics_host: str = "127.0.0.1"
    """Interface the /metrics HTTP server binds, independent of `host`: loopback unless told otherwise, because
    /metrics is plaintext and unauthenticated. Set it (e.g. 0.0.0.0 inside a container) only where the scraper
    needs it and the network is trusted."""
    metrics_max_connections: int = 32
    """Most /metrics connections served at once; one more is closed at once (no thread is ever started per
    connection)."""
    metrics_timeout: float = 10.0
    """Seconds a /metrics connection may take from accept to the end of the response; then it is closed."""
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    """Bounded-queue limits."""
    http: HttpLimits = field(default_factory=HttpLimits)
    """HTTP connection and chat-template bounds."""
    max_request_bytes: int = 1024 * 1024
    """Largest serialized request the service accepts (INVALID_ARGUMENT above it). The transport limit is set to
    4× this, so a request up to there gets the named INVALID_ARGUMENT; above it gRPC itself answers
    RESOURCE_EXHAUSTED without reading it."""
    shutdown_grace: float = 30.0
    """Seconds in-flight requests get to finish after SIGTERM; what is left then ends with UNAVAILABLE."""
    tls_cert: str | None = None
    """PEM certificate chain; TLS is on when this and tls_key are set."""
    tls_key: str | None = None
    """PEM private key of tls_cert."""
    api_key_file: str | None = None
    """File with one API key per line ('#' comments and blank lines ignored). Set: every RPC but health needs
    metadata `authorization: Bearer KEY`."""
    api_keys: tuple[str, ...] = ()
    """API keys given directly (`--api-key KEY`, repeatable), accepted beside those of `api_key_file`."""
    warmup: bool = True
    """Run one tiny request through the engine before reporting SERVING."""
    access_log: bool = True
    """Write one INFO line per request, HTTP and gRPC alike, to the `tandem.access` logger (method, route or RPC,
    status, request id, peer, tokens in and out, latency). Health checks and /metrics are not logged."""
    served_model_name: str | None = None
    """The name clients use for the model (OpenAI's `model` field, GetModelInfo, metrics); None: the folder's
    own name."""
    scale_out: ScaleOutSettings = field(default_factory=ScaleOutSettings)
    """Metric names and KV-cache events for routers in front of several replicas."""
    openai_api: OpenAIApiSettings = field(default_factory=OpenAIApiSettings)
    """Request-field policy and output parsing of the OpenAI-compatible API."""

    @property
    def model_name(self) -> str:
        """The served model name: `served_model_name`, or the model folder's own name (never its path)."""
        return self.served_model_name or os.path.basename(os.path.abspath(self.model))

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise SettingsError("model", "a model folder is required")
        if not Path(self.model).is_dir():
            raise SettingsError("model", f"{self.model!r} is not a folder")
        _check_host("host", self.host)
        _check_host("metrics_host", self.metrics_host)
        _check_port("port", self.port)
        _check_port("metrics_port", self.metrics_port, allow_none=True)
        _check_port("http_port", self.http_port, allow_none=True)
        _check_int("metrics_max_connections", self.metrics_max_connections, 1)
        if not isinstance(self.metrics_timeout, (int, float)) or not self.metrics_timeout > 0:
            raise SettingsError("metrics_timeout", f"must be seconds > 0, got {self.metrics_timeout!r}")
        if not isinstance(self.http_body_timeout, (int, float)) or not self.http_body_timeout > 0:
            raise SettingsError("http_body_timeout", f"must be seconds > 0, got {self.http_body_timeout!r}")
        if not isinstance(self.admission, AdmissionLimits):
            raise SettingsError("admission", "must be an AdmissionLimits")
        if not isinstance(self.http, HttpLimits):
            raise SettingsError("http", "must be an HttpLimits")
        if not isinstance(self.scale_out, ScaleOutSettings):
            raise SettingsError("scale_out", "must be a ScaleOutSettings")
        if not isinstance(self.openai_api, OpenAIApiSettings):
            raise SettingsError("openai_api", "must be an OpenAIApiSettings")
        _check_int("max_request_bytes", self.max_request_bytes, 1024)
        if self.max_request_bytes * 4 > 2**31 - 1:
            raise SettingsError("max_request_bytes", "must be below 512 MiB")
        if not isinstance(self.shutdown_grace, (int, float)) or not self.shutdown_grace >= 0:
            raise SettingsError("shutdown_grace", f"must be seconds >= 0, got {self.shutdown_grace!r}")
        if not isinstance(self.access_log, bool):
            raise SettingsError("access_log", f"must be true or false, got {self.access_log!r}")
        if self.served_model_name is not None and (
            not isinstance(self.served_model_name, str) or not self.served_model_name.strip()
        ):
            raise SettingsError("served_model_name", f"must be a non-empty name, got {self.served_model_name!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "tls_key" if self.tls_key is None else "tls_cert"
            raise SettingsError(missing, "TLS needs both --tls-cert and --tls-key")
        if not isinstance(self.api_keys, tuple) or not all(
            isinstance(k, str) and k and k == k.strip() and k.isprintable() for k in self.api_keys
        ):
            raise SettingsError("api_keys", "each key must be a non-empty printable string without surrounding spaces")
        if self.tool_call_parser not in (None, "hermes", "llama3_json"):
            raise SettingsError("tool_call_parser", f"one of hermes, llama3_json, got {self.tool_call_parser!r}")
        for name in ("tls_cert", "tls_key", "api_key_file", "chat_template"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                raise SettingsError(name, f"{value!r} is not a readable file")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def read_keys(self) -> tuple[bytes, ...]:
        """Every accepted API key: `api_keys` and the lines of `api_key_file` (read now); () when keys are off."""
        from_file = read_api_keys(self.api_key_file) if self.api_key_file is not None else ()
        return tuple(dict.fromkeys((*(k.encode() for k in self.api_keys), *from_file)))


def read_api_keys(path: str | Path) -> tuple[bytes, ...]:
    """Keys from an API-key file: one per line, surrounding whitespace stripped, '#' comments and blanks skipped."""
    keys = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line.encode())
    if not keys:
        raise SettingsError("api_key_file", f"{path} holds no key")
    return tuple(keys)
