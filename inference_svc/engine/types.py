"""The engine's public value types: what a caller passes in and what it gets back.

Contract:
- `SamplingParams` validates itself at construction and raises `InvalidRequestError` naming the field
  (the gRPC layer turns that into INVALID_ARGUMENT). Limits that depend on the engine (max_new_tokens ceiling,
  context length, vocabulary) are checked by the engine when the request is added.
- `RequestOutput` is one increment for one request: the tokens and text produced by one engine step. The last
  increment of a request has `finished=True`, a `finish_reason`, and final `usage`/`timing`.
- `EngineInfo` is what an engine reports about itself (model, sizes, settings): typed, never a dict read by key.
- These are plain data: no engine state lives here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inference_svc.errors import InvalidRequestError

if TYPE_CHECKING:  # annotations only: this module stays free of the engine's imports
    from pathlib import Path

    from inference_svc.engine.config import EngineConfig
    from shared_model.config import ModelConfig

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Usage:
    """Token accounting of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens whose K/V came from the prefix cache instead of being computed."""


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
    finished: bool = False
    finish_reason: FinishReason | None = None
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
    kv_cache_bytes: int
    weight_bytes: int
    """The weights as held: merged projections, quantized formats and their scales (`serving_weight_bytes`)."""
    peak_workspace_bytes: int
    config: EngineConfig
    """The engine's settings as given (block size, batching limits, prefix caching, ...)."""

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
