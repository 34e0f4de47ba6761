"""The gRPC server: a thin servicer between `tandem.inference.v1` messages and the engine, plus health, reflection,
API keys, TLS, message-size limits, metrics and graceful shutdown.

Contract:
- `STATUS_CODES` is the ONE table mapping exceptions to gRPC status codes; `status_for` walks an exception's MRO
  through it. Anything not in it is INTERNAL with a generic message (the details go to the log with the request
  id, never to the client) and fails that request alone.
- The servicer converts proto ↔ engine types and nothing else: validation lives in `SamplingParams` and
  `Engine.add_request`; scheduling, admission and cancellation in `AsyncEngine`.
- Health (`grpc.health.v1`, overall "" and `tandem.inference.v1.Inference`): NOT_SERVING from the moment the port
  is bound until the model is loaded and warmed up, SERVING then, NOT_SERVING again once draining starts.
  Requests that arrive before SERVING or while draining get UNAVAILABLE.
- API keys (optional): every RPC except `grpc.health.v1.Health/*` needs metadata `authorization: Bearer KEY`,
  else UNAUTHENTICATED. Keys are compared in constant time (SHA-256 digests through `hmac.compare_digest`, so not
  even the length leaks) and never logged.
- Message size: requests whose serialized size is above `max_request_bytes` get INVALID_ARGUMENT naming `request`;
  the transport refuses (RESOURCE_EXHAUSTED, without reading them) messages above 4× that.
- Shutdown (`TandemServer.shutdown`, wired to SIGTERM/SIGINT by the CLI): health NOT_SERVING, new requests
  UNAVAILABLE, in-flight ones get `shutdown_grace` seconds, the rest end with UNAVAILABLE, then the port closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inference_svc.async_engine import AsyncEngine, FaultHook
from inference_svc.engine.config import EngineConfig
from inference_svc.engine.types import FinishReason, RequestOutput, SamplingParams, Timing, Usage
from inference_svc.errors import (
    CapacityError,
    DeadlineExceededError,
    EngineStoppedError,
    InvalidRequestError,
    RequestFailedError,
)
from inference_svc.metrics import ServiceMetrics
from inference_svc.proto_gen import inference_pb2 as pb
from inference_svc.proto_gen import inference_pb2_grpc as pb_grpc
from inference_svc.settings import ServerSettings, read_api_keys

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"

STATUS_CODES: dict[type[BaseException], grpc.StatusCode] = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    EngineStoppedError: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    RequestFailedError: grpc.StatusCode.INTERNAL,
}
"""Exception class → status code. The only place in the package that chooses status codes."""

_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and client-facing message of an exception (INTERNAL + a generic message if unknown)."""
    for cls in type(exc).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, "internal error while serving this request"


# ---------------------------------------------------------------------------------------- conversions
_SAMPLING_OPTIONAL = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty")


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    """proto SamplingParams → engine SamplingParams (unset optional fields take the engine defaults)."""
    kwargs: dict[str, Any] = {name: getattr(s, name) for name in _SAMPLING_OPTIONAL if s.HasField(name)}
    return SamplingParams(
        **kwargs,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
    )


def prompt_from_proto(request: pb.GenerateRequest) -> str | list[int]:
    which = request.WhichOneof("input")
    if which == "prompt":
        return request.prompt
    if which == "prompt_token_ids":
        return list(request.prompt_token_ids.ids)
    raise InvalidRequestError("prompt", "set either prompt (text) or prompt_token_ids")


def usage_to_proto(u: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                    cached_prompt_tokens=u.cached_prompt_tokens)  # fmt: skip


def timing_to_proto(t: Timing | None) -> pb.Timing:
    t = t or Timing()
    return pb.Timing(queue_ms=t.queue_ms, ttft_ms=t.ttft_ms, tpot_ms=t.tpot_ms, total_ms=t.total_ms)


def stream_message(out: RequestOutput) -> pb.GenerateStreamResponse:
    msg = pb.GenerateStreamResponse(
        request_id=out.request_id, text=out.text_delta, token_ids=out.new_token_ids, logprobs=out.logprobs or []
    )
    if out.finished:
        msg.finish_reason = _FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
        msg.usage.CopyFrom(usage_to_proto(out.usage))
        msg.timing.CopyFrom(timing_to_proto(out.timing))
    return msg


def model_info_to_proto(info: dict[str, Any], max_request_bytes: int) -> pb.ModelInfo:
    mc = info["model_config"]
    typed = {k: mc[k] for k in pb.ModelConfig.DESCRIPTOR.fields_by_name if k in mc and k != "config_json"}
    config = pb.ModelConfig(
        **typed, num_parameters=info.get("num_parameters", 0), config_json=json.dumps(mc, sort_keys=True)
    )
    typed_ledger = ("weight_bytes", "kv_bytes_per_token", "kv_cache_bytes", "kv_capacity_tokens", "kv_blocks_total")
    extra = {
        k: float(v)
        for k, v in info.items()
        if k.endswith("_bytes") and isinstance(v, (int, float)) and k not in typed_ledger
    }
    extra.update(_ledger_figures(info))
    ledger = pb.MemoryLedger(
        **{k: int(info.get(k, 0)) for k in typed_ledger}, kv_block_size=int(info.get("block_size", 0)), extra=extra
    )
    return pb.ModelInfo(
        model_name=str(info.get("model_path", "")),
        config=config,
        max_context=int(info.get("max_model_len", 0)),
        dtype=str(info.get("dtype", "")),
        attention_backend=str(info.get("attention_backend", "")),
        device=str(info.get("device", "")),
        kv_capacity_tokens=int(info.get("kv_capacity_tokens", 0)),
        ledger=ledger,
        max_new_tokens_limit=int(info.get("max_new_tokens_limit", 0)),
        max_request_bytes=max_request_bytes,
    )


def _ledger_figures(info: dict[str, Any]) -> dict[str, float]:
    """The shared memory ledger's formulas for the served model at its max context (one sequence)."""
    from shared_model.config import ModelConfig
    from shared_model.ledger import ledger_report

    try:
        mc = dict(info["model_config"])
        if mc.get("rope_scaling") is not None:
            return {}
        config = ModelConfig(**{**mc, "eos_token_ids": tuple(mc.get("eos_token_ids") or ())})
        dtype = str(info.get("dtype", "float32"))
        rep = ledger_report(
            config, str(info.get("model_path", "")), context=max(1, int(info.get("max_model_len", 1))),
            kv_dtype=dtype, weight_dtype=dtype,
        )  # fmt: skip
    except Exception:  # the ledger is informative: never fail GetModelInfo because of it
        log.debug("ledger figures unavailable", exc_info=True)
        return {}
    return {
        "ledger.weight_bytes": float(rep.inference["weight_bytes"]),
        "ledger.kv_bytes_per_sequence_at_max_context": float(rep.kv_cache["bytes"]),
    }


# ---------------------------------------------------------------------------------------- servicer
class InferenceServicer(pb_grpc.InferenceServicer):
    """proto ↔ engine; every failure goes through `status_for`."""

    def __init__(self, owner: TandemServer) -> None:
        self._owner = owner

    # -- helpers
    def _engine(self) -> AsyncEngine:
        engine = self._owner.engine
        if engine is None or not self._owner.serving:
            raise EngineStoppedError(
                "the server is shutting down" if self._owner.draining else "the model is still loading"
            )
        return engine

    def _check_size(self, request: Any) -> None:
        limit = self._owner.settings.max_request_bytes
        size = request.ByteSize()
        if size > limit:
            raise InvalidRequestError("request", f"the request is {size} bytes; the limit is {limit}")

    async def _fail(self, context: grpc.aio.ServicerContext, exc: BaseException, rid: str = "") -> None:
        code, message = status_for(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("request %s failed: %r", rid or "-", exc, exc_info=exc)
        self._owner.metrics.observe_error(code.name)
        await context.abort(code, message)

    def _on_cancel(self, context: grpc.aio.ServicerContext) -> None:
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        self._owner.metrics.observe_error("DEADLINE_EXCEEDED" if expired else "CANCELLED")

    def _start(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[RequestOutput]:
        engine = self._engine()
        self._check_size(request)
        prompt = prompt_from_proto(request)
        sampling = sampling_from_proto(request.sampling)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        return engine.generate(prompt, sampling, request_id=request.request_id, deadline=deadline)

    # -- RPCs
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        try:
            response = pb.GenerateResponse(request_id=request.request_id)
            texts: list[str] = []
            async for out in self._start(request, context):
                response.request_id = out.request_id
                texts.append(out.text_delta)
                response.token_ids.extend(out.new_token_ids)
                response.logprobs.extend(out.logprobs or [])
                if out.finished:
                    response.finish_reason = _FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
                    response.usage.CopyFrom(usage_to_proto(out.usage))
                    response.timing.CopyFrom(timing_to_proto(out.timing))
            response.text = "".join(texts)
            return response
        except asyncio.CancelledError:
            self._on_cancel(context)
            raise
        except Exception as exc:
            await self._fail(context, exc, request.request_id)
            raise  # unreachable: abort raises

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            outputs = self._start(request, context)
            try:
                async for out in outputs:
                    if out.new_token_ids or out.text_delta or out.finished:
                        yield stream_message(out)
            finally:
                await outputs.aclose()  # type: ignore[attr-defined]  # abort now, not at garbage collection
        except asyncio.CancelledError:
            self._on_cancel(context)
            raise
        except Exception as exc:
            await self._fail(context, exc, request.request_id)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            engine = self._engine()
            self._check_size(request)
            ids = await engine.tokenize(request.text, add_bos=request.add_bos)
            tok = engine.engine.tokenizer
            return pb.TokenizeResponse(token_ids=ids, tokens=[tok.id_to_token(i) or "" for i in ids])
        except Exception as exc:
            await self._fail(context, exc)
            raise

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        try:
            engine = self._engine()
            return model_info_to_proto(engine.info, self._owner.settings.max_request_bytes)
        except Exception as exc:
            await self._fail(context, exc)
            raise


# ---------------------------------------------------------------------------------------- API keys
def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every RPC but health unless `authorization: Bearer KEY` carries a configured key."""

    def __init__(self, keys: Sequence[bytes], on_denied: Callable[[], None] | None = None) -> None:
        self._digests = tuple(_digest(k) for k in keys)
        self._on_denied = on_denied

    def authorized(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        value = ""
        for key, v in metadata or ():
            if key.lower() == "authorization":
                value = v.decode() if isinstance(v, bytes) else str(v)
        scheme, _, presented = value.partition(" ")
        digest = _digest(presented.strip().encode())
        ok = False
        for d in self._digests:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(digest, d)
        return ok and scheme.lower() == "bearer"

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        if handler_call_details.method.startswith(HEALTH_METHOD_PREFIX) or self.authorized(
            handler_call_details.invocation_metadata
        ):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if self._on_denied is not None:
            self._on_denied()
        return _denying_handler(handler)


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (authorization: Bearer KEY)")

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


# ---------------------------------------------------------------------------------------- the server
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
        self.metrics = ServiceMetrics()
        self.engine: AsyncEngine | None = None
        self._prebuilt_engine = engine
        self._fault_hook = fault_hook
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._metrics_http: Any = None
        self.port = 0
        self.metrics_port: int | None = None
        self.serving = False
        self.draining = False
        self._stopped = asyncio.Event()
        self._watch_task: asyncio.Task | None = None

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

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
        interceptors = []
        if s.api_key_file is not None:
            keys = read_api_keys(s.api_key_file)
            denied = lambda: self.metrics.observe_error("UNAUTHENTICATED")  # noqa: E731
            interceptors.append(ApiKeyInterceptor(keys, on_denied=denied))
        server = grpc.aio.server(interceptors=interceptors, options=self._grpc_options())
        pb_grpc.add_InferenceServicer_to_server(InferenceServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{s.host}:{s.port}"
        if s.tls:
            assert s.tls_cert is not None and s.tls_key is not None
            with open(s.tls_key, "rb") as f_key, open(s.tls_cert, "rb") as f_cert:
                creds = grpc.ssl_server_credentials([(f_key.read(), f_cert.read())])
            self.port = server.add_secure_port(address, creds)
        else:
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        self._server = server
        await server.start()
        if s.metrics_port is not None:
            self._metrics_http, self.metrics_port = self.metrics.serve_http(s.host, s.metrics_port)
        log.info("listening on %s:%d (tls=%s, api keys=%s)", s.host, self.port, s.tls, s.api_key_file is not None)

        engine = self._prebuilt_engine
        if engine is None:
            from inference_svc.engine.engine import Engine

            engine = await asyncio.to_thread(Engine.from_bundle, s.model, self.engine_config)
        async_engine = AsyncEngine(engine, s.admission, self.metrics, fault_hook=self._fault_hook)
        if s.warmup:
            t0 = time.perf_counter()
            await asyncio.to_thread(async_engine.warmup)
            log.info("warmed up in %.2f s", time.perf_counter() - t0)
        self.metrics.observe_stats(engine.stats())
        await async_engine.start()
        self.engine = async_engine
        if self.draining:  # SIGTERM while loading: shutdown() is already under way
            return
        self.serving = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._watch_task = asyncio.create_task(self._watch_health())
        log.info("SERVING %s", s.model)

    async def _watch_health(self) -> None:
        while self.serving:
            await self.refresh_health()
            await asyncio.sleep(1.0)

    async def refresh_health(self) -> None:
        """NOT_SERVING if the engine has been declared broken."""
        if self.engine is not None and not self.engine.healthy and self.serving:
            self.serving = False
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def shutdown(self, grace: float | None = None) -> int:
        """Drain and stop; return how many in-flight requests were cut at the end of the grace period."""
        if self.draining:
            await self._stopped.wait()
            return 0
        grace = self.settings.shutdown_grace if grace is None else grace
        self.draining = True
        self.serving = False
        if self._watch_task is not None:
            self._watch_task.cancel()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        cut = 0
        if self.engine is not None:
            log.info("draining %d in-flight requests (grace %.1f s)", self.engine.num_in_flight, grace)
            cut = await self.engine.drain(grace)
            await self.engine.stop()
        if self._server is not None:
            await self._server.stop(1.0)
        if self._metrics_http is not None:
            with contextlib.suppress(Exception):
                self._metrics_http.shutdown()
        self._stopped.set()
        log.info("stopped (%d requests cut at the end of the grace period)", cut)
        return cut

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()

    def engine_info(self) -> dict[str, Any]:
        return dict(self.engine.info) if self.engine is not None else {}


def settings_summary(settings: ServerSettings) -> dict[str, Any]:
    """Settings as a dict for logs (file paths only; never the keys)."""
    return asdict(settings)
