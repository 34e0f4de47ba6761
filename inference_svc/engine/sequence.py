"""One request's state inside the engine.

Contract:
- A `Sequence` is plain state. The scheduler is its only writer (status, tokens, computed count, block table,
  timings); the model runner and the sampler only read it; the engine only creates it.
- Invariants: `num_computed_tokens <= len(token_ids)`; the block table covers at least `num_computed_tokens`
  tokens; `token_ids[:num_prompt_tokens]` is the prompt and the rest is the output.
- A preempted sequence goes back to WAITING with its blocks freed and `num_computed_tokens = 0`: its prompt and the
  tokens it already produced are recomputed (prefilled) when it is admitted again; output already streamed is kept.
- A `ScheduledSeq` is one sequence's share of one step, as the scheduler decides it and the model runner computes
  it (it lives here, beside `Sequence`, so that neither of the two imports the other).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from inference_svc.engine.detokenizer import IncrementalDetokenizer
from inference_svc.engine.types import FinishReason, SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    """Queued, or preempted: holds no KV blocks."""
    RUNNING = "running"
    """Admitted: holds KV blocks for every token it has (or is about to have) computed."""
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    seq_index: int
    """Admission-order key: a larger index is a newer request (the preemption victim)."""
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival_time: float
    detokenizer: IncrementalDetokenizer
    eos_ids: frozenset[int]
    generator: torch.Generator | None = None
    """This request's own random generator when sampling.seed is set (batch-invariant sampling)."""
    lora_slot: int = -1
    """The adapter slot that serves this request (`inference_svc.lora.slots`); -1: the base model."""
    cache_salt: int = 0
    """Its prefix-cache namespace (`BlockManager`): 0 for the base model, the adapter loading's salt otherwise."""

    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache."""
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    """Chain hashes of the leading full blocks already registered with the prefix cache (or looked up in it)."""
    num_cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission (reported in Usage)."""
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    """The stop string matched or the stop token id produced (finish_reason STOP); None for EOS."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """When asked for: one entry per prompt token computed so far (the first is None)."""
    prompt_logprobs_sent: bool = False
    num_token_steps: int = 0
    """Steps that appended output tokens (one each, or several for a verify step of speculative decoding)."""
    num_draft_tokens: int = 0
    """Drafted tokens verified for this sequence (speculative decoding)."""
    num_accepted_tokens: int = 0
    """Of those, the drafts the target kept."""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether admission may reuse cached blocks (not when prompt logprobs need every prompt position)."""
        return self.sampling.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: compute positions [start, start + num_tokens).

    With `draft` (speculative decoding), positions index `seq.token_ids + draft`: the drafted tokens are not in the
    sequence. A verify item is a decoding sequence's last token followed by all its drafts (every row is scored);
    a draft model's decode step is one drafted token at its position.
    """

    seq: Sequence
    start: int
    num_tokens: int
    draft: tuple[int, ...] = ()
    draft_probs: torch.Tensor | None = None
    """[K, V] fp32: the distributions the drafts were sampled from (None: point masses)."""

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start == self.seq.num_tokens - 1 and self.start > 0 and not self.draft

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence (its drafts included), so it produces a token."""
        return self.start + self.num_tokens == self.seq.num_tokens + len(self.draft)

    @property
    def num_sample_rows(self) -> int:
        """Logits rows this item gets back: one per position from the sequence's last token on (K + 1 for a
        verify item, 1 for any other item that samples), else 0."""
        if not self.samples:
            return 0
        return min(self.num_tokens, self.start + self.num_tokens - self.seq.num_tokens + 1)

    @property
    def token_ids(self) -> list[int]:
        """The tokens at positions [start, start + num_tokens)."""
        end = self.start + self.num_tokens
        if not self.draft or end <= self.seq.num_tokens:
            return self.seq.token_ids[self.start : end]
        return [*self.seq.token_ids, *self.draft][self.start : end]
