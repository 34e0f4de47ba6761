"""Request handling shared by every OpenAI route: the plumbing between an HTTP request and a view.

Contract:
- `Handler.handle(request, run, names)` checks, in order, the API key (401), the lifecycle (503), the body's size
  (413 above `max_request_bytes`, counted while reading), its arrival within `body_timeout` (408) and its JSON
  (400), then calls `run(engine, body, record)`; any error becomes OpenAI's error shape with the HTTP status of
  `inference_svc.status`, reworded in the endpoint's parameter names (`names`). The request's `RequestRecord` ends
  here, or when a streamed response is over (`RecordedStream`), once.
- `Handler.collect` runs a request's outputs to completion (a client disconnect aborts it whole); `Handler.stream`
  starts the server-sent event response once the first increment (or error) is known, and ends a stream cut by a
  failure, a deadline or a shutdown with one `data: {"error": ...}` event, then `[DONE]`.
- The response pieces both views use: `FINISH` (finish reasons), `usage_object`/`running_usage` (OpenAI's usage),
  `Tokens` (token strings for logprobs: each token decoded alone), `sse` (one event).
- `Owner` is what the routes need from the process that runs them (`inference_svc.server.TandemServer`);
  `ApiOptions` is how that process configures them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from inference_svc.access_log import AccessLog, RequestRecord
from inference_svc.async_engine import MAX_REQUEST_ID_CHARS, AsyncEngine
from inference_svc.bounded_log import log_failure
from inference_svc.chat_template import ChatTemplate
from inference_svc.engine.pooling import Pooling
from inference_svc.engine.types import Completion, FinishReason, RequestOutput, Usage
from inference_svc.errors import (
    AuthenticationError,
    ClientGoneError,
    EngineStoppedError,
    InvalidRequestError,
    RequestTimeoutError,
    RequestTooLargeError,
)
from inference_svc.lifecycle import Lifecycle
from inference_svc.metrics import ServiceMetrics
from inference_svc.openai_api import json_body
from inference_svc.openai_api.lora_routes import resolve_model
from inference_svc.openai_api.protocol import parse
from inference_svc.openai_api.request_policy import RequestPolicy
from inference_svc.status import status_of

log = logging.getLogger("inference_svc.openai_api.app")  # one logger for the HTTP API, whichever module logs

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort"}


class Owner(Protocol):
    """What the app needs from the server that runs it (`TandemServer`)."""

    engine: AsyncEngine | None
    lifecycle: Lifecycle
    metrics: ServiceMetrics
    access_log: AccessLog


@dataclass(frozen=True)
class ApiOptions:
    model_name: str
    max_request_bytes: int
    body_timeout: float = 30.0
    """Seconds a request body may take to arrive (a slow-loris body gets 408)."""
    serve_metrics: bool = False
    """Whether `/metrics` is served on this port (see the module docstring)."""
    check_key: Callable[[list[str]], str | None] | None = None
    """The `authorization` header values → why they are refused, or None when they carry a valid key."""
    chat_template: ChatTemplate | None = None
    chat_template_timeout: float = 5.0
    """Seconds one render of the chat template may take (it writes at most the characters the context can hold)."""
    strict_request_fields: bool = False
    """Unknown request fields get 400 (True) or are logged and ignored (False, as vLLM); see request_policy.py."""
    reasoning_parser: str | None = None
    """Chat answers' `<think>` block moved into `reasoning_content` by this parser (reasoning.py); None: off."""
    pooling: Pooling = field(default_factory=Pooling)
    """How `/v1/embeddings` pools the hidden states (the folder's sentence-transformers modules, else last token)."""
    tool_call_parser: str | None = None
    """How tool calls are read from chat output (`openai_api.tool_calls.PARSERS`); None: not at all."""


def error_json(message: str, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def in_api_terms(exc: BaseException, names: dict[str, str]) -> BaseException:
    """An engine validation error re-worded with the endpoint's parameter name (max_new_tokens → max_tokens)."""
    if type(exc) is not InvalidRequestError or exc.field not in names:
        return exc
    message = str(exc).removeprefix(f"{exc.field}: ")
    return InvalidRequestError(names[exc.field], message)


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status, message = status_of(exc)
    param = getattr(exc, "field", None)
    return status.http, {"error": {"message": message, "type": status.type, "param": param, "code": status.grpc.name}}


class Handler:
    """What every route shares: the key check, the lifecycle check, the body's size, time and JSON, the model name,
    errors in OpenAI's shape with the request's record, and running a request's outputs to a whole answer or a
    stream (`collect`, `stream`)."""

    def __init__(self, owner: Owner, options: ApiOptions) -> None:
        self.owner = owner
        self.options = options
        self.created = int(time.time())
        self.policy = RequestPolicy(options.strict_request_fields)

    # ------------------------------------------------------------------ plumbing
    def parse_body(self, model: type[Any], body: Any) -> Any:
        """`body` validated as `model` under the request policy (ignored, default-only and unknown fields)."""
        return parse(model, self.policy.prepare(model.model_fields, body), self.policy.unknown)

    def _error(self, exc: BaseException, record: RequestRecord) -> JSONResponse:
        """`exc` as OpenAI's error response; recorded as the request's outcome (counted when the record ends), and
        logged, with its traceback, only when it is INTERNAL."""
        code, body = error_body(exc)
        log_if_internal(exc, "HTTP request", record.request_id)
        record.fail(exc)
        return JSONResponse(body, status_code=code)

    def _cut(self) -> Exception:
        """Why a request's task was cancelled: the server shutting down, else its client leaving."""
        if not self.owner.lifecycle.accepting:
            return EngineStoppedError("the server shut down before this request finished")
        return ClientGoneError("the client disconnected")

    def _record(self, request: Request) -> RequestRecord:
        client = request.client
        peer = "-" if client is None else f"{client.host}:{client.port}"
        record = RequestRecord("http", request.method, request.url.path, peer=peer)
        record.request_id = request.headers.get("x-request-id", "-")[:MAX_REQUEST_ID_CHARS] or "-"
        return record

    def _authorize(self, request: Request) -> None:
        if self.options.check_key is None:
            return
        reason = self.options.check_key(request.headers.getlist("authorization"))
        if reason is not None:
            raise AuthenticationError(reason)

    def _engine(self) -> AsyncEngine:
        engine = self.owner.engine
        lifecycle = self.owner.lifecycle
        if engine is None or not lifecycle.accepting:
            raise EngineStoppedError(lifecycle.refusal() or "the engine is not running")
        return engine

    async def _body(self, request: Request) -> Any:
        limit = self.options.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestTooLargeError(f"the body has {declared} bytes; this server accepts at most {limit}")

        async def read() -> bytes:
            chunks: list[bytes] = []
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise RequestTooLargeError(f"the body has more than {limit} bytes, the most this server accepts")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            raw = await asyncio.wait_for(read(), self.options.body_timeout)
        except asyncio.TimeoutError:
            raise RequestTimeoutError(
                f"the request body did not arrive within {self.options.body_timeout:g} s"
            ) from None
        return json_body.load(raw)

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter `name` picks (None: the base model); 404 naming `model` for a name not served."""
        return resolve_model(name, self.options.model_name, self.owner.engine)

    async def handle(
        self,
        request: Request,
        run: Callable[[AsyncEngine, Any, RequestRecord], Awaitable[Response]],
        names: dict[str, str],
    ) -> Response:
        """Key, lifecycle, body, then `run(engine, body, record)`; any error in OpenAI's shape (see the module
        docstring). The record ends here, or when a streamed response is over (`RecordedStream`)."""
        record = self._record(request)
        response: Response | None = None
        try:
            self._authorize(request)
            engine = self._engine()
            body = await self._body(request)
            response = await run(engine, body, record)
        except ClientDisconnect:  # the client hung up mid-body: nobody to answer
            response = self._error(ClientGoneError("the client disconnected before its body arrived"), record)
        except asyncio.CancelledError:
            cause = self._cut()
            if not isinstance(cause, EngineStoppedError):
                record.fail(cause)
                raise
            # the HTTP server cancels what is left at the end of a shutdown (a slow upload, say): this request
            # ends here, answered 503 if its client still listens; re-raised, it would be a traceback each
            response = self._error(cause, record)
        except Exception as exc:
            response = self._error(in_api_terms(exc, names), record)
        finally:
            if not isinstance(response, RecordedStream):  # a stream's record ends with the stream
                self.owner.access_log.finish(record)
        return response

    # ------------------------------------------------------------------ running requests
    async def collect(
        self, request: Request, outputs: AsyncIterator[tuple[int, RequestOutput]], n: int, record: RequestRecord
    ) -> list[Completion]:
        """Run the request to completion; a client disconnect aborts it whole (`ClientGoneError`). Completions in
        choice order."""

        async def gather() -> list[Completion]:
            done: dict[int, Completion] = {}
            try:
                async for p, out in outputs:
                    record.tokens_out += len(out.new_token_ids)
                    idx = p * n + out.index
                    done.setdefault(idx, Completion(out.request_id, idx)).add(out)
            finally:
                await outputs.aclose()  # type: ignore[attr-defined]  # abort what still runs, now
            return [done[i] for i in sorted(done)]

        work = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left: cancelling aborts every engine request
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                raise ClientGoneError("the client disconnected before its answer was complete")
            return work.result()
        finally:
            gone.cancel()

    async def stream(
        self,
        request: Request,
        merged: AsyncIterator[tuple[int, RequestOutput]],
        chunk: Callable[[int, RequestOutput], list[dict[str, Any]]],
        usage_chunk: Callable[[], dict[str, Any]],
        include_usage: bool,
        record: RequestRecord,
        names: dict[str, str],
    ) -> Response:
        try:
            first = await anext(merged)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await merged.aclose()  # type: ignore[attr-defined]
            raise

        async def events() -> AsyncIterator[bytes]:
            try:
                if first is not None:
                    record.tokens_out += len(first[1].new_token_ids)
                    for c in chunk(*first):
                        yield sse(c)
                async for item in merged:
                    record.tokens_out += len(item[1].new_token_ids)
                    for c in chunk(*item):
                        yield sse(c)
                if include_usage:
                    yield sse(usage_chunk())
            except asyncio.CancelledError:  # the client went away mid-stream (or a shutdown cut the stream)
                record.fail(self._cut())
                raise
            except Exception as exc:  # mid-stream: one error event, in the shape of the errors
                _, body = error_body(in_api_terms(exc, names))
                log_if_internal(exc, "HTTP stream", record.request_id)
                record.fail(exc)
                yield sse(body)
            finally:
                await merged.aclose()  # type: ignore[attr-defined]  # abort now (a disconnect cancels this generator)
            yield b"data: [DONE]\n\n"

        return RecordedStream(
            events(),
            record,
            self.owner.access_log,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )


class RecordedStream(StreamingResponse):
    """A server-sent event stream whose request record ends when the stream does: CANCELLED unless its events ran
    to their end (a disconnect may cancel it inside the transport's send, where the events never see it)."""

    def __init__(self, content: AsyncIterator[bytes], record: RequestRecord, access_log: AccessLog,
                 **kwargs: Any) -> None:  # fmt: skip
        self._ended = False
        self._events = content
        self._record, self._access_log = record, access_log
        super().__init__(self._watch(), **kwargs)

    async def _watch(self) -> AsyncIterator[bytes]:
        async for item in self._events:
            yield item
        self._ended = True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._ended:
                self._record.fail(ClientGoneError("the client disconnected mid-stream"))
            for stream in (self.body_iterator, self._events):  # the events' engine requests abort now
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]
            self._access_log.finish(self._record)


def log_if_internal(exc: BaseException, what: str, rid: str) -> None:
    """One ERROR line with the traceback for an INTERNAL failure not logged yet; nothing for any other outcome (a
    client's own deadline, a disconnect, a refusal: the access log has them)."""
    if status_of(exc)[0].grpc.name == "INTERNAL" and not getattr(exc, "logged", False):
        log_failure(log, f"{what} {rid or '-'} failed", exc)  # bounded: message, innermost frames


def new_request_id(request: Request, kind: str) -> str:
    """The client's `X-Request-Id` (as vLLM takes it; the engine checks its length and uniqueness), else a new one."""
    return request.headers.get("x-request-id") or f"{kind}-{uuid.uuid4().hex}"


def usage_object(prompt: int, completions: Sequence[Usage], cached: int) -> dict[str, Any]:
    """OpenAI's usage object over a request's completions. Speculative decoding's drafts are reported in OpenAI's
    Predicted Outputs fields: each accepted prediction token saved one step, so tokens per step is
    completion_tokens / (completion_tokens - accepted_prediction_tokens)."""
    completion = sum(u.completion_tokens for u in completions)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    drafted = sum(u.draft_tokens for u in completions)
    if drafted:
        accepted = sum(u.accepted_draft_tokens for u in completions)
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return out


def running_usage(prompt: int, completion: int) -> dict[str, int]:
    """The usage a stream chunk carries under `continuous_usage_stats`: its choice's prompt and tokens so far."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read: the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Tokens:
    """Token strings for logprobs: each token decoded alone."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)
