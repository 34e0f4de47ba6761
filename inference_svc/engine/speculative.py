"""Speculative decoding: who drafts, how many tokens, and when to stop trying.

Contract:
- A verify step feeds a decoding sequence's last token plus K drafted tokens to the target model as one chunk of
  K + 1 query rows over the paged cache (its attention: one decode query per row, over its context so far; see
  `model_runner.QUERY_CHUNK_MAX`), so one weight read scores K + 1 positions.
  Which of those tokens are kept is `rejection.verify`'s business; this module only proposes. A proposer returns
  a `Draft`: the tokens, and the distributions they were sampled from when they were sampled (a draft model on a
  sampled request, `draft_model.DraftModelProposer`); n-gram drafts are point masses.
- `NgramProposer` drafts by prompt lookup: the longest suffix of the sequence (n from `ngram_max` down to
  `ngram_min` tokens) that occurred earlier in its prompt or output proposes the K tokens that followed its most
  recent earlier occurrence (when those run past the end, the match overlaps the suffix: the sequence is looping,
  and the draft continues the loop). Its per-sequence index (n-gram → latest continuation position) is derived
  data: it is brought up to date from `seq.token_ids` (which only grows) at each proposal, dropped by `forget`.
- `SpeculationPolicy` owns the per-sequence decision of K. It keeps an exponential moving average of the draft
  acceptance rate α (starting optimistic, at 1) and, before each proposal, picks the K in [1, K_max] that
  maximizes expected tokens per unit of step cost, `(1 - α^(K+1)) / (1 - α)` over `1 + verify_cost · K`, where
  `verify_cost` is the cost of one extra query row relative to a whole decode step. When no K beats plain decoding
  (one token for cost 1), the sequence backs off: it decodes plainly for a pause that doubles at each consecutive
  back-off (2, 4, ... up to `MAX_PAUSE` steps), then probes with K = 1 from α = `verify_cost` (the break-even
  point of K = 1): one rejected probe backs off again, one kept probe resumes speculation. A proposer with no match
  costs nothing and does not count as a rejection.
- Nothing here writes a `Sequence`: the policy's state is its own, keyed by request id, dropped by `forget`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from inference_svc.engine.sequence import Sequence

MAX_PAUSE = 64
"""Longest back-off, in steps, before a sequence whose drafts were being rejected tries again."""
EMA_WEIGHT = 0.3
"""Weight of the latest verify step's acceptance rate in the moving average."""


class Draft(NamedTuple):
    """What a proposer drafted for one sequence."""

    tokens: tuple[int, ...] = ()
    probs: torch.Tensor | None = None
    """[K, V] fp32: the distribution each token was sampled from (a draft model's, for a sampled request); None:
    point masses (a deterministic proposer, or greedy drafting)."""


class Proposer(Protocol):
    writes_kv: bool
    """Whether proposing writes K/V at the drafted positions (a draft model), so their slots must come first."""

    def propose(self, seq: Sequence, k: int) -> Draft: ...

    def forget(self, request_id: str) -> None: ...


class NgramProposer:
    """Prompt-lookup drafting (see the module docstring)."""

    writes_kv = False

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, seq: Sequence, k: int) -> Draft:
        """Up to k tokens that followed the latest earlier occurrence of seq's longest matching suffix."""
        if k <= 0:
            return Draft()
        index = self._index.get(seq.request_id)
        if index is None:
            index = self._index[seq.request_id] = _NgramIndex(self.ngram_min, self.ngram_max)
        tokens = seq.token_ids
        index.catch_up(tokens)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            start = index.latest[n - self.ngram_min].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return Draft(tuple(_continuation(tokens, start, k)))
        return Draft()

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)


def _continuation(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens from `start`; where they run past the end, the draft continues itself with period len - start
    (a match that overlaps the suffix is a loop: its continuation is the loop again)."""
    n = len(tokens)
    out: list[int] = []
    for i in range(k):
        out.append(tokens[start + i] if start + i < n else out[start + i - n])
    return out


@dataclass
class _NgramIndex:
    """For each n, n-gram → the position right after its latest occurrence that has a continuation."""

    ngram_min: int
    ngram_max: int
    indexed: int = 1
    """Continuation positions [1, indexed) are in `latest`."""
    latest: list[dict[tuple[int, ...], int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.latest = [{} for _ in range(self.ngram_max - self.ngram_min + 1)]

    def catch_up(self, tokens: list[int]) -> None:
        # position p has continuation tokens[p] only when p < len(tokens): the current suffix is never its own match
        for p in range(self.indexed, len(tokens)):
            for n in range(self.ngram_min, min(self.ngram_max, p) + 1):
                self.latest[n - self.ngram_min][tuple(tokens[p - n : p])] = p
        self.indexed = max(self.indexed, len(tokens))


@dataclass
class _SeqSpeculation:
    acceptance: float = 1.0
    """Moving average of accepted / drafted over this sequence's verify steps."""
    pause: int = 0
    """Steps left to decode plainly."""
    backoffs: int = 0
    """Consecutive back-offs (sets the next pause)."""


class SpeculationPolicy:
    """Per-sequence K under a cost model, with back-off (see the module docstring)."""

    def __init__(self, verify_cost: float) -> None:
        if not 0 <= verify_cost < 1:
            raise ValueError(f"verify_cost must be in [0, 1), got {verify_cost}")
        self.verify_cost = verify_cost
        self._state: dict[str, _SeqSpeculation] = {}

    def num_drafts(self, request_id: str, k_max: int) -> int:
        """How many tokens to draft for this sequence this step (0: decode plainly)."""
        if k_max <= 0:
            return 0
        s = self._state.setdefault(request_id, _SeqSpeculation())
        if s.pause > 0:
            s.pause -= 1
            return 1 if s.pause == 0 else 0  # the retry after a pause probes with one draft
        k, gain = best_k(s.acceptance, k_max, self.verify_cost)
        if gain > 1.0:
            return k
        s.backoffs += 1
        s.pause = min(2**s.backoffs, MAX_PAUSE)
        s.acceptance = self.verify_cost  # the probe after the pause: one rejection backs off again, one keep goes on
        return 0

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """Record one verify step of this sequence: `accepted` of its `drafted` tokens were kept."""
        if drafted <= 0:
            return
        s = self._state.setdefault(request_id, _SeqSpeculation())
        s.acceptance = (1 - EMA_WEIGHT) * s.acceptance + EMA_WEIGHT * accepted / drafted
        if accepted:
            s.backoffs = 0

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)


def expected_tokens(acceptance: float, k: int) -> float:
    """Expected tokens one verify of k drafts yields when each draft is kept with probability `acceptance`
    (independently, stopping at the first rejection): 1 + α + α² + ... + α^k."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_k(acceptance: float, k_max: int, verify_cost: float) -> tuple[int, float]:
    """The k in [1, k_max] with the most expected tokens per unit of step cost, and that ratio."""
    return max(
        ((k, expected_tokens(acceptance, k) / (1.0 + verify_cost * k)) for k in range(1, k_max + 1)),
        key=lambda kv: kv[1],
    )


class Speculator:
    """What the scheduler asks before each decode: the drafts for one sequence (empty: decode plainly).

    Per request, `SamplingParams.num_speculative_tokens` (None: the engine's `num_speculative_tokens` when it was
    started with a method, else 0) caps K; `speculative_max_batch` turns drafting off in a step while the engine
    holds more requests than that (running or waiting: a wide batch is compute-bound, so extra rows are no longer
    free, and while requests are being admitted drafted rows would take budget from their prefill).
    """

    def __init__(self, proposer: Proposer, policy: SpeculationPolicy, default_k: int, max_batch: int | None) -> None:
        self.proposer = proposer
        self.policy = policy
        self.default_k = default_k
        self.max_batch = max_batch

    def k_max(self, seq: Sequence) -> int:
        asked = seq.sampling.num_speculative_tokens
        return self.default_k if asked is None else asked

    def allows(self, num_requests: int) -> bool:
        """Whether a step drafts at all while the engine holds this many requests (running or waiting)."""
        return self.max_batch is None or num_requests <= self.max_batch

    def num_drafts(self, seq: Sequence, cap: int) -> int:
        """The policy's K for seq this step, at most cap (0: decode plainly). Call once per step and sequence."""
        return self.policy.num_drafts(seq.request_id, min(self.k_max(seq), cap))

    @property
    def writes_kv(self) -> bool:
        return self.proposer.writes_kv

    def propose(self, seq: Sequence, k: int) -> Draft:
        """Up to k drafts for seq."""
        return self.proposer.propose(seq, k) if k > 0 else Draft()

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.policy.observe(seq.request_id, drafted, accepted)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self.policy.forget(request_id)
