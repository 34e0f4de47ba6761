"""The completions view: `POST /v1/completions` from the parsed body to the engine call to the response or stream.

Contract:
- Text or token-id prompts (one or many), each run `n` times; admitted whole or refused whole
  (`AsyncEngine.generate_many`); a client `X-Request-Id` with several prompts leaves room for "-<index>".
- `CompletionView` assembles OpenAI's `text_completion` objects: one per choice (prompt-major, then `n`),
  `echo` (the prompt's text, and its logprobs with `logprobs`), logprobs in OpenAI's legacy shape (token strings
  decoded alone), `finish_reason`, usage (cached prompt tokens; speculative drafts as Predicted Outputs),
  `continuous_usage_stats` per chunk.
- Errors are reworded in this endpoint's parameter names (`COMPLETION_NAMES`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inference_svc.access_log import RequestRecord
from inference_svc.async_engine import MAX_REQUEST_ID_CHARS, AsyncEngine
from inference_svc.engine.types import Completion, RequestOutput, TokenLogprob, Usage
from inference_svc.errors import InvalidRequestError
from inference_svc.openai_api.handling import (
    FINISH,
    Handler,
    Tokens,
    new_request_id,
    running_usage,
    usage_object,
)
from inference_svc.openai_api.protocol import CompletionRequest

COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt", "top_logprobs": "logprobs",
                     "request_id": "x-request-id"}  # fmt: skip
"""The engine's field names → the parameters a client of /v1/completions sent."""


async def completion_response(
    api: Handler, request: Request, engine: AsyncEngine, body: Any, record: RequestRecord
) -> Response:
    """`POST /v1/completions`: the request's prompts admitted whole, answered whole or streamed."""
    req: CompletionRequest = api.parse_body(CompletionRequest, body)
    adapter = api.check_model(req.model)
    sampling = dataclasses.replace(req.to_sampling(16), lora_name=adapter)
    rid = record.request_id = new_request_id(request, "cmpl")
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
    view = CompletionView(rid, adapter or api.options.model_name, record.created, req, prompts, echo_text, tok)
    if req.stream:
        return await api.stream(
            request, outputs, view.chunk, view.usage_chunk, req.include_usage, record, COMPLETION_NAMES
        )
    done = await api.collect(request, outputs, req.n, record)
    return JSONResponse(view.whole(done))


class CompletionView(Tokens):
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
            "finish_reason": FINISH.get(out.finish_reason) if out.finished else None,  # type: ignore[arg-type]
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
            body["usage"] = running_usage(len(self.prompts[p]), self.generated[idx])
        return [body]

    def _usage(self, completions: Sequence[Usage], cached: int) -> dict[str, Any]:
        prompt = sum(len(ids) for ids in self.prompts)
        return usage_object(prompt, completions, cached)

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
                "finish_reason": FINISH.get(c.finish_reason),  # type: ignore[arg-type]
                "stop_reason": c.stop_reason,
            })  # fmt: skip
        usage = self._usage([c.usage for c in done], sum(cached.values()))
        return {**self._head(), "choices": choices, "usage": usage}
