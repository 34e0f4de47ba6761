"""The serving process: one gRPC server and, beside it, the OpenAI-compatible HTTP API and /metrics, around one
engine stepped on its own thread; health, TLS, message-size limits, start-up and graceful shutdown.

Contract:
- The faces are peers that this process builds and starts: the gRPC `Inference` servicer
  (`inference_svc.grpc_service.servicer`, behind the wire guard `grpc_service.wire_guard` and the API-key check
  `grpc_service.auth`), the OpenAI HTTP app (`inference_svc.openai_api.app.build_app`) and the metrics endpoint.
  They share this process's `lifecycle`, `metrics`, `access_log`, `pooling`, engine and API keys; none starts
  another.
- Health (`grpc.health.v1`, overall "" and `tandem.inference.v1.Inference`) follows `self.lifecycle` (the one
  owner of the state, shared with the async engine and the HTTP API): NOT_SERVING from the moment the port is
  bound until the model is loaded and warmed up, SERVING then, NOT_SERVING again once draining starts or the
  engine is declared broken (a transition, not a poll).
  Requests that arrive before SERVING or while draining get UNAVAILABLE.
- API keys (optional): every RPC except `grpc.health.v1.Health/*`, and every HTTP route but health, needs
  `authorization: Bearer KEY` (`grpc_service.auth`); a gRPC call refused for its key is recorded here.
- The engine is loaded, compiled, warmed up and stepped on one thread (`inference_svc.engine_thread`), then
  wrapped in the `AsyncEngine` the faces call.
- Start-up: a gRPC, HTTP or metrics address that cannot be bound raises `ServerStartError` naming `HOST:PORT`
  (IPv6 written `[::1]:PORT`). /metrics listens on `metrics_host`, not on `host`.
- Message size: the transport refuses (RESOURCE_EXHAUSTED, without reading them) messages above 4×
  `max_request_bytes`; below that the wire guard refuses by byte count (`grpc_service.wire_guard`).
- Shutdown (`TandemServer.shutdown`, wired to SIGTERM/SIGINT by the CLI): health NOT_SERVING, new requests
  UNAVAILABLE, in-flight ones get `shutdown_grace` seconds, the rest end with UNAVAILABLE, then the ports close.
- While it serves, what the load built is frozen out of the garbage collector's full collections
  (`inference_svc.heap_freeze`: frozen just before SERVING, thawed when stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inference_svc import heap_freeze
from inference_svc.access_log import AccessLog, RequestRecord
from inference_svc.async_engine import AsyncEngine, FaultHook
from inference_svc.engine.config import EngineConfig
from inference_svc.engine.pooling import Pooling
from inference_svc.engine.types import EngineInfo
from inference_svc.engine_thread import EngineThread
from inference_svc.errors import AuthenticationError, ServerStartError
from inference_svc.grpc_service import SERVICE_NAME
from inference_svc.grpc_service.auth import DENIED, ApiKeyInterceptor, ApiKeys
from inference_svc.grpc_service.servicer import InferenceServicer, add_inference_service
from inference_svc.grpc_service.wire_guard import MalformedLog, MalformedRequestGuard
from inference_svc.lifecycle import Lifecycle, State
from inference_svc.metrics import MetricsHTTPServer, ServiceMetrics
from inference_svc.settings import ServerSettings, bare_host, host_port

log = logging.getLogger(__name__)


class TandemServer:
    """One gRPC server around one engine. `await start()`, then `await shutdown()` (or `wait_for_termination`)."""

    def __init__(
        self,
        settings: ServerSettings,
        engine_config: EngineConfig | None = None,
        *,
        engine: Any = None,
        fault_hook: FaultHook | None = None,
    ) -> None:
        self.settings = settings
        self.engine_config = engine_config or EngineConfig()
        self.metrics = ServiceMetrics(model_name=settings.model_name, names=settings.scale_out.metrics_names)
        self.access_log = AccessLog(self.metrics, settings.access_log)
        """Ends every request's record, HTTP and gRPC: its count and its access-log line."""
        self.engine: AsyncEngine | None = None
        self.pooling = Pooling()
        """How embeddings are pooled: read from the model folder at `start()` (HTTP and gRPC share it)."""
        self._prebuilt_engine = engine
        self._fault_hook = fault_hook
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._metrics_http: MetricsHTTPServer | None = None
        self.malformed_log = MalformedLog()
        """Rate-limits the servicer's malformed-request log lines (one per interval across calls)."""
        self.port = 0
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._http: Any = None
        self.lifecycle = Lifecycle()
        """The one owner of LOADING / SERVING / DRAINING / STOPPED / BROKEN; health follows its transitions."""
        self.lifecycle.on_change(self._health_follows)
        self._health_tasks: set[asyncio.Future] = set()
        self._stopped = asyncio.Event()
        self.kv_events: Any = None
        """The KV-cache event publisher (`inference_svc.kv_events.KVEventPublisher`) when enabled."""

    @property
    def serving(self) -> bool:
        return self.lifecycle.accepting

    @property
    def draining(self) -> bool:
        return self.lifecycle.draining

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    def _health_follows(self, state: State) -> None:
        """Lifecycle listener: gRPC health is SERVING exactly while the lifecycle is (set in this loop iteration)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if state is State.SERVING
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        if state is State.BROKEN:
            log.error("the engine is broken: health NOT_SERVING, new requests UNAVAILABLE")
        task = asyncio.ensure_future(self._set_health(status))
        self._health_tasks.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._health_tasks.discard)

    def _grpc_options(self) -> list[tuple[str, Any]]:
        transport_limit = 4 * self.settings.max_request_bytes
        return [
            ("grpc.max_receive_message_length", transport_limit),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.so_reuseport", 0),
        ]

    async def start(self) -> None:
        """Bind the port (health NOT_SERVING), load + warm up the engine, then SERVING."""
        s = self.settings
        self.lifecycle.bind(asyncio.get_running_loop())
        self.pooling = Pooling.from_folder(s.model)  # a malformed declaration fails the start, naming its file
        interceptors: list[grpc.aio.ServerInterceptor] = []
        keys = s.read_keys()
        api_keys = ApiKeys(keys) if keys else None  # one key set for both faces: gRPC and HTTP (peers, below)
        if api_keys is not None:

            def denied(method: str) -> None:  # refused before any handler: its record ends here
                record = RequestRecord("grpc", method.rsplit("/", 1)[-1], method.lstrip("/"))
                record.fail(AuthenticationError(DENIED))
                self.access_log.finish(record)

            interceptors.append(ApiKeyInterceptor(api_keys, on_denied=denied))  # first: the key before the bytes
        servicer = InferenceServicer(self)
        interceptors.append(MalformedRequestGuard(servicer.reject_unread))
        server = grpc.aio.server(interceptors=interceptors, options=self._grpc_options())
        add_inference_service(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = host_port(s.host, s.port)
        check_bindable(s.host, s.port, "gRPC")
        try:
            if s.tls:
                assert s.tls_cert is not None and s.tls_key is not None
                with open(s.tls_key, "rb") as f_key, open(s.tls_cert, "rb") as f_cert:
                    creds = grpc.ssl_server_credentials([(f_key.read(), f_cert.read())])
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # grpc raises a bare RuntimeError ("Failed to bind") when the port is taken
            self.port = 0
        if self.port == 0:
            raise ServerStartError(f"gRPC: cannot listen on {address} (address in use or not available)")
        self._server = server
        await server.start()
        if s.metrics_port is not None:
            http = MetricsHTTPServer(
                self.metrics.render, max_connections=s.metrics_max_connections, timeout=s.metrics_timeout
            )
            self.metrics_port = await http.start(bare_host(s.metrics_host), s.metrics_port)
            self._metrics_http = http
        if s.http_port is not None:
            await self._start_http(api_keys)
        log.info(
            "listening on %s (tls=%s, api keys=%s), HTTP %s, metrics %s",
            host_port(s.host, self.port), s.tls, api_keys is not None,
            "off" if self.http_port is None else "on " + host_port(s.host, self.http_port),
            "off" if self.metrics_port is None else "on " + host_port(s.metrics_host, self.metrics_port),
        )  # fmt: skip

        # the model is loaded, compiled, warmed up and stepped on one thread (why: inference_svc.engine_thread)
        thread = EngineThread()
        try:
            engine = self._prebuilt_engine
            if engine is None:
                from inference_svc.engine.engine import Engine

                engine = await thread.run(Engine.from_bundle, s.model, self.engine_config)
            await self._start_kv_events(engine)
            async_engine = AsyncEngine(
                engine, s.admission, self.metrics, fault_hook=self._fault_hook, lifecycle=self.lifecycle, thread=thread
            )
            if s.warmup:
                t0 = time.perf_counter()
                await thread.run(async_engine.warmup)
                log.info("warmed up in %.2f s", time.perf_counter() - t0)
            if self.lifecycle.state is not State.LOADING:  # SIGTERM while loading: shutdown() is already under way
                thread.close()  # nothing was started: no engine loop, no tokenizer process
                return
            self.metrics.observe_stats(engine.stats())
            info = engine.info()
            self.metrics.observe_model(info)
            log.info("load plan: %s", info.load_plan.summary())
            a = s.admission
            log.info("admission: max_queue=%d max_queue_tokens=%d burst_window=%g ms", a.max_queued_requests,
                     a.max_queued_tokens, a.burst_window_ms)  # fmt: skip
            await async_engine.start()
        except BaseException:
            thread.close()
            await self._close_kv_events()
            raise
        self.engine = async_engine
        t0 = time.perf_counter()
        frozen = heap_freeze.freeze_load()
        log.info("froze %d objects of the load out of full garbage collections in %.2f s", frozen,
                 time.perf_counter() - t0)  # fmt: skip
        self.lifecycle.to(State.SERVING)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("SERVING %s", s.model)

    async def _start_kv_events(self, engine: Any) -> None:
        """With `--kv-events-config` enabled: start the publisher and make it the block manager's event sink, before
        any request (warm-up included) can register a block (inference_svc.kv_events)."""
        from inference_svc.kv_events import KVEventPublisher, KVEventRecorder

        config = self.settings.scale_out.kv_events
        if not config.enabled:
            return
        publisher = KVEventPublisher(config, registry=self.metrics.registry, model_name=self.metrics.model_name)
        try:
            await asyncio.to_thread(publisher.start)
        except ValueError as exc:
            raise ServerStartError(str(exc)) from None
        self.kv_events = publisher
        names = None if engine.lora is None else engine.lora.name_of_salt
        engine.block_manager.events = KVEventRecorder(publisher, engine.block_manager.block_size, names)
        log.info("KV-cache events on %s (replay %s)", publisher.endpoint, publisher.replay_endpoint or "off")

    async def _close_kv_events(self) -> None:
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.close)

    async def _start_http(self, api_keys: ApiKeys | None) -> None:
        """The OpenAI-compatible API on `host:http_port`, over the same engine (503 until SERVING): a peer of the
        gRPC servicer, checking the same keys."""
        from inference_svc.chat_template import ChatTemplate
        from inference_svc.openai_api.app import ApiOptions, build_app
        from inference_svc.openai_api.http_server import HttpServer

        s = self.settings
        options = ApiOptions(
            model_name=s.model_name,
            max_request_bytes=s.max_request_bytes,
            body_timeout=s.http_body_timeout,
            serve_metrics=s.metrics_port is not None and bare_host(s.host) == bare_host(s.metrics_host),
            check_key=None if api_keys is None else api_keys.denial,
            chat_template=ChatTemplate.from_folder(s.model, s.chat_template),
            chat_template_timeout=s.http.chat_template_timeout,
            strict_request_fields=s.openai_api.strict_request_fields,
            reasoning_parser=s.openai_api.reasoning_parser,
            pooling=self.pooling,
            tool_call_parser=s.tool_call_parser,
        )
        http = HttpServer(
            build_app(self, options),
            s.host,
            s.http_port or 0,
            max_connections=s.http.max_connections,
            max_per_client=s.http.max_connections_per_client,
            head_timeout=s.http.head_timeout,
            tls_cert=s.tls_cert,
            tls_key=s.tls_key,
        )
        check_bindable(s.host, s.http_port or 0, "HTTP")
        self.http_port = await http.start()
        self._http = http

    async def shutdown(self, grace: float | None = None) -> int:
        """Drain and stop; return how many in-flight requests were cut at the end of the grace period."""
        if self.draining:
            await self._stopped.wait()
            return 0
        grace = self.settings.shutdown_grace if grace is None else grace
        self.lifecycle.to(State.DRAINING)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        cut = 0
        if self.engine is not None:
            log.info("draining %d in-flight requests (grace %.1f s)", self.engine.num_in_flight, grace)
            cut = await self.engine.drain(grace)
            await self.engine.stop()
        await self._close_kv_events()
        if self._http is not None:
            with contextlib.suppress(Exception):
                await self._http.close(1.0)
        if self._server is not None:
            await self._server.stop(1.0)
        if self._metrics_http is not None:
            with contextlib.suppress(Exception):
                await self._metrics_http.close()
        heap_freeze.thaw()
        self.lifecycle.to(State.STOPPED)
        self._stopped.set()
        log.info("stopped (%d requests cut at the end of the grace period)", cut)
        return cut

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()

    def engine_info(self) -> EngineInfo | None:
        return self.engine.info if self.engine is not None else None


def check_bindable(host: str, port: int, what: str) -> None:
    """Raise `ServerStartError` naming `HOST:PORT` if a listening socket cannot be bound there right now.

    gRPC's own bind failure is a bare RuntimeError plus C-core log lines on stderr; trying a plain socket first
    turns the common cases (port in use, address not on this machine) into one clear message. Port 0 always
    binds."""
    if port == 0:
        return
    bare = bare_host(host)
    try:
        infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServerStartError(f"{what}: cannot listen on {host_port(host, port)}: {exc.strerror}") from None
    failures: list[OSError] = []
    for family, kind, proto, _canon, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                failures.append(exc)
                if exc.errno == errno.EADDRINUSE:
                    break
    in_use = [f for f in failures if f.errno == errno.EADDRINUSE]
    if in_use or (failures and len(failures) == len(infos)):  # 'localhost' may lack ::1: one family is enough
        exc = (in_use or failures)[0]
        raise ServerStartError(f"{what}: cannot listen on {host_port(host, port)}: {exc.strerror or exc}")
