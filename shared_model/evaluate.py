"""Held-out perplexity and bits per byte: one definition for training's validation, `tandem eval` offline, and
`tandem eval` through a running service.

Contract:
- `token_nll(logits [B, T, V], targets [B, T])` is the sum of -log p(target) in fp32 over all positions, and the
  number of positions: the one scoring function. The training loop's validation loss is
  `token_nll(...) / count`, and offline evaluation sums it over windows.
- `windows(ids, window, stride)` cuts a token stream into the windows every path scores, in order:
  - stride None (or = window): non-overlapping windows of `window` tokens; in each, every token after the first
    is scored (the first has no context inside its window);
  - stride < window: windows start every `stride` tokens, each sees up to `window` tokens of context and scores
    only the tokens no earlier window scored (the first window scores all but its first token), Hugging Face's
    sliding-window convention.
  A window is `Window(ids, first_scored)`: `ids[first_scored:]` are scored, each given everything before it in
  `ids`.
- `EvalResult` holds the summed NLL (nats), the scored tokens, and the UTF-8 bytes those tokens decode to
  (window by window), so perplexity = exp(nll / tokens) and bits per byte = nll / ln 2 / bytes. Two evaluations
  of the same windows agree on tokens and bytes exactly; only the NLL comes from the model or the service.
- `evaluate_offline(model, tokenizer, texts, window, stride)` runs `shared_model`'s decoder in fp32 (or the
  model's dtype, scored in fp32) under `torch.inference_mode`, one window at a time.
- `heldout_texts()` is the default data: the validation split of the default corpus (documents chosen by the
  hash of their name, so no training run on that corpus, with any `max_documents`, ever trains on them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from shared_model.errors import SharedModelError


@dataclass(frozen=True)
class Window:
    ids: list[int]
    first_scored: int
    """ids[first_scored:] are scored (>= 1: a scored token always has context)."""

    @property
    def scored(self) -> list[int]:
        return self.ids[self.first_scored :]


@dataclass(frozen=True)
class EvalResult:
    nll: float
    """Summed negative log-likelihood of the scored tokens, in nats."""
    tokens: int
    bytes: int
    windows: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    @property
    def bits_per_byte(self) -> float:
        return self.nll / math.log(2) / self.bytes if self.bytes else float("nan")

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens if self.tokens else float("nan")

    def as_dict(self) -> dict[str, float | int]:
        return {
            "perplexity": self.perplexity,
            "bits_per_byte": self.bits_per_byte,
            "nll": self.nll,
            "mean_nll": self.mean_nll,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "windows": self.windows,
        }


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of -log p(target), count) over every position; logits [..., V], targets [...] (fp32 math)."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    nll = torch.nn.functional.cross_entropy(flat, targets.reshape(-1), reduction="sum")
    return nll, targets.numel()


def windows(ids: Sequence[int], window: int, stride: int | None = None) -> list[Window]:
    if window < 2:
        raise SharedModelError(f"eval window must be at least 2 tokens, got {window}")
    step = window if stride is None else stride
    if not 1 <= step <= window:
        raise SharedModelError(f"eval stride must be in [1, window={window}], got {stride}")
    n = len(ids)
    out: list[Window] = []
    if step == window:  # non-overlapping: each window's first token is context only
        for lo in range(0, n, window):
            chunk = list(ids[lo : lo + window])
            if len(chunk) >= 2:
                out.append(Window(chunk, 1))
        return out
    prev_end = 0
    for begin in range(0, n, step):  # sliding: window-long context, only the tokens not scored before
        end = min(begin + window, n)
        first = max(1, prev_end - begin)  # the tokens before prev_end were scored by earlier windows
        if end - begin >= 2 and first < end - begin:
            out.append(Window(list(ids[begin:end]), first))
        prev_end = end
        if end == n:
            break
    return out


def score_bytes(tokenizer: object, ws: Iterable[Window]) -> int:
    """UTF-8 bytes the scored tokens of each window decode to, summed."""
    decode: Callable[[list[int]], str] = tokenizer.decode  # type: ignore[attr-defined]
    return sum(len(decode(w.scored).encode("utf-8")) for w in ws)


@torch.inference_mode()
def window_nll(model: torch.nn.Module, w: Window, device: torch.device | str = "cpu") -> float:
    """Summed NLL (nats) of one window's scored tokens under `model` (shared_model's CausalLM)."""
    ids = torch.tensor([w.ids], dtype=torch.int64, device=device)  # [1, W]
    logits = model(ids[:, :-1])  # [1, W-1, V]: position p predicts token p + 1
    lo = w.first_scored - 1
    nll, _ = token_nll(logits[:, lo:], ids[:, lo + 1 :])
    return float(nll)


def evaluate_offline(
    model: torch.nn.Module,
    tokenizer: object,
    texts: Sequence[str],
    window: int,
    stride: int | None = None,
    max_tokens: int | None = None,
) -> EvalResult:
    ws = text_windows(tokenizer, texts, window, stride, max_tokens)
    device = next(model.parameters()).device
    nll = sum(window_nll(model, w, device) for w in ws)
    return EvalResult(nll, sum(len(w.scored) for w in ws), score_bytes(tokenizer, ws), len(ws))


def text_windows(
    tokenizer: object, texts: Sequence[str], window: int, stride: int | None = None, max_tokens: int | None = None
) -> list[Window]:
    """The texts joined by a blank line, tokenized once (no BOS, as prompts are), cut at `max_tokens`, windowed."""
    encode: Callable[[str], list[int]] = tokenizer.encode  # type: ignore[attr-defined]
    ids = encode("\n\n".join(texts))
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise SharedModelError("the evaluation text has fewer than 2 tokens")
    return windows(ids, window, stride)


def heldout_texts() -> list[str]:
    from shared_model.corpus import load_corpus

    return load_corpus().texts("val")
