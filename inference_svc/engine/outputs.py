"""Output assembly: what one step did to one request becomes a `RequestOutput`; a finished request, a
`GenerationResult`.

Contract:
- `to_output(event)` is the one place a scheduler `StepEvent` turns into the public `RequestOutput`: usage so far
  (prompt, output and cached tokens, drafts kept), logprobs only when the request asked for them, the finish
  reason, stop reason and `Timing` on the last increment only.
- `Timing` is in milliseconds from the request's arrival (`time.monotonic()`); TPOT is (finish − first token) /
  (output tokens − 1).
- `generation_result` assembles `Engine.generate`'s whole-request result from the increments a `Completion`
  gathered. Plain functions of their arguments: no engine state lives here.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference_svc.engine.scheduler import StepEvent
from inference_svc.engine.sequence import Sequence
from inference_svc.engine.types import Completion, FinishReason, RequestOutput, Timing, TokenLogprob, Usage


@dataclass(frozen=True)
class GenerationResult:
    """The whole of one request, as returned by `Engine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    timing: Timing
    logprobs: list[float] | None = None
    top_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: str | int | None = None


def generation_result(request_id: str, prompt_token_ids: list[int], done: Completion) -> GenerationResult:
    """The whole of one finished request, from the increments `done` gathered."""
    return GenerationResult(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        token_ids=done.token_ids,
        text=done.text,
        finish_reason=done.finish_reason or FinishReason.STOP,
        usage=done.usage,
        timing=done.timing or Timing(),
        logprobs=done.logprobs,
        top_logprobs=done.top_logprobs,
        prompt_logprobs=done.prompt_logprobs,
        stop_reason=done.stop_reason,
    )


def to_output(e: StepEvent) -> RequestOutput:
    """The `RequestOutput` of one step's event (usage so far; timing when it finished)."""
    seq = e.seq
    usage = Usage(
        seq.num_prompt_tokens,
        seq.num_output_tokens,
        seq.num_cached_prompt_tokens,
        draft_tokens=seq.num_draft_tokens,
        accepted_draft_tokens=seq.num_accepted_tokens,
        decode_steps=seq.num_token_steps,
    )
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=e.new_token_ids,
        text_delta=e.text_delta,
        logprobs=e.logprobs if seq.sampling.wants_logprobs else None,
        top_logprobs=e.top_logprobs,
        prompt_logprobs=e.prompt_logprobs,
        finished=e.finished,
        stop_reason=seq.stop_reason if e.finished else None,
        finish_reason=seq.finish_reason if e.finished else None,
        usage=usage,
        timing=timing(seq) if e.finished else None,
        error=e.error,
    )


def timing(seq: Sequence) -> Timing:
    """A finished sequence's times, in milliseconds from its arrival (`time.monotonic()` stamps)."""

    def ms(t: float | None) -> float:
        return 0.0 if t is None else (t - seq.arrival_time) * 1000.0

    n = seq.num_output_tokens
    tpot = 0.0
    if n > 1 and seq.first_token_time is not None and seq.finish_time is not None:
        tpot = (seq.finish_time - seq.first_token_time) * 1000.0 / (n - 1)
    return Timing(queue_ms=ms(seq.first_scheduled_time), ttft_ms=ms(seq.first_token_time), tpot_ms=tpot,
                  total_ms=ms(seq.finish_time))  # fmt: skip
