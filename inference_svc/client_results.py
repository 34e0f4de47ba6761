"""Typed results of the Python clients: what `TandemClient.generate` / `generate_stream` return instead of raw
protobuf messages.

Contract:
- `GenerateResult.from_proto` and `StreamChunk.from_proto` convert one message; enums become `FinishReason`
  members (`FinishReason.STOP`, a `str` enum whose value is "stop"), never protobuf integers; the matched stop is
  `stop_reason` (the stop string, or the stop token id; None for EOS or when not stopped).
- The value types (`Usage`, `Timing`, `TokenLogprob`, `FinishReason`) are the engine's own (`engine.types`, which
  imports nothing heavy), so a result reads the same in-process and over the wire.
- `raw` keeps the protobuf message for anything not mirrored here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference_svc.engine.types import FinishReason, Timing, TokenLogprob, Usage
from inference_svc.proto_gen import inference_pb2 as pb

_FINISH = {
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
}


def finish_reason(value: int) -> FinishReason | None:
    """A proto FinishReason → the enum member (None for UNSPECIFIED: not finished)."""
    return _FINISH.get(value)  # type: ignore[call-overload]


def _stop(msg: Any) -> str | int | None:
    which = msg.WhichOneof("matched_stop")
    return None if which is None else getattr(msg, which)


def _positions(entries: Any) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(e.token_id, e.logprob, tuple((t.token_id, t.logprob) for t in e.top)) for e in entries)


def _usage(u: pb.Usage) -> Usage:
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens, u.draft_tokens, u.accepted_draft_tokens,
                 u.decode_steps)  # fmt: skip


def _timing(t: pb.Timing) -> Timing:
    return Timing(t.queue_ms, t.ttft_ms, t.tpot_ms, t.total_ms)


@dataclass(frozen=True)
class Choice:
    """One of a request's n completions."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    logprobs: tuple[float, ...]
    top_logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class GenerateResult:
    """The whole answer of `Generate`: choice 0's fields at the top, every choice in `choices` when n > 1."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    usage: Usage
    timing: Timing
    logprobs: tuple[float, ...]
    top_logprobs: tuple[TokenLogprob, ...]
    prompt_logprobs: tuple[TokenLogprob, ...]
    """One per prompt token after the first, when asked for."""
    choices: tuple[Choice, ...]
    raw: pb.GenerateResponse

    @classmethod
    def from_proto(cls, m: pb.GenerateResponse) -> GenerateResult:
        choices = tuple(
            Choice(c.index, c.text, tuple(c.token_ids), finish_reason(c.finish_reason), _stop(c), tuple(c.logprobs),
                   _positions(c.top_logprobs))
            for c in m.choices
        )  # fmt: skip
        return cls(
            request_id=m.request_id,
            text=m.text,
            token_ids=tuple(m.token_ids),
            finish_reason=finish_reason(m.finish_reason),
            stop_reason=_stop(m),
            usage=_usage(m.usage),
            timing=_timing(m.timing),
            logprobs=tuple(m.logprobs),
            top_logprobs=_positions(m.top_logprobs),
            prompt_logprobs=_positions(m.prompt_logprobs),
            choices=choices,
            raw=m,
        )


@dataclass(frozen=True)
class StreamChunk:
    """One `GenerateStream` message. `finish_reason`, `usage` and `timing` are set on a completion's last one."""

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    usage: Usage | None
    timing: Timing | None
    logprobs: tuple[float, ...]
    top_logprobs: tuple[TokenLogprob, ...]
    prompt_logprobs: tuple[TokenLogprob, ...]
    raw: pb.GenerateStreamResponse

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_proto(cls, m: pb.GenerateStreamResponse) -> StreamChunk:
        return cls(
            request_id=m.request_id,
            index=m.index,
            text=m.text,
            token_ids=tuple(m.token_ids),
            finish_reason=finish_reason(m.finish_reason),
            stop_reason=_stop(m),
            usage=_usage(m.usage) if m.HasField("usage") else None,
            timing=_timing(m.timing) if m.HasField("timing") else None,
            logprobs=tuple(m.logprobs),
            top_logprobs=_positions(m.top_logprobs),
            prompt_logprobs=_positions(m.prompt_logprobs),
            raw=m,
        )
