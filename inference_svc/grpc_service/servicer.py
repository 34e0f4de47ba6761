"""The Inference servicer: a thin layer between `tandem.inference.v1` messages and the async engine.

Contract:
- Status codes come from `inference_svc.status` (the one table the HTTP API shares); `status_for` gives an
  exception's gRPC code. Anything not in it is INTERNAL with a generic message (the details go to the log with
  the request id, never to the client) and fails that request alone.
- The servicer converts proto ↔ engine types and nothing else: validation lives in `SamplingParams` and
  `Engine.add_request`; scheduling, admission and cancellation in `AsyncEngine`. Requests that arrive while the
  owner's lifecycle does not accept them get UNAVAILABLE with its reason.
- `add_inference_service` registers it like the generated `add_InferenceServicer_to_server`, with the wire guard's
  deserializer (`wire_guard.safe_deserializer`, bounded by `max_request_bytes`, with the prescreens below) and
  handlers that answer an `Unread` request themselves.
- Every Inference RPC is one `RequestRecord` (`inference_svc.access_log`, the outcome table HTTP shares), ended
  once: counted in `tandem_request_errors` when not OK, and one `tandem.access` line. An error the server answers
  is recorded and its record ended where it is answered (`_fail`), before the status is sent: a client that has
  its error finds it counted in the next scrape (as HTTP does for a whole response: its record ends before the
  response is returned). Any other RPC's record ends when the call is done (`on_rpc_done`): an OK one, and one that ends
  without a status sent by the server (client cancel or disconnect at any point after the handler started: while
  admitted, decoding, or between two streamed messages), which is DEADLINE_EXCEEDED if its deadline had passed or
  was within `DEADLINE_SLACK_S` (the client's timer fires first: its cancel arrives before the server's own
  deadline by about the request's transit time), else CANCELLED. (A call cancelled before gRPC has even read its
  request never reaches the service and is not counted.)
- Prescreens: a Generate whose text prompt has more than 4 bytes per character of the engine's character limit
  (`AsyncEngine.max_prompt_chars`) cannot fit, whatever it holds: it is refused from the prompt field's length on
  the wire (`wire_guard.last_field_length`), before the message is parsed and the prompt becomes a `str`, with
  INVALID_ARGUMENT naming `prompt`. Shorter ones are parsed and checked by character count, before tokenizing. In
  the same way a Generate prompt or a Tokenize text too long for the tokenizer's budget right now
  (`TokenizeGate.refusal`, from the least characters its bytes can hold) gets RESOURCE_EXHAUSTED unparsed, as its
  text would once parsed (while the server drains, it is parsed and gets UNAVAILABLE).
- A long text's Tokenize response is built and serialized where it is tokenized, in the gate's tokenizer process
  (`tokenizer_jobs.tokenize_response`), and passed on as bytes: a 300k-token answer costs the server's process
  no GIL time beyond the copy.
- `GetModelInfo.model_name` is the served model name (`--served-model-name`, by default the model folder's own
  name), never its path on the server; it also reports the HTTP and metrics ports.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from inference_svc import tokenizer_jobs
from inference_svc.access_log import AccessLog, RequestRecord
from inference_svc.async_engine import AsyncEngine
from inference_svc.embeddings import MAX_EMBEDDING_INPUTS, embed
from inference_svc.engine.pooling import Pooling
from inference_svc.engine.types import Completion, RequestOutput
from inference_svc.errors import (
    ClientGoneError,
    DeadlineExceededError,
    EngineStoppedError,
    InferenceError,
    InvalidRequestError,
    MalformedRequestError,
)
from inference_svc.grpc_service import SERVICE_NAME
from inference_svc.grpc_service.wire_guard import (
    INPUT_FIELDS,
    PROMPT_FIELD,
    TEXT_FIELD,
    MalformedLog,
    Unread,
    last_field_length,
    safe_deserializer,
)
from inference_svc.lifecycle import Lifecycle
from inference_svc.metrics import ServiceMetrics
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
from inference_svc.settings import ServerSettings
from inference_svc.status import status_of

log = logging.getLogger(__name__)


class Owner(Protocol):
    """What the servicer needs from the process that runs it (`inference_svc.server.TandemServer`)."""

    settings: ServerSettings
    engine: AsyncEngine | None
    lifecycle: Lifecycle
    metrics: ServiceMetrics
    access_log: AccessLog
    malformed_log: MalformedLog
    pooling: Pooling
    http_port: int | None
    metrics_port: int | None


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


class InferenceServicer(pb_grpc.InferenceServicer):
    """proto ↔ engine; every failure goes through `status_for`."""

    def __init__(self, owner: Owner) -> None:
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
            record.fail(exc)
            self._owner.access_log.finish(record)  # counted before the status leaves (`on_rpc_done` finds it ended)
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
        return self._prescreen(raw, PROMPT_FIELD, INPUT_FIELDS, "prompt", context=True)

    def prescreen_tokenize(self, raw: bytes) -> InferenceError | None:
        """Before a TokenizeRequest is parsed: the error when its text's byte length alone proves it cannot pass
        the tokenizer's budget now; else None."""
        return self._prescreen(raw, TEXT_FIELD, frozenset({TEXT_FIELD}), "text", context=False)

    def _prescreen(
        self, raw: bytes, number: int, oneof: frozenset[int], field: str, context: bool
    ) -> InferenceError | None:
        engine = self._owner.engine
        if engine is None or len(raw) <= engine.prescreen_bytes:  # too short to refuse whatever it holds: parse it
            return None
        length = last_field_length(raw, number, oneof)
        return None if length is None else engine.refuse_unparsed(length, field, context=context)

    async def reject_unread(self, request: Unread, context: grpc.aio.ServicerContext) -> None:
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


def _serialize(message: Message | bytes) -> bytes:
    """A response serializer that passes on what a handler serialized itself (`Tokenize`, in pieces)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


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
            if isinstance(request, Unread):
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
        if isinstance(request, Unread):
            await servicer.reject_unread(request, context)
        return await method(request, context)

    return unary


def add_inference_service(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Register the Inference service like the generated `add_InferenceServicer_to_server`, but with
    `safe_deserializer` (bounded by `max_request_bytes`), `_serialize` and `_guarded` handlers (same method names,
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
            request_deserializer=safe_deserializer(request_class, max_bytes, prescreens.get(request_class)),
            response_serializer=_serialize,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
