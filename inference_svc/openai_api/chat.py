"""The chat view: `POST /v1/chat/completions` from the parsed body to the engine call to the response or stream.

Contract:
- Messages are rendered by the folder's chat template (`chat_ids`, also used by `/tokenize`) in the tokenizer
  process, within `chat_template_timeout` seconds and the characters the context can hold, and encoded so that
  their content never becomes a control token; a server without a template answers 400 saying so.
- Tool calling: the request's `tools` reach the template; with `tool_choice` other than "none" the server's
  `tool_call_parser` (none: 400 naming `tool_choice`) reads calls out of each choice's text into
  `message.tool_calls` (streamed as whole calls), with `finish_reason` "tool_calls"; "required" or a named
  function adds the structured output that forces the calls' text (`tool_calls.grammar_spec`).
- `ChatView` assembles OpenAI's `chat.completion` / `chat.completion.chunk` objects: the role in each choice's
  first delta, reasoning split into `reasoning_content` by the server's `reasoning_parser`, logprobs in the chat
  shape, usage as the completions view reports it.
- Errors are reworded in this endpoint's parameter names (`CHAT_NAMES`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inference_svc import tokenizer_jobs
from inference_svc.access_log import RequestRecord
from inference_svc.async_engine import AsyncEngine
from inference_svc.chat_template import RenderLimits
from inference_svc.engine.types import Completion, RequestOutput, TokenLogprob, Usage
from inference_svc.errors import InvalidRequestError
from inference_svc.openai_api import tool_calls
from inference_svc.openai_api.handling import (
    FINISH,
    ApiOptions,
    Handler,
    Tokens,
    new_request_id,
    running_usage,
    usage_object,
)
from inference_svc.openai_api.protocol import ChatCompletionRequest
from inference_svc.openai_api.reasoning import ReasoningSplitter
from inference_svc.openai_api.reasoning import split as split_reasoning

CHAT_NAMES = {"max_new_tokens": "max_completion_tokens", "prompt": "messages", "prompt_token_ids": "messages",
               "request_id": "x-request-id"}  # fmt: skip
"""The engine's field names → the parameters a client of /v1/chat/completions sent."""


async def chat_response(
    api: Handler, request: Request, engine: AsyncEngine, body: Any, record: RequestRecord
) -> Response:
    """`POST /v1/chat/completions`: the messages rendered, the request admitted whole, answered whole or streamed."""
    req: ChatCompletionRequest = api.parse_body(ChatCompletionRequest, body)
    adapter = api.check_model(req.model)
    sampling = req.to_sampling(engine.engine.config.max_new_tokens_limit)
    sampling = dataclasses.replace(sampling, lora_name=adapter)
    tools, tool_mode, forced = req.tool_setup()
    parser = api.options.tool_call_parser
    if tool_mode != "none":
        if parser is None:
            raise InvalidRequestError(
                "tool_choice", "this server parses no tool calls (start it with --tool-call-parser); use 'none'"
            )
        if tool_mode == "forced":  # the whole answer is calls, their arguments valid for the schemas
            if sampling.structured is not None:
                raise InvalidRequestError("tool_choice", f"cannot be forced together with {sampling.structured.param}")
            grammar = tool_calls.grammar_spec(parser, tools or [], forced, req.parallel_tool_calls)
            sampling = dataclasses.replace(sampling, structured=grammar)
    rid = record.request_id = new_request_id(request, "chatcmpl")
    engine.check_fits(1, req.n)  # before rendering: n alone may prove it can never fit
    ids = await chat_ids(api.options, engine, req.messages, req.add_generation_prompt, req.chat_template_kwargs, tools)
    record.tokens_in = len(ids)
    tok = engine.engine.tokenizer
    deadline = None if req.timeout is None else time.monotonic() + req.timeout
    outputs = engine.generate_many([ids], sampling, request_id=rid, deadline=deadline, n=req.n)
    view = ChatView(rid, adapter or api.options.model_name, record.created, req, len(ids), tok,
                     parser if tool_mode != "none" else None)  # fmt: skip
    view.reasoning = api.options.reasoning_parser
    if req.stream:
        return await api.stream(request, outputs, view.chunk, view.usage_chunk, req.include_usage, record, CHAT_NAMES)
    done = await api.collect(request, outputs, req.n, record)
    return JSONResponse(view.whole(done))


async def chat_ids(
    options: ApiOptions,
    engine: AsyncEngine,
    messages: list[Any],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
    tools: list | None = None,
) -> list[int]:
    """The messages rendered by the chat template (with the request's `chat_template_kwargs` and `tools`) and
    encoded (content never a control token), metered."""
    template = options.chat_template
    if template is None:
        raise InvalidRequestError(
            "messages",
            "this model folder has no chat template (tokenizer_config.json chat_template or chat_template.jinja); "
            "start the server with --chat-template FILE, or use /v1/completions",
        )
    plain = [
        with_argument_objects({**m.model_dump(exclude_none=True), "content": "" if m.content is None else m.content})
        for m in messages
    ]
    chars = (
        sum(len(json.dumps(m)) for m in plain) + len(json.dumps(template_kwargs or {})) + len(json.dumps(tools or []))
    )
    limits = RenderLimits(engine.max_prompt_chars, options.chat_template_timeout)
    return await engine.tokenize_with(
        chars, tokenizer_jobs.chat_encode, template, plain, add_generation_prompt, limits, template_kwargs, tools
    )


def with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
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


class ChatView(Tokens):
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
        return usage_object(self.prompt_tokens, completions, self.cached)

    def chunk(self, p: int, out: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        if out.index not in self.started:
            self.started.add(out.index)
            role = {"index": out.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}  # fmt: skip
            chunks.append({**self._head("chat.completion.chunk"), "choices": [role]})
        delta = self._delta(out)
        if delta or out.finished or (self.req.logprobs and out.new_token_ids):
            finish = FINISH.get(out.finish_reason) if out.finished else None  # type: ignore[arg-type]
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
                c["usage"] = running_usage(self.prompt_tokens, tokens)
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
                "finish_reason": FINISH.get(c.finish_reason),  # type: ignore[arg-type]
                "stop_reason": c.stop_reason,
            }
            for c in done
        ]
        for choice in choices:
            if choice["message"].get("tool_calls") and choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        usage = self._usage([c.usage for c in done])
        return {**self._head("chat.completion"), "choices": choices, "usage": usage}
