"""The OpenAI-compatible request bodies, validated, and their translation to engine `SamplingParams`.

Contract:
- `CompletionRequest` and `ChatCompletionRequest` accept the fields of OpenAI's `/v1/completions` and
  `/v1/chat/completions` and vLLM's extras (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
  `stop_token_ids`, `prompt_logprobs`), plus `timeout` (seconds: the request's deadline). Fields mean what they
  mean there:
  - `temperature` defaults to 1.0 and `top_p` to 1.0, as OpenAI's do (Tandem's gRPC default is greedy);
  - completions: `max_tokens` defaults to 16 (OpenAI's legacy default), `logprobs` is a count 0..5 of
    alternatives, `echo` prepends the prompt (with its logprobs when `logprobs` is set);
  - chat: `max_completion_tokens` (or its older name `max_tokens`) defaults to the server's limit, `logprobs` is
    a boolean and `top_logprobs` a count 0..20;
  - `top_k` -1 or 0 disables it (vLLM's spelling and Tandem's);
  - `logit_bias` maps token ids, written as JSON strings in plain decimal ("5"; not "05", "٥" or "1_0", so no
    two keys name one id), to biases in [-100, 100];
  - token ids (a token-id `prompt`, `stop_token_ids`, `/detokenize`'s `tokens`) are JSON integers: `true` is not
    a token id.
- Structured outputs: OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `name`, `schema`,
  `strict`), vLLM's `structured_outputs` object (exactly one of `json`, `regex`, `choice`, `grammar`,
  `json_object`) and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` become one
  `StructuredOutput` naming the parameter it came from (a grammar the engine cannot compile is a 400 naming it);
  two of them in one request is a 400.
- Tool calling (chat): `tools` (OpenAI's function tools: a name of 1-64 letters, digits, `_` or `-`, a JSON-schema
  `parameters` object), `tool_choice` (`none`, `auto`, `required`, or `{"type": "function", "function": {"name"}}`
  naming one of the tools), `parallel_tool_calls`; `ChatCompletionRequest.tool_setup()` checks them together.
- Unknown fields are refused by `parse`, unless the caller passes `unknown` (the server's `RequestPolicy`, which
  by default logs and drops them, as vLLM does). Fields OpenAI has that Tandem does not serve (`functions`,
  `suffix`, ...) are refused by name with a 400 that says so.
- `stream_options.continuous_usage_stats` (vLLM's) and `chat_template_kwargs` (vLLM's) are served (completions.py,
  chat.py).
- Every refusal is `InvalidRequestError` whose `field` is the request parameter (`messages[0].content`), turned into
  OpenAI's error shape by the app. Nothing here touches the engine.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from inference_svc.embeddings import MAX_EMBEDDING_INPUTS
from inference_svc.engine.types import MAX_N, SamplingParams, StructuredOutput
from inference_svc.errors import InvalidRequestError

UNSUPPORTED = (
    "functions", "function_call", "audio", "modalities", "prediction", "suffix", "web_search_options",
)  # fmt: skip
"""OpenAI (and vLLM) fields outside this server's scope: a request that sets one gets a 400 naming it."""

COMPLETIONS_MAX_LOGPROBS = 5
_CANONICAL_ID = re.compile(r"0|[1-9][0-9]*")
"""A `logit_bias` key: a token id in plain ASCII decimal, so that two keys never name the same id."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with `include_usage`, every chunk also carries the usage of its choice so far."""
    include_obfuscation: bool | None = None
    """OpenAI's stream padding against side channels; accepted and ignored (no padding is added)."""


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    """Accepted: the output always follows the schema; an object without `additionalProperties` admits no others."""


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _schema_text(value: dict[str, Any] | str, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(param, f"the JSON schema is not valid JSON: {exc}") from None
    return json.dumps(value)


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    best_of: int | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    prompt_logprobs: int | None = None
    # Tandem's
    timeout: float | None = Field(None, gt=0)
    """Seconds from arrival until the request is abandoned (DEADLINE: 504, or an error event in a stream)."""
    num_speculative_tokens: int | None = None
    """Speculative decoding for this request: at most this many prompt-lookup drafts per step (0: off); None: the
    server's setting. The output is unchanged by it (greedy) or keeps its distribution (sampled)."""
    # structured outputs (OpenAI's, vLLM's, vLLM's older names)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutput | None:
        """The one output constraint this request sets (see the module docstring), or None."""
        found: list[StructuredOutput] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutput("json_object", "", "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError("response_format.json_schema", "json_schema needs a 'schema'")
            spec = _schema_text(rf.json_schema.schema_, "response_format.json_schema.schema")
            found.append(StructuredOutput("json", spec, "response_format"))
        so = self.structured_outputs
        if so is not None:
            p = "structured_outputs"
            set_ = [
                k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(so, k) not in (None, False)
            ]
            if len(set_) != 1:
                raise InvalidRequestError(p, "set exactly one of json, regex, choice, grammar, json_object")
            found.append(self._one(set_[0].rstrip("_"), getattr(so, set_[0]), f"{p}.{set_[0].rstrip('_')}"))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append(self._one(kind, value, f"guided_{kind}"))
        if len(found) > 1:
            raise InvalidRequestError(found[1].param, f"only one output constraint per request (also {found[0].param})")
        return found[0] if found else None

    @staticmethod
    def _one(kind: str, value: Any, param: str) -> StructuredOutput:
        if kind == "json":
            return StructuredOutput("json", _schema_text(value, param), param)
        if kind == "json_object":
            return StructuredOutput("json_object", "", param)
        if kind == "choice":
            return StructuredOutput("choice", json.dumps(value), param)
        return StructuredOutput(kind, value, param)

    def sampling(self, max_new_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                "best_of", f"only best_of == n is served (got best_of={self.best_of}, n={self.n})"
            )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not _CANONICAL_ID.fullmatch(key):  # not "٥", "1_0", " 5", "+5" or "05": int() takes them all
                raise InvalidRequestError(
                    "logit_bias", f'keys are token ids in plain decimal ("5", not "05"), got {key!r}'
                )
            bias[int(key)] = value
        top_k = self.top_k if self.top_k is not None else 0
        if top_k == -1:
            top_k = 0
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": top_k,
            "min_p": self.min_p or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "top_logprobs": top_logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "logit_bias": bias,
            "min_tokens": self.min_tokens,
            "num_speculative_tokens": self.num_speculative_tokens,
            "structured": self.structured(),
        }
        return SamplingParams(**kwargs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's `continuous_usage_stats`, which needs `include_usage` there too)."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_Common):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=COMPLETIONS_MAX_LOGPROBS)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, each a text or a token-id list (OpenAI's four spellings)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt", "the prompt list is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling(self, default_max: int) -> SamplingParams:
        logprobs = self.logprobs is not None
        params = self.sampling(self.max_tokens or default_max, logprobs, self.logprobs or 0)
        if self.echo and logprobs and params.prompt_logprobs is None:  # echo's logprobs are the prompt's
            params = _with(params, prompt_logprobs=self.logprobs or 0)
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id ... reach the template as they are
    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: extra variables for the chat template (`enable_thinking`); one the server sets is refused."""
    include_reasoning: bool = True
    """vLLM's: with a reasoning parser, whether `reasoning_content` is returned (False: the block is dropped)."""
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def tool_setup(self) -> tuple[list[dict[str, Any]] | None, str, str | None]:
        """(the tools as the template gets them, or None; "none", "auto" or "forced"; the forced function's name,
        None for any of them)."""
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise InvalidRequestError("tool_choice", "needs tools")
            return None, "none", None
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools", "two tools have the same name")
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise InvalidRequestError("tool_choice", f"no tool is named {choice.function.name!r}")
            return tools, "forced", choice.function.name
        return tools, "forced" if choice == "required" else choice, None

    def to_sampling(self, default_max: int) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        max_new = self.max_completion_tokens or self.max_tokens or default_max
        return self.sampling(max_new, self.logprobs, self.top_logprobs or 0)


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize`: a text (or chat messages, rendered by the chat template) → its token ids."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    """Prepend BOS to a text prompt (chat messages get what their template writes)."""
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(BaseModel):
    """OpenAI's `POST /v1/embeddings`: `input` as a string, a list of strings, token ids or a list of token-id
    lists; `encoding_format` float or base64 (little-endian float32); `dimensions` keeps that many components."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: str = "float"
    dimensions: int | None = Field(None, ge=1)

    def inputs(self) -> list[str | list[int]]:
        if self.encoding_format not in ("float", "base64"):
            raise InvalidRequestError("encoding_format", f"must be float or base64, got {self.encoding_format!r}")
        x = self.input
        if isinstance(x, str):
            return [x]
        if not x:
            raise InvalidRequestError("input", "the input list is empty")
        if len(x) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequestError("input", f"holds {len(x)} inputs; at most {MAX_EMBEDDING_INPUTS} are accepted")
        if all(isinstance(t, int) for t in x):
            return [list(x)]  # type: ignore[arg-type]
        return list(x)  # type: ignore[arg-type]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


def _with(params: SamplingParams, **changes: Any) -> SamplingParams:
    return dataclasses.replace(params, **changes)


def parse(model: type[BaseModel], body: Any, unknown: Callable[[list[str]], None] | None = None) -> Any:
    """Validate a decoded JSON body; raise `InvalidRequestError` naming the first wrong parameter. Fields the model
    does not declare are refused, or, when `unknown` is given, passed to it by name (`stream_options.x`; it may
    raise) and dropped."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "the request body must be a JSON object")
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise InvalidRequestError(name, f"'{name}' is not supported by this server")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        extra = [e["loc"] for e in exc.errors() if e.get("type") == "extra_forbidden"]
        if unknown is not None and extra:
            unknown([_param(loc) for loc in extra])
            return parse(model, _without(body, extra))
        err = exc.errors()[0]
        field = _param(err.get("loc", ()))
        if err.get("type") == "extra_forbidden":
            raise InvalidRequestError(field, f"unknown parameter '{field}'") from None
        raise InvalidRequestError(field, str(err.get("msg", "invalid value"))) from None


def _without(body: dict[str, Any], locations: list[tuple[Any, ...]]) -> dict[str, Any]:
    """`body` without the values at these pydantic locations (union branch names in them skipped). The objects on
    the way to a removed value are copied (a prompt list beside them is shared, not copied); `body` is unchanged."""
    body = dict(body)
    for loc in locations:
        steps = [part for part in loc if not isinstance(part, str) or "[" not in part]
        at: Any = body
        for part in steps[:-1]:
            if isinstance(at, dict) and isinstance(at.get(part), dict):
                at[part] = dict(at[part])
            elif isinstance(at, dict) and isinstance(at.get(part), list):
                at[part] = list(at[part])
            elif isinstance(at, list) and isinstance(part, int) and part < len(at) and isinstance(at[part], dict):
                at[part] = dict(at[part])
            else:
                break
            at = at[part]
        else:
            if isinstance(at, dict):
                at.pop(steps[-1], None)
    return body


def _param(loc: tuple[Any, ...]) -> str:
    """A pydantic location as the request parameter's path: ('messages', 0, 'content') → 'messages[0].content'.
    Union branch names pydantic adds (e.g. 'str', 'list[int]') are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "dict", "list"}):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "body"
