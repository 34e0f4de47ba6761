"""Token sampling from a batch of logits, each row with its own SamplingParams.

Contract:
- `sample(logits [S, V] fp32, requests)` returns one token id per row (and, when asked, its log-probability under
  the model's distribution: log_softmax of the raw logits, before penalties, temperature or truncation, with the
  `top_logprobs` most likely alternatives of that same distribution).
- Order of transforms: `logit_bias` (added) → repetition penalty (CTRL: positive logits divided, negative
  multiplied, over tokens in the prompt or output) → presence and frequency penalties (OpenAI's: over generated
  tokens only, `presence·[count > 0] + frequency·count` subtracted) → clamp to the finite range → `min_tokens`
  (EOS, unless ignored, and the stop token ids set to -inf while fewer than min_tokens tokens were generated)
  → greedy argmax when temperature is 0 → temperature → top-k → top-p → min-p → draw.
- No valid parameter overflows: penalized logits are clamped to the finite float range, and temperature divides
  `logits - rowmax` (all <= 0) and is floored at fp32's smallest normal number, so a temperature of 1e-38 (or
  5e-324) gives probability 0 to every token but the best, never NaN.
- A row of raw logits that is not finite (NaN or ±inf from the model) is never sampled from: it is reported in
  `Samples.failed` and its token is meaningless; the engine fails that request alone.
- A draw is `argmax(p / E)` with E ~ Exp(1) (equivalent to sampling from p). E comes from the request's own
  generator when it has a seed, so a seeded request draws the same numbers whatever the batch; unseeded rows share
  one engine generator. Everything else is vectorized over rows.
- Reads its inputs only; knows nothing about scheduling or text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from inference_svc.engine.logprobs import token_logprobs
from inference_svc.engine.types import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class SampleRequest:
    params: SamplingParams
    token_ids: Sequence[int]
    """Prompt + output so far (for the penalties)."""
    generator: torch.Generator | None
    num_prompt_tokens: int = 0
    """token_ids[num_prompt_tokens:] is the output (presence and frequency penalties, min_tokens)."""
    eos_ids: frozenset[int] = frozenset()
    """The model's EOS ids, kept from being sampled before min_tokens (unless ignore_eos)."""

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Samples(NamedTuple):
    """One token per row, its log-probability when asked, and the rows that could not be sampled."""

    tokens: list[int]
    logprobs: list[float] | None
    failed: list[int]
    """Indices of rows whose raw logits were not finite (their entry in `tokens` is a placeholder)."""
    top: list[TokenLogprob] | None = None
    """Per row, the chosen token with its `top_logprobs` best alternatives, when any row asked for them."""

    def emitted(self, row: int) -> Emitted:
        """Row `row` as one item's output."""
        if row in self.failed:
            return Emitted([], failed=True)
        lp = None if self.logprobs is None else [self.logprobs[row]]
        return Emitted([self.tokens[row]], 0, lp, None if self.top is None else [self.top[row]])


@dataclass(frozen=True)
class Emitted:
    """What one sampling item of a step produces: one token, or for a verify item (speculative decoding) the
    drafts it kept followed by the one token the target added."""

    tokens: list[int]
    num_drafts: int = 0
    """Drafted tokens this item verified (0: a plain step)."""
    logprobs: list[float] | None = None
    """Per token, when the request asks for logprobs."""
    top: list[TokenLogprob] | None = None
    """Per token, with its `top_logprobs` best alternatives, when asked."""
    failed: bool = False
    """Its logits were not finite: nothing was sampled and the engine fails the request."""

    @property
    def num_accepted(self) -> int:
        """Drafts kept (the added token is not one)."""
        return max(len(self.tokens) - 1, 0) if self.num_drafts else 0


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()

    def sample(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> Samples:
        # logits: [S, V] fp32
        want_logprobs = any(r.params.wants_logprobs for r in requests)
        top_k = max((r.params.top_logprobs for r in requests), default=0)
        chosen_lp = None
        top = None
        finite = torch.isfinite(logits).all(dim=-1)  # [S]
        failed: list[int] = []
        if not bool(finite.all()):
            failed = (~finite).nonzero()[:, 0].tolist()
            logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))  # keep NaN out of the batch
        raw = logits
        logits = apply_penalties(raw, requests)
        greedy = [r.params.greedy for r in requests]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample_rows(logits, requests, greedy)
        if top_k:
            top = token_logprobs(raw, tokens, top_k)
            chosen_lp = [t.logprob for t in top]
        elif want_logprobs:
            chosen_lp = torch.log_softmax(raw, dim=-1).gather(1, tokens[:, None])[:, 0].tolist()
        return Samples(tokens.tolist(), chosen_lp, failed, top)

    def _sample_rows(self, logits: torch.Tensor, requests: Sequence[SampleRequest], greedy: list[bool]) -> torch.Tensor:
        probs = probabilities(logits, requests)  # [S, V]
        sampled = (probs / self.exponential_noise(probs.shape, requests).to(probs.device)).argmax(dim=-1)
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(dim=-1), sampled)
        return sampled

    def exponential_noise(self, shape: torch.Size, requests: Sequence[SampleRequest]) -> torch.Tensor:
        """[S, V] Exp(1) draws on the CPU: a seeded request's row from its own generator, the others from the
        engine's (CPU generators, so a seed gives the same draws on every device)."""
        noise = torch.empty(shape)
        shared = [i for i, r in enumerate(requests) if r.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), shape[1]).exponential_(generator=self._generator)
        for i, r in enumerate(requests):
            if r.generator is not None:  # seeded: this request's own stream, one row per draw
                noise[i].exponential_(generator=r.generator)
        return noise

    def uniform(self, n: int, request: SampleRequest) -> torch.Tensor:
        """[n] U[0, 1) draws from the request's generator (the engine's when it has no seed)."""
        return torch.rand(n, generator=request.generator or self._generator)


def probabilities(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """The distribution each row is sampled from: [S, V] penalized logits → temperature → top-k → top-p → min-p →
    probabilities [S, V] (a greedy row is computed at temperature 1; callers take its argmax instead)."""
    temps = torch.tensor([r.params.temperature if not r.params.greedy else 1.0 for r in requests])
    temps = temps.clamp_(min=torch.finfo(temps.dtype).tiny)  # 5e-324 would round to 0 in fp32: 0/0 = NaN
    # shift first: every entry is <= 0, so dividing by a tiny temperature gives -inf, never inf - inf = NaN
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temps.to(logits.device)[:, None]
    top_k = [r.params.top_k for r in requests]
    top_p = [r.params.top_p for r in requests]
    min_p = [r.params.min_p for r in requests]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = _top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)  # [S, V]
    if any(m > 0 for m in min_p):
        floor = torch.tensor(min_p, device=probs.device)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
    return probs


def apply_penalties(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """Biases, penalties and min_tokens on the rows that ask for them (a copy; the input is left as is)."""
    rows = [i for i, r in enumerate(requests) if r.params.penalized]
    if not rows:
        return logits
    logits = logits.clone()
    dev = logits.device
    for i in rows:  # a few gathers/scatters per transformed row
        p = requests[i].params
        row = logits[i]  # [V], a view
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64, device=dev)
            row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype, device=dev))
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(requests[i].token_ids)), dtype=torch.int64, device=dev)
            vals = row[ids]
            row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        out = requests[i].token_ids[requests[i].num_prompt_tokens :]
        if (p.presence_penalty or p.frequency_penalty) and out:
            counts = torch.bincount(torch.tensor(out, dtype=torch.int64, device=dev), minlength=row.shape[0])
            row -= p.frequency_penalty * counts[: row.shape[0]] + p.presence_penalty * (counts[: row.shape[0]] > 0)
    big = torch.finfo(logits.dtype).max
    logits.clamp_(-big, big)  # a tiny or huge penalty must not push a logit to ±inf
    for i in rows:
        r = requests[i]
        if r.num_output_tokens < r.params.min_tokens:
            banned = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_ids))
            ids = torch.tensor(sorted(t for t in banned if t < logits.shape[1]), dtype=torch.int64, device=dev)
            logits[i, ids] = float("-inf")
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. logits: [S, V]."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    p = torch.tensor(top_p, device=logits.device)[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability mass of strictly better tokens
    drop |= mass_before >= p  # keep the smallest set whose mass reaches p (always at least the top token)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
