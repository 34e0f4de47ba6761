"""The OpenAI-compatible HTTP API's routes: an ASGI app (Starlette) over the `AsyncEngine` the gRPC servicer uses.

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
- Files by job: this module builds the app (routes, error handlers, the small routes: health, metrics, models,
  embeddings, tokenize/detokenize); the completions and chat views are `completions.py` and `chat.py`; what every
  route shares (key, lifecycle, body, errors, records, collecting and streaming outputs) is `handling.py`.
"""

from __future__ import annotations

import base64
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inference_svc import tokenizer_jobs
from inference_svc.access_log import RequestRecord
from inference_svc.async_engine import AsyncEngine
from inference_svc.bounded_log import log_failure
from inference_svc.embeddings import embed
from inference_svc.errors import InvalidRequestError
from inference_svc.lifecycle import State
from inference_svc.openai_api.chat import CHAT_NAMES, chat_ids, chat_response
from inference_svc.openai_api.completions import COMPLETION_NAMES, completion_response
from inference_svc.openai_api.handling import ApiOptions, Handler, Owner, error_json, log
from inference_svc.openai_api.lora_routes import adapter_card, adapter_cards, lora_routes
from inference_svc.openai_api.protocol import DetokenizeRequest, EmbeddingRequest, TokenizeRequest


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
        return JSONResponse(error_json("the server failed on this request", "internal_error", "INTERNAL"), 500)

    async def http_error(request: Request, exc: Exception) -> Response:  # no such route, or not with this method
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            body = error_json(f"{request.url.path} does not take {request.method}", "invalid_request_error",
                               "INVALID_ARGUMENT")  # fmt: skip
        else:
            body = error_json(f"no route {request.url.path!r}", "not_found_error", "NOT_FOUND")
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    app = Starlette(routes=routes, exception_handlers={Exception: internal, HTTPException: http_error})
    return _Outermost(app)


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


class _Api(Handler):
    """The routes."""

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
            adapter = self.check_model(request.path_params["model_id"])
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

    # ------------------------------------------------------------------ the views (completions.py, chat.py)
    async def completions(self, request: Request) -> Response:
        return await self.handle(
            request,
            lambda engine, body, record: completion_response(self, request, engine, body, record),
            COMPLETION_NAMES,
        )

    async def chat_completions(self, request: Request) -> Response:
        return await self.handle(
            request, lambda engine, body, record: chat_response(self, request, engine, body, record), CHAT_NAMES
        )

    # ------------------------------------------------------------------ embeddings
    async def embeddings(self, request: Request) -> Response:
        return await self.handle(request, self._embeddings, {})

    async def _embeddings(self, engine: AsyncEngine, body: Any, record: RequestRecord) -> Response:
        req: EmbeddingRequest = self.parse_body(EmbeddingRequest, body)
        if self.check_model(req.model) is not None:
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
        return await self.handle(request, self._tokenize, {})

    async def _tokenize(self, engine: AsyncEngine, body: Any, record: RequestRecord) -> Response:
        req: TokenizeRequest = self.parse_body(TokenizeRequest, body)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("prompt", "send either prompt (text) or messages")
        if req.messages is not None:
            ids = await chat_ids(
                self.options, engine, req.messages, req.add_generation_prompt, req.chat_template_kwargs
            )
        else:
            text = req.prompt or ""
            ids = await engine.tokenize_with(
                len(text), tokenizer_jobs.encode, text, req.add_special_tokens, field="prompt"
            )
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.engine.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        return await self.handle(request, self._detokenize, {})

    async def _detokenize(self, engine: AsyncEngine, body: Any, record: RequestRecord) -> Response:
        req: DetokenizeRequest = self.parse_body(DetokenizeRequest, body)
        self.check_model(req.model)
        vocab = engine.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError("tokens", f"ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        text = await engine.tokenize_with(len(req.tokens), tokenizer_jobs.decode, req.tokens, field="tokens")
        return JSONResponse({"prompt": text})
