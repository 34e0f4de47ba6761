"""The wire guard: what the server answers about a request's bytes before (or instead of) parsing them.

Contract:
- `safe_deserializer(message_class, max_bytes, prescreen)` never raises: more than `max_bytes` bytes get
  `InvalidRequestError` naming `request` from the count alone (never parsed); bytes `prescreen` refuses are not
  parsed either; bytes that are not the message (garbage, truncated fields, invalid UTF-8 in a string) get
  `MalformedRequestError` "malformed request: ...", without parser internals. Each comes back as an `Unread`
  the handler answers (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED for a tokenizer that is full).
- `last_field_length` reads a length-delimited field's byte length from the protobuf wire bytes, tags and lengths
  only (never the payloads), exactly as a parse would keep it (the last member of its oneof), or None when that
  cannot be told cheaply; the servicer's prescreens refuse a prompt too long to fit from it.
- `MalformedRequestGuard` gives the other services' unary-request RPCs (health `Check`/`Watch`) the same answer;
  `MalformedLog` writes at most one WARNING line per malformed request and one per interval overall, never a
  traceback and never the request bytes.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from inference_svc.errors import InferenceError, InvalidRequestError, MalformedRequestError
from inference_svc.grpc_service import SERVICE_NAME
from inference_svc.proto_gen import inference_pb2 as pb

log = logging.getLogger(__name__)


class Unread:
    """What the request deserializer returns instead of a message: bytes that are not a valid message of the RPC's
    type (`MalformedRequestError`), more of them than the server reads (`InvalidRequestError`), or a text the
    prescreen refuses from its length (`InvalidRequestError`, or `CapacityError` while the tokenizer is full)."""

    __slots__ = ("error",)

    def __init__(self, error: InferenceError) -> None:
        self.error = error


PROMPT_FIELD = pb.GenerateRequest.DESCRIPTOR.fields_by_name["prompt"].number
TEXT_FIELD = pb.TokenizeRequest.DESCRIPTOR.fields_by_name["text"].number
INPUT_FIELDS = frozenset(f.number for f in pb.GenerateRequest.DESCRIPTOR.oneofs_by_name["input"].fields)
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


def safe_deserializer(
    message_class: type[Message],
    max_bytes: int | None = None,
    prescreen: Callable[[bytes], InferenceError | None] | None = None,
) -> Callable[[bytes], Message | Unread]:
    """`message_class.FromString` that never raises: bad bytes, more than `max_bytes` of them (refused from their
    count, unparsed), or bytes `prescreen` refuses (unparsed) become an `Unread` the handler answers."""
    type_name = message_class.DESCRIPTOR.name

    def deserialize(raw: bytes) -> Message | Unread:
        if max_bytes is not None and len(raw) > max_bytes:
            return Unread(InvalidRequestError("request", f"the request is {len(raw)} bytes; the limit is {max_bytes}"))
        refusal = prescreen(raw) if prescreen is not None else None
        if refusal is not None:
            return Unread(refusal)
        try:
            return message_class.FromString(raw)
        except (DecodeError, UnicodeError) as exc:
            bad_utf8 = isinstance(exc, UnicodeError) or "UTF-8" in str(exc)
            reason = "invalid UTF-8 in a string field" if bad_utf8 else "the bytes do not parse as protobuf"
            return Unread(MalformedRequestError(type_name, reason))
        except Exception:  # whatever else the parser raises must not reach gRPC's UNKNOWN + traceback path
            return Unread(MalformedRequestError(type_name, "the bytes do not parse as protobuf"))

    return deserialize


class MalformedRequestGuard(grpc.aio.ServerInterceptor):
    """The same malformed-request answer for the other services' unary-request RPCs (health `Check`/`Watch`,
    which stay open without an API key): their deserializer is wrapped so bad bytes get INVALID_ARGUMENT from
    `reject`, never gRPC's UNKNOWN with a logged traceback. Inference handlers are built safe already
    (`servicer.add_inference_service`); request-streaming handlers (reflection) parse inside the servicer and are
    left."""

    def __init__(self, reject: Callable[[Unread, grpc.aio.ServicerContext], Any]) -> None:
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
                if isinstance(request, Unread):
                    await reject(request, context)
                async for message in behavior(request, context):
                    yield message

        else:

            async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
                if isinstance(request, Unread):
                    await reject(request, context)
                return await behavior(request, context)

        factory = (
            grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
        )
        return factory(
            guarded,
            request_deserializer=safe_deserializer(message_class),
            response_serializer=handler.response_serializer,
        )


class MalformedLog:
    """At most one WARNING line per malformed request, and at most one per `interval` seconds overall (of `clock`,
    monotonic seconds): a request `interval` or more after the last line gets one, saying how many were left
    unlogged since. Never a traceback, never the request bytes."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._suppressed = 0

    def note(self, peer: str, error: MalformedRequestError) -> None:
        with self._lock:
            now = self._clock()
            if now - self._last < self.interval:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        more = f" ({suppressed} more since the last such line)" if suppressed else ""
        log.warning("malformed request from %s: %s%s", peer, error, more)
