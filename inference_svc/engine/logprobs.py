"""Log-probabilities of chosen tokens and their top alternatives, from fp32 logits.

Contract:
- `token_logprobs(logits [R, V], targets [R], k)` returns one `TokenLogprob` per row: log_softmax(logits)[target]
  and, when k > 0, the k most likely tokens (best first; equal values in ascending id order, which `torch.topk`
  alone does not promise).
- Rows are processed in pieces of at most `ROWS_PER_PIECE`, so the fp32 log-softmax of a long prompt never needs
  more than ROWS_PER_PIECE × V floats at once.
- Pure function of its inputs; no state.
"""

from __future__ import annotations

import torch

from inference_svc.engine.types import TokenLogprob

ROWS_PER_PIECE = 128


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprob]:
    """logits: [R, V] fp32; targets: [R] int64. One entry per row."""
    out: list[TokenLogprob] = []
    for lo in range(0, logits.shape[0], ROWS_PER_PIECE):
        lp = torch.log_softmax(logits[lo : lo + ROWS_PER_PIECE].float(), dim=-1)  # [r, V]
        chosen = lp.gather(1, targets[lo : lo + ROWS_PER_PIECE, None].to(lp.device))[:, 0].tolist()  # [r]
        ids = targets[lo : lo + ROWS_PER_PIECE].tolist()
        if k == 0:
            out += [TokenLogprob(t, c) for t, c in zip(ids, chosen, strict=True)]
            continue
        top = _top_k(lp, k)
        out += [TokenLogprob(t, c, tp) for t, c, tp in zip(ids, chosen, top, strict=True)]
    return out


def _top_k(lp: torch.Tensor, k: int) -> list[tuple[tuple[int, float], ...]]:
    """The k best (id, logprob) of each row of lp [r, V], best first, equal values by ascending id."""
    k = min(k, lp.shape[1])
    # a stable descending sort keeps ascending ids among equal values; topk first bounds the work to the k best
    cut = lp.topk(k, dim=-1).values[:, -1:]  # [r, 1]  # the k-th value: every token at or above it is a candidate
    rows = []
    for r in range(lp.shape[0]):
        cand = (lp[r] >= cut[r]).nonzero()[:, 0]  # ascending ids, >= k of them
        vals = lp[r, cand]
        order = torch.sort(vals, descending=True, stable=True).indices[:k]
        rows.append(tuple(zip(cand[order].tolist(), vals[order].tolist(), strict=True)))
    return rows
