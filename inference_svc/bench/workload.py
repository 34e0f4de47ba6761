"""What the benchmark sends: request shapes drawn from length distributions, prompts cut from the default corpus
or read from a JSONL dataset.

Contract:
- `LengthSpec(mean, dist, range_ratio)` draws positive integer lengths: `fixed` (always `mean`), `uniform` (integers in
  [mean·(1−r), mean·(1+r)]) or `lognormal` (median `mean`, σ = r). Draws are clipped to [1, cap].
- `token_pool(tokenize, ...)` builds a pool of token ids from the default corpus (`shared_model.corpus`), tokenized by
  the caller's `tokenize(text) -> list[int]` — the benchmark passes the server's Tokenize RPC (gRPC), or its
  `/tokenize` route or a local `--tokenizer` (OpenAI-compatible servers), so prompt lengths are exact in the served
  model's vocabulary.
- `make_requests(pool, n, input_len, output_len, max_context, seed)` returns `n` `RequestSpec`s: each prompt is a window
  of the pool at a random offset, and prompt + output never exceeds `max_context`. Same arguments, same requests.
- Output lengths are enforced with `ignore_eos`, so every request produces exactly `max_new_tokens` tokens (as
  vLLM's random dataset does): the load is what was asked for, not what the model happens to stop at. (A server
  without `ignore_eos` may stop early; the benchmark reports the output tokens it actually received.)
- `read_dataset(path)` reads a JSONL file of prompts, one object per line: `prompt` (text; `text` is accepted as
  its other spelling) and an optional `max_tokens` (a positive integer). Blank lines are skipped. A bad line raises
  `DatasetError` whose message names the file and the line (`FILE:LINE: why`); a file with no prompt is an error.
- `dataset_requests(entries, n, output_len, max_context, seed)` returns `n` `RequestSpec`s from the file in order
  (from its start again when it holds fewer than `n`), with text prompts (`prompt_text`; sent as text, tokenized by
  the server) and each line's `max_tokens`, or a draw of `output_len` where the line has none; `max_context`, when
  known, caps `max_new_tokens` (the prompt's length in tokens is known only to the server).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


class WorkloadError(ValueError):
    """The requested workload cannot be built (bad length spec, empty corpus, context too small)."""


class DatasetError(WorkloadError):
    """A `--dataset` file cannot be read or has a bad line; the message names the file (and the line)."""


@dataclass(frozen=True)
class LengthSpec:
    """A distribution of token lengths."""

    mean: int
    """Mean (fixed, uniform) or median (lognormal) length in tokens."""
    dist: str = "uniform"
    """fixed | uniform | lognormal."""
    range_ratio: float = 0.5
    """uniform: half-width as a fraction of the mean; lognormal: σ of log-length."""

    def __post_init__(self) -> None:
        if not isinstance(self.mean, int) or self.mean < 1:
            raise WorkloadError(f"length mean must be an integer >= 1, got {self.mean!r}")
        if self.dist not in DISTRIBUTIONS:
            raise WorkloadError(f"length distribution must be one of {DISTRIBUTIONS}, got {self.dist!r}")
        if not 0 <= self.range_ratio <= (1 if self.dist == "uniform" else 3):
            raise WorkloadError(f"range ratio must be in [0, 1] (lognormal: [0, 3]), got {self.range_ratio}")

    def draw(self, rng: random.Random, cap: int) -> int:
        """One length in [1, cap]."""
        if self.dist == "fixed":
            n = self.mean
        elif self.dist == "uniform":
            lo = max(1, math.floor(self.mean * (1 - self.range_ratio)))
            hi = max(lo, math.ceil(self.mean * (1 + self.range_ratio)))
            n = rng.randint(lo, hi)
        else:
            n = round(self.mean * math.exp(rng.gauss(0.0, self.range_ratio)))
        return max(1, min(cap, n))


@dataclass(frozen=True)
class RequestSpec:
    """One benchmark request."""

    index: int
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    prompt_text: str | None = None
    """A text prompt (from a dataset), sent as text; `prompt_token_ids` is then empty."""

    @property
    def prompt(self) -> str | list[int]:
        """What is sent: the text, or the token ids."""
        return self.prompt_text if self.prompt_text is not None else list(self.prompt_token_ids)


def corpus_text(max_documents: int = 64, max_chars: int = 400_000) -> str:
    """Text of the first `max_documents` documents of the default corpus (the stdlib sources), at most `max_chars`."""
    from shared_model.corpus import CorpusConfig, load_corpus

    corpus = load_corpus(CorpusConfig(max_documents=max_documents, val_fraction=0.0))
    text = "\n".join(corpus.texts("train"))
    if not text.strip():
        raise WorkloadError("the default corpus is empty")
    return text[:max_chars]


def token_pool(
    tokenize: Callable[[str], Sequence[int]], text: str | None = None, chunk_chars: int = 16_000
) -> list[int]:
    """Token ids of `text` (default: `corpus_text()`), tokenized chunk by chunk (chunks split at line ends)."""
    text = corpus_text() if text is None else text
    pool: list[int] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + chunk_chars)
        cut = text.rfind("\n", start, end) if end < len(text) else end
        end = cut + 1 if cut > start else end
        pool.extend(tokenize(text[start:end]))
        start = end
    if not pool:
        raise WorkloadError("tokenizing the corpus gave no tokens")
    return pool


def make_requests(
    pool: Sequence[int],
    n: int,
    input_len: LengthSpec,
    output_len: LengthSpec,
    max_context: int,
    seed: int = 0,
) -> list[RequestSpec]:
    """`n` requests whose prompts are windows of `pool` and whose prompt + output fit in `max_context` tokens."""
    if max_context < 2:
        raise WorkloadError(f"the server's context ({max_context} tokens) is too small to benchmark")
    rng = random.Random(seed)
    out: list[RequestSpec] = []
    for i in range(n):
        new = output_len.draw(rng, cap=max_context - 1)
        plen = input_len.draw(rng, cap=min(len(pool), max_context - new))
        offset = rng.randrange(0, len(pool) - plen + 1)
        out.append(RequestSpec(i, tuple(pool[offset : offset + plen]), new))
    return out


@dataclass(frozen=True)
class DatasetEntry:
    """One line of a `--dataset` file."""

    prompt: str
    max_tokens: int | None
    line: int


def read_dataset(path: str | Path) -> list[DatasetEntry]:
    """The prompts of a JSONL file (`{"prompt": "...", "max_tokens": 64}` per line; `text` for `prompt` too)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read the dataset ({exc})") from None
    out: list[DatasetEntry] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not a JSON object ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: expected a JSON object with a 'prompt', got {type(obj).__name__}")
        key = "prompt" if "prompt" in obj else "text"
        prompt = obj.get(key)
        if prompt is None:
            raise DatasetError(f"{where}: no 'prompt' (or 'text') field")
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{where}: '{key}' must be a non-empty string")
        max_tokens = obj.get("max_tokens")
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            raise DatasetError(f"{where}: 'max_tokens' must be an integer >= 1, got {max_tokens!r}")
        out.append(DatasetEntry(prompt, max_tokens, number))
    if not out:
        raise DatasetError(f"{path}: the dataset holds no prompt")
    return out


def dataset_requests(
    entries: Sequence[DatasetEntry],
    n: int,
    output_len: LengthSpec,
    max_context: int | None = None,
    seed: int = 0,
) -> list[RequestSpec]:
    """`n` requests with the file's text prompts in order (cycling), and its `max_tokens` or a draw of `output_len`."""
    if not entries:
        raise WorkloadError("the dataset holds no prompt")
    if max_context is not None and max_context < 2:
        raise WorkloadError(f"the server's context ({max_context} tokens) is too small to benchmark")
    cap = (max_context - 1) if max_context is not None else 2**31 - 1
    rng = random.Random(seed)
    out: list[RequestSpec] = []
    for i in range(n):
        e = entries[i % len(entries)]
        new = output_len.draw(rng, cap) if e.max_tokens is None else min(e.max_tokens, cap)
        out.append(RequestSpec(i, (), new, prompt_text=e.prompt))
    return out
