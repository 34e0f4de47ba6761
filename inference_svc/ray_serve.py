"""Tandem on Ray Serve: N engine replicas behind Ray Serve's own prefix-affinity request router, with the OpenAI
routes (`tandem serve-ray`, or `build_app(...)` in your own Serve application; `pip install 'tandem[ray]'`).

Contract:
- `build_app(model, replicas=2, ...)` returns a Serve `Application` of two deployments:
  `TandemReplica` (`replicas` copies; each holds one whole Tandem server: engine, prefix cache, OpenAI app, gRPC on
  a loopback port of its own) and `TandemIngress` (one copy, no CPU reserved: the HTTP entry). The ingress turns
  each HTTP request into a `RoutedRequest` whose `prompt` is the text to route by (a completion's prompt, a chat's
  message contents concatenated, token ids written as text) and calls `TandemReplica.handle` through a handle whose
  deployment uses Ray Serve's `PrefixCacheAffinityRouter` (`prefix_affinity_router()`): requests whose text
  shares a long prefix go to the replica that served that prefix before (whose prefix cache then holds it), unless
  the replicas' queues differ by more than `imbalanced_threshold`; below `match_rate_threshold` of the text
  matched, to the replica that has seen the least text.
- A replica serves the request with the same OpenAI app as `tandem serve` (in-process ASGI, no extra hop): same
  validation, errors, SSE format. Every response carries `x-tandem-replica` (the serving replica's Serve id).
  `TandemReplica.stats()` returns its id and its engine's `EngineStats` as a dict; `check_health` fails once the
  engine is broken, so Serve replaces the replica.
- A replica that dies (killed, crashed, node lost): a request not yet started on it is retried on another replica
  (at most `RETRIES` times); a stream already under way on it ends with one `data: {"error": ...}` event (code
  UNAVAILABLE) and `data: [DONE]` (a non-streamed response that was cut is just ended), never hangs; Serve starts a
  replacement (its prefix cache starts empty).
- A client that disconnects cancels the call; the replica aborts the request and frees its KV blocks.
- `main(argv)` (`tandem serve-ray`) starts or joins Ray, runs the application on `--host:--port` and stops it on
  SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from inference_svc.engine.config import EngineConfig

log = logging.getLogger(__name__)

RETRIES = 2
"""How many times a request whose replica died before it started is sent to another replica."""
REPLICA_HEADER = "x-tandem-replica"


@dataclass(frozen=True)
class RoutedRequest:
    """One HTTP request as the ingress hands it to a replica. `prompt` is what the prefix router reads."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    prompt: str

    @classmethod
    def from_http(cls, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes) -> RoutedRequest:
        return cls(method, path, tuple(headers), body, routing_text(path, body))


def routing_text(path: str, body: bytes) -> str:
    """The text the prefix router matches: a completion's prompt, a chat's message contents in order, token ids as
    text; never empty (the router divides by its length)."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        data = None
    text = ""
    if isinstance(data, dict):
        if isinstance(data.get("messages"), list):
            text = "".join(_content_text(m.get("content")) for m in data["messages"] if isinstance(m, dict))
        elif "prompt" in data:
            text = _content_text(data["prompt"])
    return text or path


def _content_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return f"{value} "
    if isinstance(value, list):
        return "".join(_content_text(v) for v in value)
    if isinstance(value, dict):
        return _content_text(value.get("text", value.get("content")))
    return ""


# ---------------------------------------------------------------------------------------- in-process ASGI
async def asgi_stream(app: Any, request: RoutedRequest) -> AsyncIterator[Any]:
    """Run one request through an ASGI app in this event loop: yields `(status, headers)` first, then body chunks.
    Closing the iterator early tells the app the client disconnected (it aborts the request)."""
    messages: asyncio.Queue[dict] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False
    path, _, query = request.path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }  # fmt: skip

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put({"type": "tandem.done"})

    task = asyncio.ensure_future(run())
    try:
        while True:
            message = await messages.get()
            kind = message["type"]
            if kind == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield (message["status"], headers)
            elif kind == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
            elif kind == "tandem.done":
                break
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            except (asyncio.TimeoutError, Exception):
                task.cancel()
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.error("the OpenAI app failed", exc_info=task.exception())


# ---------------------------------------------------------------------------------------- deployments
class TandemReplica:
    """One Tandem server inside a Serve replica (see the module docstring)."""

    async def __init__(
        self,
        model: str,
        engine_config: EngineConfig,
        served_model_name: str | None = None,
        fault_hook: Callable | None = None,
    ) -> None:
        from ray import serve

        from inference_svc.chat_template import ChatTemplate
        from inference_svc.openai_api.app import ApiOptions
        from inference_svc.openai_api.app import build_app as build_openai_app
        from inference_svc.server import TandemServer
        from inference_svc.settings import ServerSettings

        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        settings = ServerSettings(
            model=model, host="127.0.0.1", port=0, http_port=None, metrics_port=None,
            served_model_name=served_model_name, shutdown_grace=5.0,
        )  # fmt: skip
        self.server = TandemServer(settings, engine_config, fault_hook=fault_hook)
        await self.server.start()
        options = ApiOptions(
            model_name=settings.model_name,
            max_request_bytes=settings.max_request_bytes,
            body_timeout=settings.http_body_timeout,
            chat_template=ChatTemplate.from_folder(model, settings.chat_template),
            pooling=self.server.pooling,
        )
        self.app = build_openai_app(self.server, options)
        log.info("replica %s serving %s", self.replica_id, model)

    async def handle(self, request: RoutedRequest) -> AsyncIterator[Any]:
        """The request through the OpenAI app: `(status, headers, replica id)` first, then body chunks."""
        async for item in asgi_stream(self.app, request):
            if isinstance(item, tuple):
                status, headers = item
                yield (status, headers, self.replica_id)
            else:
                yield item

    async def stats(self) -> dict[str, Any]:
        engine = self.server.engine
        assert engine is not None
        return {"replica": self.replica_id, **dataclasses.asdict(await engine.stats())}

    def check_health(self) -> None:
        engine = self.server.engine
        if engine is None or not engine.healthy:
            raise RuntimeError("the engine is broken")

    async def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            await server.shutdown(1.0)


class TandemIngress:
    """The HTTP entry: forwards each request to a replica chosen by the prefix-affinity router."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica.options(stream=True)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        from inference_svc.errors import EngineStoppedError
        from inference_svc.openai_api.handling import error_body

        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        routed = RoutedRequest.from_http(request.method, path, list(request.headers.items()), body)
        for attempt in range(RETRIES + 1):
            stream = self.replica.handle.remote(routed)
            try:
                status, headers, replica_id = await stream.__anext__()
                break
            except Exception as exc:
                if not _replica_died(exc) or attempt == RETRIES:
                    status_code, payload = error_body(EngineStoppedError(f"no replica could serve it ({exc})"))
                    return JSONResponse(payload, status_code=status_code)
                log.warning("a replica died before serving %s %s; retrying on another", request.method, path)
        kept = {k: v for k, v in headers if k.lower() not in ("content-length", "transfer-encoding")}
        kept[REPLICA_HEADER] = replica_id
        is_sse = kept.get("content-type", "").startswith("text/event-stream")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            except Exception as exc:
                if not _replica_died(exc):
                    log.exception("the stream from %s failed", replica_id)
                if is_sse:
                    _, payload = error_body(EngineStoppedError(f"the replica serving this stream stopped ({exc})"))
                    yield b"data: " + json.dumps(payload).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"

        media = kept.pop("content-type", None)
        return StreamingResponse(chunks(), status_code=status, headers=kept, media_type=media)


def _replica_died(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError))


def prefix_affinity_router() -> type:
    """Ray Serve's `PrefixCacheAffinityRouter`: the public `ray.serve.llm.request_router` name when its module
    imports (it needs `ray[llm]`'s dependencies, pyarrow among them), else the same class where Ray defines it."""
    try:
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter
    except ImportError:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
            PrefixCacheAffinityRouter,
        )
    return PrefixCacheAffinityRouter


def build_app(
    model: str,
    *,
    replicas: int = 2,
    engine_config: EngineConfig | None = None,
    served_model_name: str | None = None,
    num_cpus: float = 1.0,
    max_ongoing_requests: int = 64,
    imbalanced_threshold: float = float("inf"),
    match_rate_threshold: float = 0.1,
    fault_hook: Callable | None = None,
) -> Any:
    """The Serve application (see the module docstring). `fault_hook` is the test-only hook of `TandemServer`."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    router_class = prefix_affinity_router()
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    router = RequestRouterConfig(
        request_router_class=router_class,
        request_router_kwargs={
            "imbalanced_threshold": imbalanced_threshold,
            "match_rate_threshold": match_rate_threshold,
        },
    )
    threads = str(max(1, int(num_cpus)))
    replica = serve.deployment(
        TandemReplica,
        name="TandemReplica",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        request_router_config=router,
        ray_actor_options={
            "num_cpus": num_cpus,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}},
        },
        health_check_period_s=5,
    )
    ingress = serve.deployment(
        TandemIngress, name="TandemIngress", num_replicas=1, ray_actor_options={"num_cpus": 0}
    )  # fmt: skip
    return ingress.bind(replica.bind(model, engine_config or EngineConfig(), served_model_name, fault_hook))


# ---------------------------------------------------------------------------------------- tandem serve-ray
def _parser() -> argparse.ArgumentParser:
    from inference_svc.cli import ENGINE_FLAGS
    from inference_svc.dataclass_flags import add_flags

    p = argparse.ArgumentParser(
        prog="tandem serve-ray",
        description="Serve a model as N replicas on Ray Serve, behind its prefix-affinity router (OpenAI routes).",
    )
    p.add_argument("--model", required=True, help="Tandem bundle or Hugging Face Llama/Qwen2/Qwen3 folder")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP interface of Serve's proxy (default: loopback)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of Serve's proxy")
    p.add_argument("--served-model-name", default=None, help="the model's name in requests and responses")
    p.add_argument("--num-cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    p.add_argument(
        "--imbalanced-threshold", type=float, default=float("inf"),
        help="queue-length difference above which the router ignores prefixes (default: never)",
    )  # fmt: skip
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_flags(p.add_argument_group("engine (inference_svc.engine.config.EngineConfig)"), EngineConfig, ENGINE_FLAGS)
    return p


def main(argv: Sequence[str]) -> int:
    import ray
    from ray import serve

    from inference_svc.cli import _resolve_dtype
    from inference_svc.dataclass_flags import from_args
    from inference_svc.errors import InferenceError

    parser = _parser()
    args = parser.parse_args(list(argv))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not os.path.isdir(args.model):
        parser.error(f"--model: {args.model!r} is not a folder")
    try:
        engine_config = from_args(EngineConfig, args, dtype=_resolve_dtype(args.dtype, args.device))
        app = build_app(
            os.path.abspath(args.model), replicas=args.replicas, engine_config=engine_config,
            served_model_name=args.served_model_name, num_cpus=args.num_cpus_per_replica,
            imbalanced_threshold=args.imbalanced_threshold,
        )  # fmt: skip
    except (InferenceError, ValueError) as exc:
        parser.error(str(exc))
    ray.init(address=args.ray_address, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="tandem", route_prefix="/")
    log.info("tandem serve-ray: %d replicas on http://%s:%d", args.replicas, args.host, args.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0
