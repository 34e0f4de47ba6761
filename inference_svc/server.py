"""The gRPC server: a thin servicer between `tandem.inference.v1` messages and the engine, plus health, reflection,
API keys, TLS, message-size limits, metrics and graceful shutdown.

Contract:
- Status codes come from `inference_svc.status` (the one table the HTTP API shares); `status_for` gives an
  exception's gRPC code. Anything not in it is INTERNAL with a generic message (the details go to the log with
  the request id, never to the client) and fails that request alone.
- The servicer converts proto ↔ engine types and nothing else: validation lives in `SamplingParams` and
  `Engine.add_request`; scheduling, admission and cancellation in `AsyncEngine`.
- Health (`grpc.health.v1`, overall "" and `tandem.inference.v1.Inference`) follows `self.lifecycle` (the one
  owner of the state, shared with the async engine and the HTTP API): NOT_SERVING from the moment the port is
  bound until the model is loaded and warmed up, SERVING then, NOT_SERVING again once draining starts or the
  engine is declared broken (a transition, not a poll).
  Requests that arrive before SERVING or while draining get UNAVAILABLE.
- API keys (optional): every RPC except `grpc.health.v1.Health/*` needs metadata `authorization: Bearer KEY`,
  else UNAUTHENTICATED. More than one `authorization` entry is ambiguous and refused (UNAUTHENTICATED saying so).
  Keys are compared in constant time (SHA-256 digests through `hmac.compare_digest`, so not even the length
  leaks) and never logged. The key is checked before the request body is parsed: an unauthenticated client gets
  UNAUTHENTICATED whatever bytes it sends.
- Malformed requests (bytes that are not the RPC's message: garbage, truncated fields, invalid UTF-8 in a string)
  to any Inference RPC, or to health `Check`/`Watch` (`MalformedRequestGuard`), get INVALID_ARGUMENT
  "malformed request: ...", without parser internals, counted in `tandem_request_errors`
  like any error, and logged as one WARNING line at most, rate-limited across calls (`_MalformedLog`).
- Every Inference RPC is one `RequestRecord` (`inference_svc.access_log`, the outcome table HTTP shares), ended
  once when the call is done: counted in `tandem_request_errors` when not OK, and one `tandem.access` line. An RPC
  that ends without a status sent by the server (client cancel or disconnect at any point after the handler
  started: while admitted, decoding, or between two streamed messages) is DEADLINE_EXCEEDED if its deadline had
  passed or was within `DEADLINE_SLACK_S` (the client's timer fires first: its cancel arrives before the server's
  own deadline by about the request's transit time), else CANCELLED. Errors the server answers are recorded where
  it answers them (`_fail`), never twice. (A call cancelled before gRPC has even read its request never reaches
  the service and is not counted.)
- `GetModelInfo.model_name` is the served model name (`--served-model-name`, by default the model folder's own
  name), never its path on the server; it also reports the HTTP and metrics ports.
- Start-up: a gRPC or metrics address that cannot be bound raises `ServerStartError` naming
  `HOST:PORT` (IPv6 written `[::1]:PORT`). /metrics listens on `metrics_host`, not on `host`.
- Message size: Inference requests of more than `max_request_bytes` get INVALID_ARGUMENT naming `request`, from
  the byte count alone (they are never parsed); the transport refuses (RESOURCE_EXHAUSTED, without reading them)
  messages above 4× that. A Generate whose text prompt has more than 4 bytes per character of the engine's
  character limit (`AsyncEngine.max_prompt_chars`) cannot fit, whatever it holds: it is refused from the prompt
  field's length on the wire (`last_field_length` reads tags and lengths only), before the message is parsed and
  the prompt becomes a `str`, with INVALID_ARGUMENT naming `prompt`. Shorter ones are parsed and checked by
  character count, before tokenizing. In the same way a Generate prompt or a Tokenize text too long for the
  tokenizer's budget right now (`TokenizeGate.refusal`, from the least characters its bytes can hold) gets
  RESOURCE_EXHAUSTED unparsed, as its text would once parsed (while the server drains, it is parsed and gets
  UNAVAILABLE).
- A long text's Tokenize response is built and serialized where it is tokenized, in the gate's tokenizer process
  (`tokenizer_jobs.tokenize_response`), and passed on as bytes: a 300k-token answer costs the server's process
  no GIL time beyond the copy.
- Shutdown (`TandemServer.shutdown`, wired to SIGTERM/SIGINT by the CLI): health NOT_SERVING, new requests
  UNAVAILABLE, in-flight ones get `shutdown_grace` seconds, the rest end with UNAVAILABLE, then the port closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import functools
import hashlib
import hmac
import inspect
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from inference_svc import tokenizer_jobs
from inference_svc.access_log import AccessLog, RequestRecord
from inference_svc.async_engine import AsyncEngine, FaultHook
from inference_svc.embeddings import MAX_EMBEDDING_INPUTS, embed
from inference_svc.engine.config import EngineConfig
from inference_svc.engine.pooling import Pooling
from inference_svc.engine.types import Completion, EngineInfo, RequestOutput
from inference_svc.engine_thread import EngineThread
from inference_svc.errors import (
    AuthenticationError,
    ClientGoneError,
    DeadlineExceededError,
    EngineStoppedError,
    InferenceError,
    InvalidRequestError,
    MalformedRequestError,
    ServerStartError,
)
from inference_svc.lifecycle import Lifecycle, State
from inference_svc.metrics import MetricsHTTPServer, ServiceMetrics
from inference_svc.proto_convert import (
    lora_adapters_to_proto,
    model_info_to_proto,
    n_from_proto,
    prompt_from_proto,
    response_from,
    sampling_from_proto,
    stream_message,
)
from inference_svc.proto_gen import inference_pb2 as pb
from inference_svc.proto_gen import inference_pb2_grpc as pb_grpc
from inference_svc.settings import ServerSettings, bare_host, host_port
from inference_svc.status import status_of

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"


DEADLINE_SLACK_S = 0.05
"""A call cut with at most this many seconds left before its deadline was cut by the deadline (see the module
docstring)."""

_RECORD: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("tandem_grpc_record", default=None)
"""The record of the Inference RPC whose handler runs in this task (set by `_guarded`)."""


def cut_by_deadline(remaining: float | None) -> bool:
    """Whether a call cut by its client with `remaining` seconds left (None: no deadline) was cut by its deadline."""
    return remaining is not None and remaining <= DEADLINE_SLACK_S


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and client-facing message of an exception (`inference_svc.status`'s one table)."""
    status, message = status_of(exc)
    return status.grpc, message


# ---------------------------------------------------------------------------------------- servicer
class InferenceServicer(pb_grpc.InferenceServicer):
    """proto ↔ engine; every failure goes through `status_for`."""

    def __init__(self, owner: TandemServer) -> None:
        self._owner = owner

    @property
    def max_request_bytes(self) -> int:
        return self._owner.settings.max_request_bytes

    # -- helpers
    def _engine(self) -> AsyncEngine:
        engine = self._owner.engine
        lifecycle = self._owner.lifecycle
        if engine is None or not lifecycle.accepting:
            raise EngineStoppedError(lifecycle.refusal() or "the engine is not running")
        return engine

    async def _fail(self, context: grpc.aio.ServicerContext, exc: BaseException, rid: str = "") -> None:
        code, message = status_for(exc)
        if code == grpc.StatusCode.INTERNAL and not getattr(exc, "logged", False):
            log.error("request %s failed: %r", rid or "-", exc, exc_info=exc)
        record = _RECORD.get()
        if record is not None:
            record.fail(exc)  # counted when the call is done (`on_rpc_done`)
        else:  # not an Inference RPC (a malformed health check): no record, counted here
            self._owner.metrics.observe_error(code.name)
        await context.abort(code, message)

    def on_rpc_done(self, record: RequestRecord, context: grpc.aio.ServicerContext) -> None:
        """Done-callback of every Inference RPC: end its record, as CANCELLED or DEADLINE_EXCEEDED when it ended
        with no status sent by the server.

        gRPC sends no status when the call was cancelled by the client (or its deadline) at any point, and the
        CancelledError may be raised inside gRPC's own write between two streamed messages rather than in the
        handler, so this, not an `except CancelledError` in the handler, is the one place that sees cancels."""
        if not context.done():  # no status sent: the client (or its deadline) cut the call
            remaining = context.time_remaining()
            if cut_by_deadline(remaining):
                record.fail(DeadlineExceededError("the client's deadline passed"))
            else:
                record.fail(ClientGoneError("the client cancelled the call"))
        self._owner.access_log.finish(record)

    def prescreen_generate(self, raw: bytes) -> InferenceError | None:
        """Before a GenerateRequest is parsed: the error when its text prompt's byte length alone proves it cannot
        fit the loaded engine's context, or cannot pass the tokenizer's budget now (parsing would copy and decode
        it first, holding the GIL); else None."""
        return self._prescreen(raw, _PROMPT_FIELD, _INPUT_FIELDS, "prompt", context=True)

    def prescreen_tokenize(self, raw: bytes) -> InferenceError | None:
        """Before a TokenizeRequest is parsed: the error when its text's byte length alone proves it cannot pass
        the tokenizer's budget now; else None."""
        return self._prescreen(raw, _TEXT_FIELD, frozenset({_TEXT_FIELD}), "text", context=False)

    def _prescreen(
        self, raw: bytes, number: int, oneof: frozenset[int], field: str, context: bool
    ) -> InferenceError | None:
        engine = self._owner.engine
        if engine is None or len(raw) <= engine.prescreen_bytes:  # too short to refuse whatever it holds: parse it
            return None
        length = last_field_length(raw, number, oneof)
        return None if length is None else engine.refuse_unparsed(length, field, context=context)

    async def reject_unread(self, request: _Unread, context: grpc.aio.ServicerContext) -> None:
        """The error for a request the deserializer did not hand over (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED for a
        tokenizer that is full); counted; bytes that did not parse also get one rate-limited log line."""
        if isinstance(request.error, MalformedRequestError):
            self._owner.malformed_log.note(context.peer(), request.error)
        await self._fail(context, request.error)

    def _start(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[RequestOutput]:
        engine = self._engine()
        prompt = prompt_from_proto(request)
        sampling = sampling_from_proto(request.sampling, request.lora_name)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        n = n_from_proto(request.sampling)
        return engine.generate(prompt, sampling, request_id=request.request_id, deadline=deadline, n=n)

    # -- RPCs
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        try:
            outputs = self._start(request, context)
            completions: dict[int, Completion] = {}
            rid = request.request_id
            record = _RECORD.get()
            async for out in outputs:
                rid = out.request_id
                completions.setdefault(out.index, Completion(out.request_id, out.index)).add(out)
                _count_tokens(record, out)
            return response_from(rid, [completions[i] for i in sorted(completions)])
        except Exception as exc:
            await self._fail(context, exc, request.request_id)
            raise  # unreachable: abort raises

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            outputs = self._start(request, context)
            record = _RECORD.get()
            try:
                async for out in outputs:
                    _count_tokens(record, out)
                    if out.new_token_ids or out.text_delta or out.finished:
                        yield stream_message(out)
            finally:
                await outputs.aclose()  # type: ignore[attr-defined]  # abort now, not at garbage collection
        except Exception as exc:
            await self._fail(context, exc, request.request_id)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            text = request.text
            # built where the tokenizer runs (its process, for a long text); the serializer passes the bytes on
            return await self._engine().tokenizer_work(
                len(text), tokenizer_jobs.tokenize_response, text, request.add_bos, field="text"
            )
        except Exception as exc:
            await self._fail(context, exc)
            raise

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        try:
            if not 1 <= len(request.inputs) <= MAX_EMBEDDING_INPUTS:
                raise InvalidRequestError(
                    "inputs", f"holds {len(request.inputs)} inputs; 1 to {MAX_EMBEDDING_INPUTS} are accepted"
                )
            inputs: list[str | list[int]] = []
            for i, item in enumerate(request.inputs):
                kind = item.WhichOneof("input")
                if kind is None:
                    raise InvalidRequestError(f"inputs[{i}]", "set text or token_ids")
                inputs.append(item.text if kind == "text" else list(item.token_ids.ids))
            pooling = self._owner.pooling
            vectors, tokens = await embed(
                self._engine(), inputs, pooling, request.dimensions or None, "inputs"
            )  # [N, H']
            record = _RECORD.get()
            if record is not None:
                record.tokens_in = tokens
            return pb.EmbedResponse(
                embeddings=[pb.Embedding(values=row.tolist()) for row in vectors],
                prompt_tokens=tokens,
                pooling=pooling.mode + ("+normalize" if pooling.normalize else ""),
            )
        except Exception as exc:
            await self._fail(context, exc)
            raise

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        try:
            engine = self._engine()
            owner = self._owner
            info = model_info_to_proto(
                engine.info, owner.settings.max_request_bytes, owner.settings.model_name, owner.http_port,
                owner.metrics_port,
            )  # fmt: skip
            adapters, info.max_loras = lora_adapters_to_proto(engine.engine.lora)
            info.lora_adapters.extend(adapters)
            return info
        except Exception as exc:
            await self._fail(context, exc)
            raise


def _count_tokens(record: RequestRecord | None, out: RequestOutput) -> None:
    if record is not None:
        record.tokens_in = out.usage.prompt_tokens
        record.tokens_out += len(out.new_token_ids)


# ---------------------------------------------------------------------------------------- registration
class _Unread:
    """What the request deserializer returns instead of a message: bytes that are not a valid message of the RPC's
    type (`MalformedRequestError`), more of them than the server reads (`InvalidRequestError`), or a text the
    prescreen refuses from its length (`InvalidRequestError`, or `CapacityError` while the tokenizer is full)."""

    __slots__ = ("error",)

    def __init__(self, error: InferenceError) -> None:
        self.error = error


def _serialize(message: Message | bytes) -> bytes:
    """A response serializer that passes on what a handler serialized itself (`Tokenize`, in pieces)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


_PROMPT_FIELD = pb.GenerateRequest.DESCRIPTOR.fields_by_name["prompt"].number
_TEXT_FIELD = pb.TokenizeRequest.DESCRIPTOR.fields_by_name["text"].number
_INPUT_FIELDS = frozenset(f.number for f in pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"].fields)
SCAN_FIELDS = 64
"""`last_field_length` reads at most this many top-level fields; a message with more is parsed in full."""


def last_field_length(raw: bytes, number: int, oneof: frozenset[int], max_fields: int = SCAN_FIELDS) -> int | None:
    """The byte length of field `number` (length-delimited) as a parse of the protobuf wire bytes `raw` would keep
    it: the last of the fields of its `oneof` set, which must be `number`. Only tags and lengths are read, never
    the payloads. None when that is not the outcome or cannot be told cheaply: another member of the oneof comes
    last, none is present, the bytes are not well-formed wire data (a member with another wire type included),
    or there are more than `max_fields` fields."""
    pos, end, last, length = 0, len(raw), None, None
    try:
        for _ in range(max_fields):
            if pos == end:
                return length if last == number else None
            key, pos = _varint(raw, pos)
            field, wire = key >> 3, key & 7
            if field == 0 or (field in oneof and wire != 2):  # invalid, or a oneof member the parser skips
                return None
            if wire == 0:
                _, pos = _varint(raw, pos)
            elif wire == 2:
                size, pos = _varint(raw, pos)
                if field in oneof:
                    last, length = field, size
                pos += size
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:  # groups (3, 4) and invalid types: leave it to the parser
                return None
            if pos > end:
                return None
    except IndexError:
        return None
    return None


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of the base-128 varint at `pos`; IndexError when it runs off the end."""
    value = shift = 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def _safe_deserializer(
    message_class: type[Message],
    max_bytes: int | None = None,
    prescreen: Callable[[bytes], InferenceError | None] | None = None,
) -> Callable[[bytes], Message | _Unread]:
    """`message_class.FromString` that never raises: bad bytes, more than `max_bytes` of them (refused from their
    count, unparsed), or bytes `prescreen` refuses (unparsed) become an `_Unread` the handler answers."""
    type_name = message_class.DESCRIPTOR.name

    def deserialize(raw: bytes) -> Message | _Unread:
        if max_bytes is not None and len(raw) > max_bytes:
            return _Unread(InvalidRequestError("request", f"the request is {len(raw)} bytes; the limit is {max_bytes}"))
        refusal = prescreen(raw) if prescreen is not None else None
        if refusal is not None:
            return _Unread(refusal)
        try:
            return message_class.FromString(raw)
        except (DecodeError, UnicodeError) as exc:
            bad_utf8 = isinstance(exc, UnicodeError) or "UTF-8" in str(exc)
            reason = "invalid UTF-8 in a string field" if bad_utf8 else "the bytes do not parse as protobuf"
            return _Unread(MalformedRequestError(type_name, reason))
        except Exception:  # whatever else the parser raises must not reach gRPC's UNKNOWN + traceback path
            return _Unread(MalformedRequestError(type_name, "the bytes do not parse as protobuf"))

    return deserialize


def _guarded(servicer: InferenceServicer, method: Callable, streaming: bool, name: str) -> Callable:
    """Wrap one servicer method: a `RequestRecord` ended when the call is done (`on_rpc_done`), malformed requests
    answered."""

    def begin(request: Any, context: grpc.aio.ServicerContext) -> None:
        record = RequestRecord("grpc", name, f"{SERVICE_NAME}/{name}", peer=context.peer())
        record.request_id = getattr(request, "request_id", "") or "-"
        _RECORD.set(record)  # this handler's task only
        context.add_done_callback(functools.partial(servicer.on_rpc_done, record))

    if streaming:

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            begin(request, context)
            if isinstance(request, _Unread):
                await servicer.reject_unread(request, context)
                return
            inner = method(request, context)
            try:
                async for message in inner:
                    yield message
            finally:
                await inner.aclose()  # the servicer's own cleanup (engine abort) runs now, not at collection

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        begin(request, context)
        if isinstance(request, _Unread):
            await servicer.reject_unread(request, context)
        return await method(request, context)

    return unary


def add_inference_service(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Register the Inference service like the generated `add_InferenceServicer_to_server`, but with
    `_safe_deserializer` (bounded by `max_request_bytes`), `_serialize` and `_guarded` handlers (same method names,
    types and streaming kinds)."""
    max_bytes = servicer.max_request_bytes
    service = pb.DESCRIPTOR.services_by_name["Inference"]
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    prescreens = {pb.GenerateRequest: servicer.prescreen_generate, pb.TokenizeRequest: servicer.prescreen_tokenize}
    for m in service.methods:
        request_class = getattr(pb, m.input_type.name)
        assert not m.client_streaming, "no Inference RPC streams requests"
        factory = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = factory(
            _guarded(servicer, getattr(servicer, m.name), m.server_streaming, m.name),
            request_deserializer=_safe_deserializer(request_class, max_bytes, prescreens.get(request_class)),
            response_serializer=_serialize,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


class MalformedRequestGuard(grpc.aio.ServerInterceptor):
    """The same malformed-request answer for the other services' unary-request RPCs (health `Check`/`Watch`,
    which stay open without an API key): their deserializer is wrapped so bad bytes get INVALID_ARGUMENT from
    `reject`, never gRPC's UNKNOWN with a logged traceback. Inference handlers are built safe already
    (`add_inference_service`); request-streaming handlers (reflection) parse inside the servicer and are left."""

    def __init__(self, reject: Callable[[_Unread, grpc.aio.ServicerContext], Any]) -> None:
        self._reject = reject

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # sync handlers: none registered here
        message_class = getattr(handler.request_deserializer, "__self__", None)
        if not (isinstance(message_class, type) and issubclass(message_class, Message)):
            return handler
        reject = self._reject
        if inspect.isasyncgenfunction(behavior):

            async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Unread):
                    await reject(request, context)
                async for message in behavior(request, context):
                    yield message

        else:

            async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
                if isinstance(request, _Unread):
                    await reject(request, context)
                return await behavior(request, context)

        factory = (
            grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
        )
        return factory(
            guarded,
            request_deserializer=_safe_deserializer(message_class),
            response_serializer=handler.response_serializer,
        )


class _MalformedLog:
    """At most one WARNING line per malformed request, and at most one per `interval` seconds overall: the next
    line after a quiet spell says how many were left unlogged. Never a traceback, never the request bytes."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._suppressed = 0

    def note(self, peer: str, error: MalformedRequestError) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        more = f" ({suppressed} more since the last such line)" if suppressed else ""
        log.warning("malformed request from %s: %s%s", peer, error, more)


# ---------------------------------------------------------------------------------------- API keys
def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every RPC but health unless `authorization: Bearer KEY` carries a configured key."""

    def __init__(self, keys: Sequence[bytes], on_denied: Callable[[str], None] | None = None) -> None:
        self._digests = tuple(_digest(k) for k in keys)
        self._on_denied = on_denied

    def denial(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """Why this metadata is refused (the client-facing message), or None if it carries a configured key."""
        values = [v for key, v in metadata or () if key.lower() == "authorization"]
        if len(values) > 1:
            return "ambiguous authorization: send exactly one 'authorization: Bearer KEY' header, not several"
        value = values[0] if values else ""
        value = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        scheme, _, presented = value.partition(" ")
        digest = _digest(presented.strip().encode())
        ok = False
        for d in self._digests:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(digest, d)
        if ok and scheme.lower() == "bearer":
            return None
        return _DENIED

    def authorized(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        return self.denial(metadata) is None

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        if handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return await continuation(handler_call_details)
        reason = self.denial(handler_call_details.invocation_metadata)
        if reason is None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if self._on_denied is not None:
            self._on_denied(handler_call_details.method)
        return _denying_handler(handler, reason)


_DENIED = "missing or invalid API key (authorization: Bearer KEY)"


def _ignore_body(raw: bytes) -> None:
    """The denying handler's deserializer: an unauthenticated request's bytes are never parsed."""
    return None


def _denying_handler(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    async def deny(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    kwargs = {"request_deserializer": _ignore_body, "response_serializer": handler.response_serializer}
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
        self.malformed_log = _MalformedLog()
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
        keys_check: ApiKeyInterceptor | None = None
        keys = s.read_keys()
        if keys:

            def denied(method: str) -> None:  # refused before any handler: its record ends here
                record = RequestRecord("grpc", method.rsplit("/", 1)[-1], method.lstrip("/"))
                record.fail(AuthenticationError(_DENIED))
                self.access_log.finish(record)

            keys_check = ApiKeyInterceptor(keys, on_denied=denied)
            interceptors.append(keys_check)  # first: the key before the bytes
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
            await self._start_http(keys_check)
        log.info(
            "listening on %s (tls=%s, api keys=%s), HTTP %s, metrics %s",
            host_port(s.host, self.port), s.tls, keys_check is not None,
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
            await async_engine.start()
        except BaseException:
            thread.close()
            await self._close_kv_events()
            raise
        self.engine = async_engine
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

    async def _start_http(self, keys_check: ApiKeyInterceptor | None) -> None:
        """The OpenAI-compatible API on `host:http_port`, over the same engine (503 until SERVING)."""
        from inference_svc.chat_template import ChatTemplate
        from inference_svc.openai_api.app import ApiOptions, build_app
        from inference_svc.openai_api.http_server import HttpServer

        s = self.settings
        check = None
        if keys_check is not None:
            check = lambda values: keys_check.denial([("authorization", v) for v in values])  # noqa: E731
        options = ApiOptions(
            model_name=s.model_name,
            max_request_bytes=s.max_request_bytes,
            body_timeout=s.http_body_timeout,
            serve_metrics=s.metrics_port is not None and bare_host(s.host) == bare_host(s.metrics_host),
            check_key=check,
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
