"""Drafting with a small model that shares the target's tokenizer (`--speculative DRAFT_DIR`).

Contract:
- The draft model has its own `ModelRunner` and paged K/V cache with the target's number of blocks and block size,
  addressed by the target's block tables: a token's draft K/V lives at the same slot as its target K/V. The
  engine sizes the pool for both (bytes per token = target's + draft's), so the draft's K/V comes out of the same
  `--kv-cache-memory` budget, and `EngineInfo` reports both.
- `propose(seq, k)` first brings the draft cache up to date with the sequence (positions it has not computed, in
  pieces of `chunk` tokens, the sequence's last token included), then drafts k tokens autoregressively, one
  draft-model step each (the last one is not fed back: the verify step does not need its K/V). Greedy requests
  get the draft's argmax; sampled requests a token sampled from the draft's distribution under the request's own
  parameters (penalties, temperature, top-k/p, min-p; drawn from a generator seeded from the request's seed, or the
  engine's for an unseeded request, never the request's own stream, which the verifier uses), and those
  distributions travel with the draft, for `rejection.verify`.
- What the draft cache holds is derived from the sequence, never trusted: after a verify, the positions whose
  draft K/V are valid are those of the kept drafts; a preempted sequence (its blocks were freed) starts again
  from 0. Blocks shared through the prefix cache are rewritten with the same tokens' draft K/V (the engine is
  single-threaded, so nobody reads them mid-write), which is why the prefix cache needs no draft-side state.
- The draft's K/V never influences which tokens are emitted: only the target's logits decide (verify), so a
  stale or imprecise draft entry costs acceptance, never correctness.
- Owns only its per-request bookkeeping; never writes a `Sequence`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_svc.engine.model_runner import ModelRunner
from inference_svc.engine.sampler import Sampler, SampleRequest, apply_penalties
from inference_svc.engine.sequence import ScheduledSeq, Sequence
from inference_svc.engine.speculative import Draft

DRAFT_SEED_OFFSET = 0x5EED
"""A seeded request's drafts come from a generator seeded with its seed + this (its own stream is the verifier's)."""


@dataclass
class _DraftCache:
    preemptions: int
    base: int = 0
    """The sequence's length when it last drafted: draft K/V are valid for positions [0, base - 1] ..."""
    fed: tuple[int, ...] = ()
    """... and for the drafts fed back at positions base, base + 1, ... while they match the sequence."""

    def valid(self, seq: Sequence) -> int:
        """Positions [0, n) whose draft K/V hold seq's own tokens."""
        if seq.num_preemptions != self.preemptions:
            return 0
        kept = 0
        for i, token in enumerate(self.fed):
            if self.base + i >= seq.num_tokens or seq.token_ids[self.base + i] != token:
                break
            kept += 1
        return min(self.base + kept, seq.num_tokens - 1)


class DraftModelProposer:
    """A draft model's proposals (see the module docstring)."""

    writes_kv = True
    """It writes its K/V at the drafted positions: the scheduler reserves their slots before proposing."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, eos_ids: frozenset[int], chunk: int) -> None:
        self.runner = runner
        self.sampler = sampler
        self.eos_ids = eos_ids
        self.chunk = chunk
        self._caches: dict[str, _DraftCache] = {}
        self._generators: dict[str, torch.Generator] = {}

    def propose(self, seq: Sequence, k: int) -> Draft:
        k = min(k, self.runner.config.max_position_embeddings - seq.num_tokens)  # the draft's own context
        if k <= 0:
            return Draft()
        cache = self._caches.get(seq.request_id)
        done = 0 if cache is None else cache.valid(seq)
        n = seq.num_tokens
        logits = None
        for lo in range(done, n, self.chunk):  # catch up, the last token included: its row drafts the first token
            logits = self.runner.run([ScheduledSeq(seq, lo, min(self.chunk, n - lo))]).sample  # [0 or 1, V]
        assert logits is not None and logits.shape[0] == 1
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        while True:
            if not bool(torch.isfinite(logits).all()):  # a draft model gone wrong drafts no further
                break
            token, p = self._pick(seq, logits, tokens)
            tokens.append(token)
            if p is not None:
                probs.append(p)
            if len(tokens) == k:
                break
            step = ScheduledSeq(seq, n - 1 + len(tokens), 1, tuple(tokens))  # the newest draft at its position
            logits = self.runner.run([step]).sample  # [1, V]
        self._caches[seq.request_id] = _DraftCache(seq.num_preemptions, n, tuple(tokens[:-1]))
        if not tokens:
            return Draft()
        return Draft(tuple(tokens), torch.stack(probs) if probs else None)

    def _pick(self, seq: Sequence, logits: torch.Tensor, drafted: list[int]) -> tuple[int, torch.Tensor | None]:
        """The next draft token from the draft's logits [1, V], and its distribution [V] for a sampled request."""
        request = SampleRequest(
            seq.sampling, [*seq.token_ids, *drafted], self._generator(seq), seq.num_prompt_tokens, self.eos_ids
        )
        penalized = apply_penalties(logits, [request])
        if seq.sampling.greedy:
            return int(penalized[0].argmax()), None
        q = self.sampler.probabilities(penalized, [request])  # [1, V]
        return int(self.sampler.draw(q, [request])[0]), q[0]

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """A seeded request's own draft generator (None: the engine's shared one)."""
        if seq.sampling.seed is None or seq.sampling.greedy:
            return None
        gen = self._generators.get(seq.request_id)
        if gen is None:
            gen = self._generators[seq.request_id] = torch.Generator().manual_seed(
                (seq.sampling.seed + DRAFT_SEED_OFFSET) % 2**64
            )
        return gen

    def forget(self, request_id: str) -> None:
        self._caches.pop(request_id, None)
        self._generators.pop(request_id, None)
