"""The OpenAI-compatible HTTP API: an ASGI app (Starlette) over the same `AsyncEngine` the gRPC server uses.

Contract:
- Routes: `POST /tokenize` and `POST /detokenize` (vLLM's: text or chat messages ↔ token ids),
  `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as server-sent events
  ending in `data: [DONE]`, and `stream_options.include_usage`), `GET /v1/models`, `GET /v1/models/{id}` (404
  naming `model` for an id not served), `GET /health` (200 while the
  server's `Lifecycle` is SERVING, else 503 with its state: loading, draining, stopped or broken) and
  `GET /metrics` (the service's registry, served here only when this API listens on
  the same interface as the metrics server: `--metrics-host` decides who may read metrics, whichever port).
- LoRA (`openai_api.lora_routes`): a request's `model` may name a loaded adapter (its output's `model` echoes it);
  `/v1/models` lists the adapters with `parent` the base; `POST /v1/load_lora_adapter` and
  `/v1/unload_lora_adapter` load and unload them at run time. Embeddings come from the base model only.
- Every error is OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with the HTTP status of
  `inference_svc.status` (the table the gRPC codes come from); `code` is the gRPC status name, so an error reads
  the same over both protocols.
- Outcomes: each request to an API route (not `/health`, not `/metrics`) is one `RequestRecord`
  (`inference_svc.access_log`, shared with gRPC), ended once when its response is over: a non-OK outcome is
  counted in `tandem_request_errors` under its gRPC code, and one `tandem.access` line is written. A client that
  disconnects (before, during or after its body, streaming or not) is CANCELLED (HTTP 499 in the access log);
  a `timeout` that passes is DEADLINE_EXCEEDED. Only INTERNAL failures are logged beyond the access line (with
  their traceback, once).
- `created` in every response is the request's arrival (whole seconds), the same in every chunk of a stream.
- Order of checks: API key (401; `/health` and `/metrics` are open, as gRPC health is), serving (503), body size
  (413 above `max_request_bytes`, counted while reading, so a chunked body cannot exceed it either; a body that
  has not arrived within `body_timeout` seconds gets 408), JSON (400), parameters (400 naming the parameter),
  model name (404), then the engine's own validation and admission (400, 429): a request is admitted whole or
  refused whole (`AsyncEngine.generate_many`: every prompt checked, all `prompts × n` sequences at once), a
  request no emptier queue could hold gets 400 naming `n` or `prompt`, 429 only one that would fit later.
- Streams: the response starts once the first increment (or the first error) of the request is known, so a
  request the engine refuses gets its status code, not a 200 followed by an error. After that, a failure, a
  deadline (`timeout`) or a shutdown ends the stream with one `data: {"error": ...}` event, then `[DONE]`.
- A client that disconnects aborts its request (streaming or not): the engine frees its KV blocks at its next step.
- Request ids: the client's `X-Request-Id` header when sent (echoed as the response `id`), else a fresh one.
- Text prompts are tokenized as gRPC's are (no BOS added); chat messages are rendered by the folder's chat
  template (`chat_template`), and their content never becomes a control token. A server without a template
  answers chat requests 400 saying so. The template renders in the tokenizer process, never on the event loop,
  within `chat_template_timeout` seconds and the characters the context can hold (`max_prompt_chars`); a render
  over either gets 400 naming `chat_template`.
- Log-probabilities are the model's own (before penalties and temperature), as vLLM's are by default; token
  strings are each token decoded alone.
- Tool calling (chat): the request's `tools` reach the template; with `tool_choice` other than "none" the server's
  `tool_call_parser` (`ApiOptions`; none: 400 naming `tool_choice`) reads calls out of each choice's text into
  `message.tool_calls` (streamed as whole calls in `delta.tool_calls`, `openai_api.tool_calls.ToolCallStream`),
  with `finish_reason` "tool_calls"; "required" or a named function adds the structured output that forces the
  calls' text (`tool_calls.grammar_spec`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from inference_svc import tokenizer_jobs
from inference_svc.access_log import AccessLog, RequestRecord
from inference_svc.async_engine import MAX_REQUEST_ID_CHARS, AsyncEngine
from inference_svc.bounded_log import log_failure
from inference_svc.chat_template import ChatTemplate, RenderLimits
from inference_svc.embeddings import embed
from inference_svc.engine.pooling import Pooling
from inference_svc.engine.types import Completion, FinishReason, RequestOutput, TokenLogprob, Usage
from inference_svc.errors import (
    AuthenticationError,
    ClientGoneError,
    EngineStoppedError,
    InvalidRequestError,
    RequestTimeoutError,
    RequestTooLargeError,
)
from inference_svc.lifecycle import Lifecycle, State
from inference_svc.metrics import ServiceMetrics
from inference_svc.openai_api import json_body, tool_calls
from inference_svc.openai_api.lora_routes import adapter_card, adapter_cards, lora_routes, resolve_model
from inference_svc.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    parse,
)
from inference_svc.openai_api.reasoning import ReasoningSplitter
from inference_svc.openai_api.reasoning import split as split_reasoning
from inference_svc.openai_api.request_policy import RequestPolicy
from inference_svc.status import status_of

log = logging.getLogger(__name__)

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort"}


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


def build_app(owner: Owner, options: ApiOptions) -> Any:
    """The ASGI app uvicorn runs."""
    api = _Api(owner, options)
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.model, methods=["GET"]),
        Route("/v1/embeddings", api.embeddings, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        *lora_routes(api),
    ]

    async def internal(request: Request, exc: Exception) -> Response:  # a failure no route turned into an error
        owner.metrics.observe_error("INTERNAL")
        return JSONResponse(_error_json("the server failed on this request", "internal_error", "INTERNAL"), 500)

    async def http_error(request: Request, exc: Exception) -> Response:  # no such route, or not with this method
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            body = _error_json(f"{request.url.path} does not take {request.method}", "invalid_request_error",
                               "INVALID_ARGUMENT")  # fmt: skip
        else:
            body = _error_json(f"no route {request.url.path!r}", "not_found_error", "NOT_FOUND")
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    app = Starlette(routes=routes, exception_handlers={Exception: internal, HTTPException: http_error})
    return _Outermost(app)


def _error_json(message: str, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Outermost:
    """The app as uvicorn runs it: an exception no handler caught has had its JSON 500 (Starlette's error
    middleware sent it, then raised it again); here it is logged once, bounded, instead of uvicorn's whole
    traceback."""

    def __init__(self, app: Starlette) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            log_failure(log, f"HTTP {scope.get('method', '')} {scope.get('path', '')} failed", exc)


# ---------------------------------------------------------------------------------------- errors
_COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt", "top_logprobs": "logprobs",
                     "request_id": "x-request-id"}  # fmt: skip
_CHAT_NAMES = {"max_new_tokens": "max_completion_tokens", "prompt": "messages", "prompt_token_ids": "messages",
               "request_id": "x-request-id"}  # fmt: skip
"""The engine's field names → the parameter a client of each endpoint sent."""


def _in_api_terms(exc: BaseException, names: dict[str, str]) -> BaseException:
    """An engine validation error re-worded with the endpoint's parameter name (max_new_tokens → max_tokens)."""
    if type(exc) is not InvalidRequestError or exc.field not in names:
        return exc
    message = str(exc).removeprefix(f"{exc.field}: ")
    return InvalidRequestError(names[exc.field], message)


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status, message = status_of(exc)
    param = getattr(exc, "field", None)
    return status.http, {"error": {"message": message, "type": status.type, "param": param, "code": status.grpc.name}}


class _Api:
    def __init__(self, owner: Owner, options: ApiOptions) -> None:
        self.owner = owner
        self.options = options
        self.created = int(time.time())
        self.policy = RequestPolicy(options.strict_request_fields)

    # ------------------------------------------------------------------ plumbing
    def _parse(self, model: type[Any], body: Any) -> Any:
        """`body` validated as `model` under the request policy (ignored, default-only and unknown fields)."""
        return parse(model, self.policy.prepare(model.model_fields, body), self.policy.unknown)

    def _error(self, exc: BaseException, record: RequestRecord) -> JSONResponse:
        """`exc` as OpenAI's error response; recorded as the request's outcome (counted when the record ends), and
        logged, with its traceback, only when it is INTERNAL."""
        code, body = error_body(exc)
        _log_if_internal(exc, "HTTP request", record.request_id)
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

    def _check_model(self, name: str | None) -> str | None:
        """The LoRA adapter `name` picks (None: the base model); 404 naming `model` for a name not served."""
        return resolve_model(name, self.options.model_name, self.owner.engine)

    async def _handle(
        self,
        request: Request,
        run: Callable[[AsyncEngine, Any, RequestRecord], Awaitable[Response]],
        names: dict[str, str],
    ) -> Response:
        """Key, lifecycle, body, then `run(engine, body, record)`; any error in OpenAI's shape (see the module
        docstring). The record ends here, or when a streamed response is over (`_RecordedStream`)."""
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
            response = self._error(_in_api_terms(exc, names), record)
        finally:
            if not isinstance(response, _RecordedStream):  # a stream's record ends with the stream
                self.owner.access_log.finish(record)
        return response

    # ------------------------------------------------------------------ plain routes
    async def health(self, request: Request) -> Response:
        state = self.owner.lifecycle.state
        return JSONResponse({"status": state.value}, status_code=200 if state is State.SERVING else 503)

    async def metrics(self, request: Request) -> Response:
        if not self.options.serve_metrics:
            return JSONResponse(
                {"error": {"message": "metrics are served on the metrics port (--metrics-host decides who may read "
                           "them)", "type": "not_found_error", "param": None, "code": "NOT_FOUND"}},
                status_code=404,
            )  # fmt: skip
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.owner.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        record = self._record(request)
        try:
            self._authorize(request)
        except Exception as exc:
            return self._error(exc, record)
        finally:
            self.owner.access_log.finish(record)
        cards = [self._card(), *adapter_cards(self.owner.engine, self.options.model_name, self.created)]
        return JSONResponse({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        """OpenAI's `GET /v1/models/{model}`: the served model's card, or 404 (`param` "model") for another id."""
        record = self._record(request)
        try:
            self._authorize(request)
            adapter = self._check_model(request.path_params["model_id"])
            base = self.options.model_name
            card = self._card() if adapter is None else adapter_card(self.owner.engine, base, self.created, adapter)
        except Exception as exc:
            return self._error(exc, record)
        finally:
            self.owner.access_log.finish(record)
        return JSONResponse(card)

    def _card(self) -> dict[str, Any]:
        card = {"id": self.options.model_name, "object": "model", "created": self.created, "owned_by": "tandem"}
        engine = self.owner.engine
        if engine is not None:
            card["max_model_len"] = engine.engine.max_model_len
            card["tandem_load_plan"] = engine.info.load_plan.as_dicts()
        return card

    # ------------------------------------------------------------------ completions
    async def completions(self, request: Request) -> Response:
        return await self._handle(
            request, lambda engine, body, record: self._completions(request, engine, body, record), _COMPLETION_NAMES
        )

    async def _completions(self, request: Request, engine: AsyncEngine, body: Any, record: RequestRecord) -> Response:
        req: CompletionRequest = self._parse(CompletionRequest, body)
        adapter = self._check_model(req.model)
        sampling = dataclasses.replace(req.to_sampling(16), lora_name=adapter)
        rid = record.request_id = _request_id(request, "cmpl")
        texts = req.prompts()
        if len(texts) > 1 and "x-request-id" in request.headers:
            room = MAX_REQUEST_ID_CHARS - len(f"-{len(texts) - 1}")  # each prompt's request is the id plus "-i"
            if len(rid) > room:
                raise InvalidRequestError(
                    "x-request-id",
                    f"has {len(rid)} characters; with {len(texts)} prompts it may have at most {room} (each "
                    f"prompt runs as the id plus '-<index>', at most {MAX_REQUEST_ID_CHARS} characters)",
                )
        engine.check_fits(len(texts), req.n)  # before tokenizing: the count alone may prove it can never fit
        prompts = [await engine.prompt_ids(p) for p in texts]
        record.tokens_in = sum(len(ids) for ids in prompts)
        tok = engine.engine.tokenizer
        deadline = None if req.timeout is None else time.monotonic() + req.timeout
        outputs = engine.generate_many(prompts, sampling, request_id=rid, deadline=deadline, n=req.n)  # whole or none
        echo_text = [tok.decode(ids, skip_special_tokens=False) if req.echo else "" for ids in prompts]
        view = _CompletionView(rid, adapter or self.options.model_name, record.created, req, prompts, echo_text, tok)
        if req.stream:
            return await self._stream(
                request, outputs, view.chunk, view.usage_chunk, req.include_usage, record, _COMPLETION_NAMES
            )
        done = await self._collect(request, outputs, req.n, record)
        return JSONResponse(view.whole(done))

    # ------------------------------------------------------------------ embeddings
    async def embeddings(self, request: Request) -> Response:
        return await self._handle(request, self._embeddings, {})

    async def _embeddings(self, engine: AsyncEngine, body: Any, record: RequestRecord) -> Response:
        req: EmbeddingRequest = self._parse(EmbeddingRequest, body)
        if self._check_model(req.model) is not None:
            raise InvalidRequestError("model", f"'{req.model}' is a LoRA adapter; embeddings come from the base model")
        vectors, record.tokens_in = await embed(engine, req.inputs(), self.options.pooling, req.dimensions, "input")
        data = []
        for i, row in enumerate(vectors):
            if req.encoding_format == "base64":  # little-endian float32, as OpenAI's SDK decodes it
                value: Any = base64.b64encode(row.numpy().astype("<f4").tobytes()).decode("ascii")
            else:
                value = row.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        usage = {"prompt_tokens": record.tokens_in, "total_tokens": record.tokens_in}
        return JSONResponse({"object": "list", "data": data, "model": self.options.model_name, "usage": usage})

    # ------------------------------------------------------------------ tokenizer (vLLM's routes)
    async def tokenize(self, request: Request) -> Response:
        return await self._handle(request, self._tokenize, {})

    async def _tokenize(self, engine: AsyncEngine, body: Any, record: RequestRecord) -> Response:
        req: TokenizeRequest = self._parse(TokenizeRequest, body)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("prompt", "send either prompt (text) or messages")
        if req.messages is not None:
            ids = await self._chat_ids(engine, req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        else:
            text = req.prompt or ""
            ids = await engine.tokenize_with(
                len(text), tokenizer_jobs.encode, text, req.add_special_tokens, field="prompt"
            )
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.engine.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        return await self._handle(request, self._detokenize, {})

    async def _detokenize(self, engine: AsyncEngine, body: Any, record: RequestRecord) -> Response:
        req: DetokenizeRequest = self._parse(DetokenizeRequest, body)
        self._check_model(req.model)
        vocab = engine.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError("tokens", f"ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        text = await engine.tokenize_with(len(req.tokens), tokenizer_jobs.decode, req.tokens, field="tokens")
        return JSONResponse({"prompt": text})

    # ------------------------------------------------------------------ chat
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(
            request, lambda engine, body, record: self._chat(request, engine, body, record), _CHAT_NAMES
        )

    async def _chat(self, request: Request, engine: AsyncEngine, body: Any, record: RequestRecord) -> Response:
        req: ChatCompletionRequest = self._parse(ChatCompletionRequest, body)
        adapter = self._check_model(req.model)
        sampling = req.to_sampling(engine.engine.config.max_new_tokens_limit)
        sampling = dataclasses.replace(sampling, lora_name=adapter)
        tools, tool_mode, forced = req.tool_setup()
        parser = self.options.tool_call_parser
        if tool_mode != "none":
            if parser is None:
                raise InvalidRequestError(
                    "tool_choice", "this server parses no tool calls (start it with --tool-call-parser); use 'none'"
                )
            if tool_mode == "forced":  # the whole answer is calls, their arguments valid for the schemas
                if sampling.structured is not None:
                    raise InvalidRequestError(
                        "tool_choice", f"cannot be forced together with {sampling.structured.param}"
                    )
                grammar = tool_calls.grammar_spec(parser, tools or [], forced, req.parallel_tool_calls)
                sampling = dataclasses.replace(sampling, structured=grammar)
        rid = record.request_id = _request_id(request, "chatcmpl")
        engine.check_fits(1, req.n)  # before rendering: n alone may prove it can never fit
        ids = await self._chat_ids(engine, req.messages, req.add_generation_prompt, req.chat_template_kwargs, tools)
        record.tokens_in = len(ids)
        tok = engine.engine.tokenizer
        deadline = None if req.timeout is None else time.monotonic() + req.timeout
        outputs = engine.generate_many([ids], sampling, request_id=rid, deadline=deadline, n=req.n)
        view = _ChatView(rid, adapter or self.options.model_name, record.created, req, len(ids), tok,
                         parser if tool_mode != "none" else None)  # fmt: skip
        view.reasoning = self.options.reasoning_parser
        if req.stream:
            return await self._stream(
                request, outputs, view.chunk, view.usage_chunk, req.include_usage, record, _CHAT_NAMES
            )
        done = await self._collect(request, outputs, req.n, record)
        return JSONResponse(view.whole(done))

    async def _chat_ids(
        self,
        engine: AsyncEngine,
        messages: list[Any],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None = None,
        tools: list | None = None,
    ) -> list[int]:
        """The messages rendered by the chat template (with the request's `chat_template_kwargs` and `tools`) and
        encoded (content never a control token), metered."""
        template = self.options.chat_template
        if template is None:
            raise InvalidRequestError(
                "messages",
                "this model folder has no chat template (tokenizer_config.json chat_template or chat_template.jinja); "
                "start the server with --chat-template FILE, or use /v1/completions",
            )
        plain = [
            _with_argument_objects(
                {**m.model_dump(exclude_none=True), "content": "" if m.content is None else m.content}
            )
            for m in messages
        ]
        chars = (
            sum(len(json.dumps(m)) for m in plain)
            + len(json.dumps(template_kwargs or {}))
            + len(json.dumps(tools or []))
        )
        limits = RenderLimits(engine.max_prompt_chars, self.options.chat_template_timeout)
        return await engine.tokenize_with(
            chars, tokenizer_jobs.chat_encode, template, plain, add_generation_prompt, limits, template_kwargs, tools
        )

    # ------------------------------------------------------------------ running requests
    async def _collect(
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
        gone = asyncio.ensure_future(_disconnected(request))
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

    async def _stream(
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
                        yield _sse(c)
                async for item in merged:
                    record.tokens_out += len(item[1].new_token_ids)
                    for c in chunk(*item):
                        yield _sse(c)
                if include_usage:
                    yield _sse(usage_chunk())
            except asyncio.CancelledError:  # the client went away mid-stream (or a shutdown cut the stream)
                record.fail(self._cut())
                raise
            except Exception as exc:  # mid-stream: one error event, in the shape of the errors
                _, body = error_body(_in_api_terms(exc, names))
                _log_if_internal(exc, "HTTP stream", record.request_id)
                record.fail(exc)
                yield _sse(body)
            finally:
                await merged.aclose()  # type: ignore[attr-defined]  # abort now (a disconnect cancels this generator)
            yield b"data: [DONE]\n\n"

        return _RecordedStream(
            events(),
            record,
            self.owner.access_log,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )


class _RecordedStream(StreamingResponse):
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


def _log_if_internal(exc: BaseException, what: str, rid: str) -> None:
    """One ERROR line with the traceback for an INTERNAL failure not logged yet; nothing for any other outcome (a
    client's own deadline, a disconnect, a refusal: the access log has them)."""
    if status_of(exc)[0].grpc.name == "INTERNAL" and not getattr(exc, "logged", False):
        log_failure(log, f"{what} {rid or '-'} failed", exc)  # bounded: message, innermost frames


def _request_id(request: Request, kind: str) -> str:
    """The client's `X-Request-Id` (as vLLM takes it; the engine checks its length and uniqueness), else a new one."""
    return request.headers.get("x-request-id") or f"{kind}-{uuid.uuid4().hex}"


def _usage(prompt: int, completions: Sequence[Usage], cached: int) -> dict[str, Any]:
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


def _running_usage(prompt: int, completion: int) -> dict[str, int]:
    """The usage a stream chunk carries under `continuous_usage_stats`: its choice's prompt and tokens so far."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's `tool_calls` with each `function.arguments` JSON string read into an object, as chat
    templates (Qwen3's, Llama 3.1's) expect them (an argument string that is not a JSON object stays as it is)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    fixed = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                args = None
            if isinstance(args, dict):
                call = {**call, "function": {**fn, "arguments": args}}
        fixed.append(call)
    return {**message, "tool_calls": fixed}


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read: the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---------------------------------------------------------------------------------------- response views
class _Tokens:
    """Token strings for logprobs: each token decoded alone."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)


class _CompletionView(_Tokens):
    """`/v1/completions` JSON for one request: whole responses and stream chunks."""

    def __init__(self, rid: str, model: str, created: int, req: CompletionRequest, prompts: list[list[int]],
                 echo: list[str], tokenizer: Any) -> None:  # fmt: skip
        super().__init__(tokenizer)
        self.rid, self.model, self.created, self.req = rid, model, created, req
        self.prompts, self.echo = prompts, echo
        self.started: set[int] = set()
        self.offsets: dict[int, int] = {}
        self.finals: dict[int, Usage] = {}
        """Completion index → its final usage."""
        self.cached: dict[int, int] = {}
        self.generated: dict[int, int] = {}
        """Completion index → tokens streamed so far (for `continuous_usage_stats`)."""

    def _head(self) -> dict[str, Any]:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model}

    def _logprobs(self, idx: int, tokens: Sequence[int], lps: Sequence[float | None],
                  tops: Sequence[TokenLogprob | None] | None) -> dict[str, Any]:  # fmt: skip
        strings = [self.text(t) for t in tokens]
        offsets = []
        at = self.offsets.get(idx, 0)
        for s in strings:
            offsets.append(at)
            at += len(s)
        self.offsets[idx] = at
        k = self.req.logprobs or 0
        top: list[dict[str, float] | None] = []
        for i, _ in enumerate(tokens):
            entry = tops[i] if tops is not None else None
            top.append(None if entry is None else {self.text(t): v for t, v in entry.top[:k]} if k else None)
        return {"tokens": strings, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}

    def _echo_logprobs(self, p: int, idx: int, prompt_lps: Sequence[TokenLogprob | None] | None) -> dict[str, Any]:
        ids = self.prompts[p]
        entries = list(prompt_lps or [None] * len(ids))
        lps = [None if e is None else e.logprob for e in entries]
        return self._logprobs(idx, ids, lps, entries)

    def _choice_logprobs(self, p: int, idx: int, out: RequestOutput | Completion, first: bool) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        if first:
            self.offsets[idx] = 0
        head = self._echo_logprobs(p, idx, out.prompt_logprobs) if first and self.req.echo else None
        tokens = out.new_token_ids if isinstance(out, RequestOutput) else out.token_ids
        body = self._logprobs(idx, tokens, out.logprobs or [], out.top_logprobs)  # offsets continue after the echo
        return body if head is None else {k: head[k] + body[k] for k in body}

    def chunk(self, p: int, out: RequestOutput) -> list[dict[str, Any]]:
        idx = p * self.req.n + out.index
        first = idx not in self.started
        self.started.add(idx)
        text = (self.echo[p] if first else "") + out.text_delta
        choice = {
            "index": idx,
            "text": text,
            "logprobs": self._choice_logprobs(p, idx, out, first),
            "finish_reason": _FINISH.get(out.finish_reason) if out.finished else None,  # type: ignore[arg-type]
        }
        if out.finished:
            choice["stop_reason"] = out.stop_reason
            self.finals[idx] = out.usage
            self.cached[p] = out.usage.cached_prompt_tokens
        if not text and not out.finished and not out.new_token_ids:
            return []
        body = {**self._head(), "choices": [choice]}
        if self.req.continuous_usage:  # vLLM's: the usage of this choice so far
            self.generated[idx] = self.generated.get(idx, 0) + len(out.new_token_ids)
            body["usage"] = _running_usage(len(self.prompts[p]), self.generated[idx])
        return [body]

    def _usage(self, completions: Sequence[Usage], cached: int) -> dict[str, Any]:
        prompt = sum(len(ids) for ids in self.prompts)
        return _usage(prompt, completions, cached)

    def usage_chunk(self) -> dict[str, Any]:
        usage = self._usage(list(self.finals.values()), sum(self.cached.values()))
        return {**self._head(), "choices": [], "usage": usage}

    def whole(self, done: list[Completion]) -> dict[str, Any]:
        choices = []
        cached: dict[int, int] = {}
        for c in done:
            p = c.index // self.req.n
            cached[p] = c.usage.cached_prompt_tokens
            choices.append({
                "index": c.index,
                "text": self.echo[p] + c.text,
                "logprobs": self._choice_logprobs(p, c.index, c, True),
                "finish_reason": _FINISH.get(c.finish_reason),  # type: ignore[arg-type]
                "stop_reason": c.stop_reason,
            })  # fmt: skip
        usage = self._usage([c.usage for c in done], sum(cached.values()))
        return {**self._head(), "choices": choices, "usage": usage}


class _ChatView(_Tokens):
    """`/v1/chat/completions` JSON for one request."""

    def __init__(self, rid: str, model: str, created: int, req: ChatCompletionRequest, prompt_tokens: int,
                 tokenizer: Any, tool_parser: str | None = None) -> None:  # fmt: skip
        super().__init__(tokenizer)
        self.rid, self.model, self.created, self.req, self.prompt_tokens = rid, model, created, req, prompt_tokens
        self.tool_parser = tool_parser
        """Tool calls are parsed out of the content (`openai_api.tool_calls`), None: the content is all text."""
        self.tool_streams: dict[int, tool_calls.ToolCallStream] = {}
        self.tool_counts: dict[int, int] = {}
        """Choice index → the tool calls streamed so far."""
        self.started: set[int] = set()
        self.finals: dict[int, Usage] = {}
        """Choice index → its final usage."""
        self.cached = 0
        self.generated: dict[int, int] = {}
        """Choice index → tokens streamed so far (for `continuous_usage_stats`)."""
        self.reasoning: str | None = None
        """The reasoning parser's name (None: off); its per-choice state is in `splitters`."""
        self.splitters: dict[int, ReasoningSplitter] = {}

    def _delta(self, out: RequestOutput) -> dict[str, Any]:
        """One increment's text as a chat delta: `content`; with a reasoning parser the `reasoning_content` and
        `content` it has decided so far (a tag's possible start is held back until the next increment); with a tool
        parser, the content's complete tool calls as `tool_calls` (numbered across the choice's stream)."""
        reasoning, content = "", out.text_delta
        if self.reasoning is not None:
            splitter = self.splitters.setdefault(out.index, ReasoningSplitter(self.reasoning))
            reasoning, content = splitter.feed(out.text_delta)
            if out.finished:
                rest = splitter.finish()
                reasoning, content = reasoning + rest[0], content + rest[1]
        calls: list[dict[str, Any]] = []
        if self.tool_parser is not None:
            stream = self.tool_streams.setdefault(out.index, tool_calls.ToolCallStream(self.tool_parser))
            content, calls = stream.feed(content)
            if out.finished:
                rest_text, more = stream.finish()
                content, calls = content + rest_text, calls + more
        delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning and self.req.include_reasoning else {}
        if content:
            delta["content"] = content
        if calls:
            first = self.tool_counts.get(out.index, 0)
            self.tool_counts[out.index] = first + len(calls)
            delta["tool_calls"] = [{"index": first + k, **c} for k, c in enumerate(calls)]
        return delta

    def _message(self, text: str) -> dict[str, Any]:
        """A whole answer's message: with a reasoning parser, its block moved into `reasoning_content`; with a tool
        parser, its tool calls parsed out of the content."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            reasoning, message["content"] = split_reasoning(self.reasoning, text)
            message["reasoning_content"] = reasoning if self.req.include_reasoning else None
        if self.tool_parser is not None:
            content, calls = tool_calls.parse(self.tool_parser, message["content"] or "")
            if calls:
                message["content"], message["tool_calls"] = content, calls
        return message

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _entry(self, token_id: int, logprob: float, top: Sequence[tuple[int, float]]) -> dict[str, Any]:
        s = self.text(token_id)
        return {
            "token": s,
            "logprob": logprob,
            "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": self.text(t), "logprob": v, "bytes": list(self.text(t).encode("utf-8"))}
                             for t, v in top[: self.req.top_logprobs or 0]],
        }  # fmt: skip

    def _logprobs(self, tokens: Sequence[int], lps: Sequence[float] | None,
                  tops: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:  # fmt: skip
        if not self.req.logprobs:
            return None
        content = []
        for i, t in enumerate(tokens):
            top = tops[i].top if tops is not None else ()
            content.append(self._entry(t, (lps or [0.0] * len(tokens))[i], top))
        return {"content": content}

    def _usage(self, completions: Sequence[Usage]) -> dict[str, Any]:
        return _usage(self.prompt_tokens, completions, self.cached)

    def chunk(self, p: int, out: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        if out.index not in self.started:
            self.started.add(out.index)
            role = {"index": out.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}  # fmt: skip
            chunks.append({**self._head("chat.completion.chunk"), "choices": [role]})
        delta = self._delta(out)
        if delta or out.finished or (self.req.logprobs and out.new_token_ids):
            finish = _FINISH.get(out.finish_reason) if out.finished else None  # type: ignore[arg-type]
            if finish == "stop" and self.tool_counts.get(out.index):
                finish = "tool_calls"
            choice: dict[str, Any] = {
                "index": out.index,
                "delta": delta,
                "logprobs": self._logprobs(out.new_token_ids, out.logprobs, out.top_logprobs),
                "finish_reason": finish,
            }
            if out.finished:
                choice["stop_reason"] = out.stop_reason
                self.finals[out.index] = out.usage
                self.cached = out.usage.cached_prompt_tokens
            chunks.append({**self._head("chat.completion.chunk"), "choices": [choice]})
        if self.req.continuous_usage:  # vLLM's: every chunk carries the usage of its choice so far
            self.generated[out.index] = self.generated.get(out.index, 0) + len(out.new_token_ids)
            for c in chunks:  # the role chunk, when there is one, comes before any token
                tokens = 0 if "role" in c["choices"][0]["delta"] else self.generated[out.index]
                c["usage"] = _running_usage(self.prompt_tokens, tokens)
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        return {
            **self._head("chat.completion.chunk"),
            "choices": [],
            "usage": self._usage(list(self.finals.values())),
        }

    def whole(self, done: list[Completion]) -> dict[str, Any]:
        if done:
            self.cached = done[0].usage.cached_prompt_tokens
        choices = [
            {
                "index": c.index,
                "message": self._message(c.text),
                "logprobs": self._logprobs(c.token_ids, c.logprobs, c.top_logprobs),
                "finish_reason": _FINISH.get(c.finish_reason),  # type: ignore[arg-type]
                "stop_reason": c.stop_reason,
            }
            for c in done
        ]
        for choice in choices:
            if choice["message"].get("tool_calls") and choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        usage = self._usage([c.usage for c in done])
        return {**self._head("chat.completion"), "choices": choices, "usage": usage}
