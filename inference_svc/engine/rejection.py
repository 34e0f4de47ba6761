"""Verification of drafted tokens: which drafts the target model keeps, and the token it adds.

Contract:
- `verify(sampler, logits, requests, drafts, draft_probs)`: `logits` `[K+1, V]` fp32 are the target's rows for one
  sequence, row i at the position after draft i-1 (row 0: after the sequence's last token); `requests[i]` carries
  the history row i's penalties see (the sequence's tokens + `drafts[:i]`), so `logit_bias`, repetition, presence
  and frequency penalties and `min_tokens` apply position by position exactly as in plain decoding.
- Greedy: drafts are kept while each equals its row's argmax; the first row that disagrees (or row K when all
  agree) adds its own argmax. The tokens are, one for one, what plain greedy decoding produces from these logits.
- Sampled: draft i is kept with probability min(1, p_i(d_i) / q_i(d_i)), where p_i is the row's sampling
  distribution (`sampler.probabilities`: temperature, top-k, top-p, min-p) and q_i the draft's (a point mass for a
  deterministic proposer such as n-gram lookup), using a uniform from the request's generator; at the first
  rejection the added token is drawn from the residual max(0, p_i - q_i), normalized; when all K are kept it is
  drawn from p_K. The emitted tokens are then distributed exactly as plain sampling from p, token by token
  (the speculative sampling theorem of Leviathan et al. 2023 and Chen et al. 2023).
- Structured outputs: `bitmask` [K+1, W] (`engine.grammar`) masks row i with the grammar's state after drafts[:i]
  (after the penalties, as in plain sampling), so a draft the grammar refuses has probability 0 under its row and is
  rejected, and the added token is one the grammar allows: the output is what plain constrained decoding gives.
- Logprobs are plain decoding's: log_softmax of each emitted token's raw row (before any transform).
- A verify whose rows are not all finite is `failed` (the engine fails that request alone, as in plain decoding).
- Stop conditions (EOS, stop ids and strings, max_new_tokens) are the scheduler's: it appends the tokens one by
  one and discards those after a stop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference_svc.engine.logprobs import token_logprobs
from inference_svc.engine.sampler import Emitted, Sampler, SampleRequest, apply_penalties, constrain


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    requests: Sequence[SampleRequest],
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
) -> Emitted:
    """Keep a prefix of `drafts` and add one token (see the module docstring). logits: [K+1, V];
    draft_probs: [K, V] (None: each draft is a point mass); bitmask: [K+1, W] int32 (None: unconstrained)."""
    k = len(drafts)
    if logits.shape[0] != k + 1 or len(requests) != k + 1:
        raise ValueError(f"verify needs K + 1 = {k + 1} rows and requests, got {logits.shape[0]}, {len(requests)}")
    if not bool(torch.isfinite(logits).all()):
        return Emitted([], k, failed=True)
    params = requests[0].params
    penalized = constrain(apply_penalties(logits, requests), logits, bitmask, requests)  # [K+1, V]
    if params.greedy:
        tokens = _greedy(penalized, drafts)
    else:
        tokens = _sampled(sampler, penalized, requests, drafts, draft_probs)
    return _with_logprobs(logits, tokens, k, params.wants_logprobs, params.top_logprobs)


def _greedy(penalized: torch.Tensor, drafts: Sequence[int]) -> list[int]:
    targets = penalized.argmax(dim=-1).tolist()  # [K+1]
    kept = 0
    while kept < len(drafts) and drafts[kept] == targets[kept]:
        kept += 1
    return [*drafts[:kept], targets[kept]]


def _sampled(
    sampler: Sampler,
    penalized: torch.Tensor,
    requests: Sequence[SampleRequest],
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
) -> list[int]:
    probs = sampler.probabilities(penalized, requests)  # [K+1, V]
    k = len(drafts)
    uniforms = sampler.uniform(k, requests[0]).tolist() if k else []
    for i, d in enumerate(drafts):
        p_d = float(probs[i, d])
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if q_d > 0 and uniforms[i] * q_d < p_d:  # kept with probability min(1, p/q)
            continue
        q = torch.zeros_like(probs[i]) if draft_probs is None else draft_probs[i].to(probs.device)
        if draft_probs is None:
            q[d] = 1.0
        residual = (probs[i] - q).clamp_(min=0)  # [V]
        if float(residual.sum()) <= 0:  # p == q exactly: the draft could not have been rejected; keep p
            residual = probs[i]
        return [*drafts[:i], _draw(sampler, residual, requests[i])]
    return [*drafts, _draw(sampler, probs[k], requests[k])]


def _draw(sampler: Sampler, weights: torch.Tensor, request: SampleRequest) -> int:
    """One token from unnormalized weights [V], drawn as plain sampling draws."""
    return int(sampler.draw(weights[None], [request])[0])


def _with_logprobs(raw: torch.Tensor, tokens: list[int], k: int, wants: bool, top_k: int) -> Emitted:
    if not wants:
        return Emitted(tokens, k)
    rows = raw[: len(tokens)]  # [n, V]: row j scored token j
    chosen = torch.tensor(tokens, dtype=torch.int64, device=raw.device)
    if top_k:
        top = token_logprobs(rows, chosen, top_k)
        return Emitted(tokens, k, [t.logprob for t in top], top)
    return Emitted(tokens, k, torch.log_softmax(rows, dim=-1).gather(1, chosen[:, None])[:, 0].tolist())
