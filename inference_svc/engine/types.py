"""The engine's public value types: what a caller passes in and what it gets back.

Contract:
- `SamplingParams` validates itself at construction and raises `InvalidRequestError` naming the field
  (the gRPC layer turns that into INVALID_ARGUMENT). Limits that depend on the engine (max_new_tokens ceiling,
  context length, vocabulary) are checked by the engine when the request is added.
- `RequestOutput` is one increment for one request: the tokens and text produced by one engine step. The last
  increment of a request has `finished=True`, a `finish_reason`, its `stop_reason` and final `usage`/`timing`.
  The first increment that carries a token also carries the prompt's logprobs when they were asked for.
- Log-probabilities are those of the model's own distribution (log_softmax of the raw logits, before penalties,
  biases, temperature or truncation), as vLLM reports them by default; `TokenLogprob` holds one token's.
- `EngineInfo` is what an engine reports about itself (model, sizes, settings): typed, never a dict read by key;
  `EngineStats` is a snapshot of its load and counters (for metrics).
- These are plain data: no engine state lives here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inference_svc.errors import InvalidRequestError
from inference_svc.executor.plan import LoadPlan

if TYPE_CHECKING:  # annotations only: this module stays free of the engine's imports
    from pathlib import Path

    from inference_svc.engine.config import EngineConfig
    from shared_model.config import ModelConfig

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20
"""Most alternatives per position (OpenAI's chat limit; the legacy completions API allows 5)."""
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on one bias value: -100 bans a token in practice, +100 forces it."""
MAX_N = 16
"""Most completions of one request (`n`)."""
MAX_SPECULATIVE_TOKENS = 16
"""Most drafted tokens one verify step of speculative decoding scores."""
MAX_GRAMMAR_CHARS = 65536
"""Longest structured-output specification (a JSON schema, regex, choice list or grammar), in characters."""
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")


class FinishReason(str, enum.Enum):
    """Why a request ended."""

    STOP = "stop"
    """An EOS token, a stop token id or a stop string was produced."""
    LENGTH = "length"
    """max_new_tokens was reached, or the context is full."""
    CANCELLED = "cancelled"
    """Aborted from outside: client cancel, disconnect, deadline, shutdown."""
    ERROR = "error"
    """Failed inside the engine, this request alone (e.g. its logits were not finite); `RequestOutput.error`."""


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output's text, and its compiled form once compiled (`engine.grammar`).

    kind: "json" (spec: a JSON schema, as JSON text), "json_object" (any JSON object; spec ignored), "regex" (spec:
    a regular expression the whole output matches), "choice" (spec: a JSON list of strings, the output one of them)
    or "grammar" (spec: an EBNF grammar with a `root` rule, or a Lark grammar when it has no `::=`), or "tool_calls"
    (spec: JSON `{"format", "functions": [{"name", "parameters"}], "max_calls"}`: tool calls in a model family's
    format, `openai_api.tool_calls.grammar_spec`). `param` is the
    request parameter it came from (`response_format`, `structured_outputs`, ...), named in errors."""

    kind: str
    spec: str = ""
    param: str = "structured_outputs"
    compiled: object | None = field(default=None, compare=False, repr=False)
    """The grammar engine's compiled form (`engine.grammar.GrammarCompiler.compile` sets it); None: not yet."""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(self.param, f"unknown kind {self.kind!r}; one of {', '.join(STRUCTURED_KINDS)}")
        if not isinstance(self.spec, str) or (not self.spec and self.kind != "json_object"):
            raise InvalidRequestError(self.param, f"{self.kind}: the specification is empty")
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(
                self.param, f"{self.kind}: at most {MAX_GRAMMAR_CHARS} characters, got {len(self.spec)}"
            )

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (the compile cache's key)."""
        return (self.kind, "" if self.kind == "json_object" else self.spec)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings."""

    max_new_tokens: int = 64
    """Upper bound on generated tokens (> 0)."""
    temperature: float = 0.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p × the top probability; 0 disables."""
    seed: int | None = None
    """Seed of this request's own generator: the same seed gives the same tokens whatever the batch."""
    repetition_penalty: float = 1.0
    """CTRL-style penalty (> 0) on tokens already in the prompt or output; 1 disables."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when one appears; it is stripped from the output."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (kept out of the text)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    logprobs: bool = False
    """Return the log-probability of each chosen token."""
    top_logprobs: int = 0
    """Also return the `top_logprobs` most likely tokens of each generated position (0..MAX_TOP_LOGPROBS); > 0
    implies `logprobs`."""
    prompt_logprobs: int | None = None
    """Return each prompt token's log-probability given the tokens before it, with this many alternatives per
    position (0..MAX_TOP_LOGPROBS); None: not asked. The first prompt token has none. Such a request computes its
    whole prompt (the prefix cache is not read for it, since cached positions have no logits)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated (OpenAI's), in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was already generated (OpenAI's), in [-2, 2]."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling, each bias in [-100, 100]; a mapping is accepted
    and stored sorted by id."""
    min_tokens: int = 0
    """EOS and the stop token ids cannot be sampled, and stop strings are not matched, before this many tokens
    have been generated (vLLM's)."""
    num_speculative_tokens: int | None = None
    """Speculative decoding for this request: at most this many n-gram drafts verified per step (0: off,
    1..MAX_SPECULATIVE_TOKENS); None: the engine's setting (`--speculative`, `--num-speculative-tokens`). The
    output is the same as without it (greedy: token for token; sampled: in distribution). A seeded sampled
    request repeats itself under the same speculation: drafts change how its random stream is consumed."""
    structured: StructuredOutput | None = None
    """Constrain the output to a grammar (JSON schema, regex, choice, EBNF): every token is one the grammar allows,
    and EOS only where the grammar accepts (`engine.grammar`)."""
    lora_name: str | None = None
    """The LoRA adapter that serves this request (a `--lora-modules` name or one loaded at run time; HTTP: the
    `model` field, gRPC: `lora_name`); None: the base model. An adapter not loaded is NOT_FOUND (404)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise InvalidRequestError("max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:  # also rejects NaN
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise InvalidRequestError(
                "repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s:
                raise InvalidRequestError("stop", "stop strings must be non-empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    "stop", f"each stop string is at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}"
                )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "token ids must be >= 0")
        _check_count("top_logprobs", self.top_logprobs, MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_count("prompt_logprobs", self.prompt_logprobs, MAX_TOP_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also rejects NaN
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        object.__setattr__(self, "logit_bias", _normalized_bias(self.logit_bias))
        if self.num_speculative_tokens is not None:
            _check_count("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise InvalidRequestError("lora_name", f"must be a non-empty adapter name, got {self.lora_name!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequestError(
                "min_tokens", f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        """Whether each generated token's log-probability is returned (`logprobs`, or `top_logprobs` > 0)."""
        return self.logprobs or self.top_logprobs > 0

    @property
    def penalized(self) -> bool:
        """Whether any logit transform before temperature applies (penalties, biases or min_tokens)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )


def _check_count(name: str, value: object, maximum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= maximum:
        raise InvalidRequestError(name, f"must be an integer in [0, {maximum}], got {value!r}")


def _normalized_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (id, bias) pairs, validated; ids are checked against the vocabulary by the engine."""
    items = list(bias.items()) if isinstance(bias, Mapping) else list(bias)  # type: ignore[call-overload]
    if len(items) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(items)}")
    out: dict[int, float] = {}
    for item in items:
        try:
            token, value = item
            token = int(token)
            value = float(value)
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias", f"entries are token id -> number, got {item!r}") from None
        if token < 0:
            raise InvalidRequestError("logit_bias", f"token ids must be >= 0, got {token}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                "logit_bias", f"bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}"
            )
        out[token] = value
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class TokenLogprob:
    """One position's token, its log-probability, and the most likely alternatives there (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability) of the `top_logprobs` (or `prompt_logprobs`) most likely tokens."""


@dataclass(frozen=True)
class Usage:
    """Token accounting of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens whose K/V came from the prefix cache instead of being computed."""
    draft_tokens: int = 0
    """Speculative decoding: drafted tokens the model verified for this request."""
    accepted_draft_tokens: int = 0
    """Of those, the ones it kept (each saved one decode step)."""
    decode_steps: int = 0
    """Engine steps that produced this request's completion tokens (one token each without speculation)."""

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts / drafts (0 without speculation)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Completion tokens per step that produced any (1 without speculation)."""
        return self.completion_tokens / self.decode_steps if self.decode_steps else 0.0


@dataclass(frozen=True)
class Timing:
    """Latency of one request, in milliseconds from its arrival (engine monotonic clock)."""

    queue_ms: float = 0.0
    """Arrival until first scheduled."""
    ttft_ms: float = 0.0
    """Arrival until the first output token."""
    tpot_ms: float = 0.0
    """Mean time per output token after the first."""
    total_ms: float = 0.0
    """Arrival until finished."""


@dataclass(frozen=True)
class RequestOutput:
    """One step's increment for one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    """Text newly complete in this step: the deltas of a request concatenate to its full text."""
    logprobs: list[float] | None = None
    """Log-probabilities of new_token_ids, when requested."""
    top_logprobs: list[TokenLogprob] | None = None
    """Per new token, its log-probability and the top alternatives, when `top_logprobs` > 0."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """On the first increment with a token, when `prompt_logprobs` was set: one entry per prompt token (the
    first is None: nothing precedes it)."""
    index: int = 0
    """Which of the request's `n` completions this increment belongs to."""
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    """With finish_reason STOP: the stop string that matched, or the stop token id produced; None for EOS."""
    usage: Usage = field(default_factory=Usage)
    timing: Timing | None = None
    """Set on the final increment."""
    error: str | None = None
    """With finish_reason ERROR: why the engine failed this request (one line, no internals)."""


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves and the sizes it chose, typed (the server's GetModelInfo and logs read this)."""

    model_path: Path
    model_config: ModelConfig
    max_model_len: int
    """Longest prompt + completion: the smallest of --max-model-len, the model's positions and the KV pool."""
    dtype: str
    device: str
    attention_backend: str
    kv_blocks_total: int
    kv_bytes_per_token: int
    """`shared_model.ledger.kv_bytes_per_token` of the stored K/V dtype (scales included, rounded up to a byte)."""
    kv_cache_bytes: int
    weight_bytes: int
    """The weights as held: merged projections, quantized formats and their scales (`serving_weight_bytes`)."""
    peak_workspace_bytes: int
    config: EngineConfig
    """The engine's settings as given (block size, batching limits, prefix caching, ...)."""
    kv_cache_dtype: str = "auto"
    """The stored K/V dtype, resolved: 'fp32', 'bf16', 'fp16', 'fp8' or 'int8' (`--kv-cache-dtype`)."""
    kv_bytes_per_block: int = 0
    """Bytes of one KV block across all layers, scales included (`shared_model.ledger.kv_bytes_per_block`):
    the pool is kv_blocks_total of them."""
    draft_model_path: Path | None = None
    """Speculative decoding's draft model, when the engine drafts with one."""
    draft_kv_bytes_per_token: int = 0
    """The draft model's K/V per token (same K/V dtype as the target's)."""
    draft_kv_bytes_per_block: int = 0
    draft_kv_cache_bytes: int = 0
    """The draft model's pool: `kv_blocks_total` blocks of its own, addressed by the target's block tables;
    `kv_cache_bytes + draft_kv_cache_bytes` fit the KV budget."""
    draft_weight_bytes: int = 0
    compiled: bool = False
    """Whether steps run the compiled forward (`EngineConfig.compile`, resolved)."""
    compile_seconds: float = 0.0
    """Seconds the start-up compile took (target and draft model together; 0 when nothing was compiled)."""
    load_plan: LoadPlan = field(default_factory=LoadPlan)
    """Every serving lever's choice and reason, in the order the executor made them (`inference_svc.executor`)."""

    @property
    def quantization(self) -> str:
        """'none', 'int8' or 'int4' (`EngineConfig.quantization`)."""
        return self.config.quantization

    @property
    def num_parameters(self) -> int:
        return self.model_config.num_parameters()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_blocks_total * self.config.block_size


@dataclass
class Completion:
    """One completion accumulated from its increments: `Engine.generate`, the unary RPC and the HTTP API all build
    their whole answers with this, so the rules for joining increments live in one place."""

    request_id: str
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    usage: Usage = field(default_factory=Usage)
    timing: Timing | None = None
    error: str | None = None
    _text: list[str] = field(default_factory=list, repr=False)

    def add(self, out: RequestOutput) -> None:
        """Append one increment of this completion."""
        self.token_ids += out.new_token_ids
        self._text.append(out.text_delta)
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        if out.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + out.top_logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.usage = out.usage
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.timing = out.timing
            self.error = out.error

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and counters (for metrics)."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    """Blocks holding a registered prefix (in use or evictable)."""
    prefix_cache_hit_tokens: int
    """Prompt tokens found in the prefix cache, over all lookups (a counter)."""
    prefix_cache_queried_tokens: int
    """Prompt tokens looked up in the prefix cache, over all lookups (a counter)."""
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    cached_prompt_tokens_total: int
    spec_verify_steps_total: int = 0
    """Sequence-steps that verified drafts (speculative decoding)."""
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_emitted_tokens_total: int = 0
    """Tokens the verify steps produced: kept drafts plus the token each added."""
    running_lora_adapters: tuple[str, ...] = ()
    """LoRA adapters the running requests use."""
    waiting_lora_adapters: tuple[str, ...] = ()
    """LoRA adapters the waiting requests use."""
    max_lora: int = 0
    """Adapter slots (`max_loras`; 0: LoRA off)."""
    threads_active: int = 0
    """Intra-op threads the steps run on now (the thread governor's count, `inference_svc.executor.governor`)."""
    others_cpu_busy: float | None = None
    """CPUs' worth of other processes' load on this process's CPUs over the governor's last interval (None: not
    measured: the governor is off or has not read twice yet)."""

    @property
    def spec_acceptance_rate(self) -> float:
        """Kept drafts / drafts, over all verify steps."""
        return self.spec_accepted_tokens_total / self.spec_draft_tokens_total if self.spec_draft_tokens_total else 0.0

    @property
    def spec_tokens_per_step(self) -> float:
        """Tokens per verify step (1 would mean speculation never kept a draft)."""
        return self.spec_emitted_tokens_total / self.spec_verify_steps_total if self.spec_verify_steps_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up, over all admissions."""
        return (
            self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens if self.prefix_cache_queried_tokens else 0.0
        )
