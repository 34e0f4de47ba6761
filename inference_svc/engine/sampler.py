"""Token sampling from a batch of logits, each row with its own SamplingParams.

Contract:
- `sample(logits [S, V] fp32, requests)` returns one token id per row (and, when asked, its log-probability under
  the model's distribution: log_softmax of the raw logits, before penalties, temperature or truncation, with the
  `top_logprobs` most likely alternatives of that same distribution).
- Order of transforms: `logit_bias` (added) → repetition penalty (CTRL: positive logits divided, negative
  multiplied, over tokens in the prompt or output) → presence and frequency penalties (OpenAI's: over generated
  tokens only, `presence·[count > 0] + frequency·count` subtracted) → clamp to the finite range → `min_tokens`
  (EOS, unless ignored, and the stop token ids set to -inf while fewer than min_tokens tokens were generated)
  → the grammar's token bitmask (`bitmask` [S, W], structured outputs: `engine.grammar`; one op over the batch,
  every disallowed token at -inf; where min_tokens leaves a row nothing the grammar allows, the grammar wins)
  → greedy argmax when temperature is 0 → temperature → top-k → top-p → min-p → draw.
- Truncation keeps, per row, the tokens whose probability is at least a threshold (`truncation_thresholds`):
  top-k's k-th largest probability, top-p's value where the running mass (descending, over what top-k keeps)
  first reaches top_p of it, min-p's min_p times the largest; the largest of these. Ties at the boundary are all
  kept, so the kept set never depends on an order among equal values. The kept probabilities are renormalized.
  On the CPU the thresholds come from a C++ selection (`inference_svc.engine.cpu_sampling`, O(V) a row), elsewhere
  from a sort (`_thresholds_torch`), the same rule.
- On the CPU (fp32 logits, where the kernels are built), a batch that has no penalties, biases, min_tokens or
  grammar is sampled by one C++ call: `cpu_sampling.greedy_rows` when every row is greedy (each row's first
  argmax and its finiteness in one pass), else `cpu_sampling.sample_rows` (the same ATen operations for the
  probabilities, the same threshold and the same draw): the same tokens as the torch path (tested), without a
  Python call per operation (its cost: docs/benchmarks-archive.md §7, "Sampling without a sort"). Every other
  batch takes the torch path.
- No valid parameter overflows: penalized logits are clamped to the finite float range, and temperature divides
  `logits - rowmax` (all <= 0) and is floored at fp32's smallest normal number, so a temperature of 1e-38 (or
  5e-324) gives probability 0 to every token but the best, never NaN.
- A row of raw logits that is not finite (NaN or ±inf from the model) is never sampled from: it is reported in
  `Samples.failed` and its token is meaningless; the engine fails that request alone.
- A draw (`Sampler.draw`) inverts the row's cumulative distribution at one U[0, 1) number (a token of
  probability 0 is never drawn). The number comes from the request's own generator when it has a seed, so a
  seeded request draws the same numbers whatever the batch; unseeded rows share one engine generator. Plain
  sampling, speculative verification and the draft model all draw this way. Everything else is vectorized over
  rows.
- Reads its inputs only; knows nothing about scheduling or text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from inference_svc.engine import cpu_sampling
from inference_svc.engine.grammar import apply_bitmask
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
    def __init__(self, seed: int | None = None, native: bool = True) -> None:
        """`native=False`: torch's sort and per-op sampling even where the C++ kernels run (the load plan's
        `cpu_kernels`); the same tokens either way."""
        self.native = native
        self._generator = torch.Generator()
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()

    def sample(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest], bitmask: torch.Tensor | None = None
    ) -> Samples:
        """bitmask: [S, W] int32, the grammar's allowed tokens per row (all bits set: unconstrained), or None."""
        # logits: [S, V] fp32
        want_logprobs = any(r.params.wants_logprobs for r in requests)
        top_k = max((r.params.top_logprobs for r in requests), default=0)
        chosen_lp = None
        top = None
        greedy = [r.params.greedy for r in requests]
        native = _native(logits, self.native)
        plain = bitmask is None and not any(r.params.penalized for r in requests)
        if native is not None and plain:
            if all(greedy):
                token_list, failed = native.greedy_rows(logits)
            else:
                token_list, failed = native.sample_rows(
                    logits,
                    [1.0 if r.params.greedy else r.params.temperature for r in requests],
                    greedy,
                    [r.params.top_k for r in requests],
                    [r.params.top_p for r in requests],
                    [r.params.min_p for r in requests],
                    self._uniforms(requests),
                )
            if not (top_k or want_logprobs):
                return Samples(token_list, None, failed)
            tokens = torch.tensor(token_list)
            # the placeholders' rows must not reach the logprobs below as NaN
            raw = logits.index_fill(0, torch.tensor(failed, dtype=torch.int64), 0.0) if failed else logits
        else:
            tokens, failed, raw = self._sample_torch(logits, requests, greedy, bitmask)
        if top_k:
            top = token_logprobs(raw, tokens, top_k)
            chosen_lp = [t.logprob for t in top]
        elif want_logprobs:
            chosen_lp = torch.log_softmax(raw, dim=-1).gather(1, tokens[:, None])[:, 0].tolist()
        return Samples(tokens.tolist(), chosen_lp, failed, top)

    def _sample_torch(
        self,
        logits: torch.Tensor,
        requests: Sequence[SampleRequest],
        greedy: list[bool],
        bitmask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """`sample`'s tokens, failed rows and raw logits (non-finite rows zeroed) by torch operations."""
        # a row is finite iff its largest and smallest entries are (NaN propagates through both): two reductions
        finite = torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))  # [S]
        failed: list[int] = []
        if not bool(finite.all()):
            failed = (~finite).nonzero()[:, 0].tolist()
            logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))  # keep NaN out of the batch
        raw = logits
        logits = constrain(apply_penalties(raw, requests), raw, bitmask, requests)
        if all(greedy):
            return logits.argmax(dim=-1), failed, raw
        sampled = self.draw(self.probabilities(logits, requests), requests)  # [S]
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(dim=-1), sampled)
        return sampled, failed, raw

    def _uniforms(self, requests: Sequence[SampleRequest]) -> list[float]:
        """One U[0, 1) number per row (fp64): the seeded requests' from their own generators, the others' from the
        engine's."""
        u = [0.0] * len(requests)
        shared = [i for i, r in enumerate(requests) if r.generator is None]
        if shared:
            drawn = torch.rand(len(shared), generator=self._generator, dtype=torch.float64).tolist()
            for i, v in zip(shared, drawn, strict=True):
                u[i] = v
        for i, r in enumerate(requests):
            if r.generator is not None:  # seeded: this request's own stream, one number per draw
                u[i] = torch.rand(1, generator=r.generator, dtype=torch.float64).item()
        return u

    def draw(self, weights: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
        """One token per row of non-negative weights [S, V] (each row with some positive weight), drawn in
        proportion to them: the first token whose cumulative weight reaches (1 - u)·total, u ~ U[0, 1) from the
        row's request (see the module docstring). int64 [S]."""
        u = torch.tensor(self._uniforms(requests), dtype=torch.float64)
        cdf = weights.double().cumsum(dim=-1)  # [S, V]: fp64, so no positive weight is lost to rounding
        point = (1.0 - u.to(cdf.device))[:, None] * cdf[:, -1:]  # in (0, total]: never a token of weight 0
        return torch.searchsorted(cdf, point)[:, 0].clamp_(max=weights.shape[1] - 1)

    def probabilities(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
        """`probabilities` with this sampler's kernels."""
        return probabilities(logits, requests, self.native)

    def uniform(self, n: int, request: SampleRequest) -> torch.Tensor:
        """[n] U[0, 1) draws from the request's generator (the engine's when it has no seed)."""
        return torch.rand(n, generator=request.generator or self._generator)


def _native(logits: torch.Tensor, allowed: bool) -> Any | None:
    """The C++ sampling kernels for these logits (CPU fp32, where they are built and `allowed`), else None."""
    if not allowed or logits.device.type != "cpu" or logits.dtype != torch.float32:
        return None
    return cpu_sampling.extension()


def _temperatures(requests: Sequence[SampleRequest]) -> torch.Tensor:
    """fp32 [S] on the CPU: each row's temperature (1 for a greedy row), floored at fp32's smallest normal."""
    temps = torch.tensor([r.params.temperature if not r.params.greedy else 1.0 for r in requests])
    return temps.clamp_(min=torch.finfo(temps.dtype).tiny)  # 5e-324 would round to 0 in fp32: 0/0 = NaN


def probabilities(logits: torch.Tensor, requests: Sequence[SampleRequest], native: bool = True) -> torch.Tensor:
    """The distribution each row is sampled from: [S, V] penalized logits → temperature → top-k → top-p → min-p →
    probabilities [S, V], renormalized (a greedy row is computed at temperature 1; callers take its argmax
    instead)."""
    temps = _temperatures(requests)
    # shift first: every entry is <= 0, so dividing by a tiny temperature gives -inf, never inf - inf = NaN
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temps.to(logits.device)[:, None]
    probs = torch.softmax(scaled, dim=-1)  # [S, V]
    vocab = probs.shape[1]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in requests]
    top_p = [r.params.top_p for r in requests]
    min_p = [r.params.min_p for r in requests]
    if any(top_k) or any(p < 1.0 for p in top_p) or any(m > 0 for m in min_p):
        tau = truncation_thresholds(probs, top_k, top_p, min_p, native)  # [S]
        probs = probs.masked_fill_(probs < tau[:, None], 0.0)
        probs = probs.div_(probs.sum(dim=-1, keepdim=True))
    return probs


def truncation_thresholds(
    probs: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float], native: bool = True
) -> torch.Tensor:
    """Each row's smallest kept probability under top-k (0: none), top-p (1: none) and min-p (0: none); probs
    [S, V] fp32 → [S] (see the module docstring): the C++ selection on the CPU where it is built, else a sort."""
    kernels = _native(probs, native)
    if kernels is None:
        return _thresholds_torch(probs, top_k, top_p, min_p)
    k = torch.tensor(top_k, dtype=torch.int64)
    p, m = torch.tensor(top_p, dtype=torch.float64), torch.tensor(min_p, dtype=torch.float64)
    return kernels.truncation_thresholds(probs.contiguous(), k, p, m)


def _thresholds_torch(probs: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """`truncation_thresholds` with a sort (any device)."""
    dev, vocab = probs.device, probs.shape[1]
    ordered = probs.sort(dim=-1, descending=True).values  # [S, V]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=dev)[:, None]  # [S, 1]
    tau = torch.where(k < vocab, ordered.gather(1, k - 1), torch.zeros_like(ordered[:, :1]))  # [S, 1]
    kept = torch.where(ordered >= tau, ordered, torch.zeros_like(ordered)).double()  # what top-k keeps
    running = kept.cumsum(dim=-1)  # [S, V]
    target = torch.tensor(top_p, dtype=torch.float64, device=dev)[:, None] * running[:, -1:]
    first = (running < target).sum(dim=-1, keepdim=True).clamp_(max=vocab - 1)  # where the running mass reaches it
    tau_p = torch.where(target < running[:, -1:], ordered.gather(1, first), torch.zeros_like(tau))
    tau_m = torch.tensor(min_p, dtype=probs.dtype, device=dev)[:, None] * ordered[:, :1]
    return torch.maximum(torch.maximum(tau, tau_p), tau_m)[:, 0]


def constrain(
    penalized: torch.Tensor, raw: torch.Tensor, bitmask: torch.Tensor | None, requests: Sequence[SampleRequest]
) -> torch.Tensor:
    """The grammar's mask over penalized logits [S, V] (bitmask [S, W]; None: as they are). A row that min_tokens
    left with no token the grammar allows takes the mask over its raw logits instead: the grammar wins."""
    if bitmask is None:
        return penalized
    masked = apply_bitmask(penalized, bitmask)  # [S, V]
    if not any(r.num_output_tokens < r.params.min_tokens for r in requests):
        return masked  # nothing was banned but by the grammar: every row keeps a token
    dead = ~torch.isfinite(masked.amax(dim=-1))  # [S]
    if bool(dead.any()):
        masked = torch.where(dead[:, None], apply_bitmask(raw, bitmask), masked)
    return masked


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
