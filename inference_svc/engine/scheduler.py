"""The scheduler: decides what each engine step computes, and is the only writer of Sequence state.

Contract:
- Queues: `waiting` (FCFS by arrival, preempted sequences keep their place) and `running` (admission order).
  A RUNNING sequence holds KV blocks for its whole prompt (or recompute) plus what it generated.
- `schedule()` builds one step under two limits, `max_num_seqs` running sequences and `max_num_batched_tokens`
  tokens, with this mixing policy:
    1. decodes first: every running sequence that has finished its prefill gets its one token (oldest first),
       so a long prompt never freezes the decodes already running. With speculative decoding (`Speculator`), a
       decode may carry drafts: a verify item of 1 + K tokens, K capped so the drafts never exceed the request's
       remaining tokens, the context or the step's budget, and backed by free blocks only (drafts never preempt);
    2. then the prefill chunks of running sequences still prefilling (at most `prefill_chunk_size` tokens each);
    3. then new admissions from the head of `waiting`, while blocks for the whole prompt are free (prefix-cache
       hits included), the sequence cap allows it, token budget remains and the step's prefill tokens (steps 2
       and 3) stay within `prefill_group_tokens` (a step's first prefill chunk always fits). Admission is FCFS: the
       head of the queue is never overtaken. Nothing is admitted in a step that had to preempt.
  With chunked prefill off, a prefill runs whole: when it fits the remaining budget, or alone in a step.
- Preemption (recompute): when a decode needs a new block and none is free, the newest running sequence is
  preempted: its blocks are freed (cached full blocks stay evictable and often serve its own recompute), it returns
  to `waiting` with `num_computed_tokens = 0`, and is prefilled again (prompt + tokens generated so far) later.
- `postprocess()` advances computed counts, registers newly full blocks with the prefix cache, appends sampled
  tokens (with their logprobs) and the prompt logprobs the step computed, detokenizes, checks stop conditions
  (EOS, stop ids and stop strings only once `min_tokens` tokens exist; which one matched is `stop_reason`), and
  frees the blocks of finished sequences at once. A verify item's tokens (kept drafts + one) are appended one by
  one with the same checks; those after a stop are dropped. Every sampling item leaves exactly its newest token
  uncomputed, so the K/V of rejected drafts lies beyond `num_computed_tokens` (never read, never registered) and
  the blocks reserved only for them go back to the pool in the same step. A sequence asking for prompt logprobs
  is admitted without a prefix-cache lookup (its cached positions would have no logits). A sequence whose row
  the sampler could not sample (non-finite logits) finishes with `FinishReason.ERROR`: its blocks are
  discarded, not cached, and listed for the engine to zero, because NaN left in a block would reach the next
  owner through attention's masked positions (NaN times a zero weight is NaN); the others in the step go on.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from inference_svc.engine.block_manager import BlockManager
from inference_svc.engine.config import EngineConfig
from inference_svc.engine.sampler import Emitted
from inference_svc.engine.sequence import ScheduledSeq, Sequence, SequenceStatus
from inference_svc.engine.speculative import Draft, Speculator
from inference_svc.engine.types import FinishReason, TokenLogprob


@dataclass
class StepEvent:
    """What one step did to one sequence (turned into a RequestOutput by the engine)."""

    seq: Sequence
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Set on the first event with a token of a sequence that asked for them."""
    text_delta: str = ""
    finished: bool = False
    error: str | None = None
    scrub_blocks: list[int] = field(default_factory=list)
    """Blocks the engine must zero before they are reused (a failed sequence's)."""


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    generation_tokens_total: int = 0
    cached_prompt_tokens_total: int = 0
    spec_verify_steps_total: int = 0
    """Sequence-steps that verified drafts."""
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_emitted_tokens_total: int = 0
    """Tokens the verify steps produced (kept drafts + the added token, before stops trimmed any)."""


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        speculator: Speculator | None = None,
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.speculator = speculator
        self.waiting: list[Sequence] = []  # sorted by seq_index
        self.running: list[Sequence] = []  # sorted by seq_index
        self.counters = SchedulerCounters()

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.seq_index)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence, now: float) -> StepEvent:
        """Finish `seq` as CANCELLED and free its blocks."""
        return self.abort_all([seq], now)[0]

    def abort_all(self, seqs: list[Sequence], now: float) -> list[StepEvent]:
        """Finish every one of `seqs` as CANCELLED and free their blocks: one pass over each queue, whatever their
        number (an abort costs O(1) of its own, not a search of the queues)."""
        gone = {id(s) for s in seqs}
        if any(id(s) in gone for s in self.running):
            self.running = [s for s in self.running if id(s) not in gone]
        if any(id(s) in gone for s in self.waiting):
            self.waiting = [s for s in self.waiting if id(s) not in gone]
        return [self._finish(seq, FinishReason.CANCELLED, now) for seq in seqs]

    # ------------------------------------------------------------------ scheduling
    def schedule(self, now: float) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preemptions_before = self.counters.num_preemptions
        # 1. decodes, oldest first (with drafts to verify when speculating)
        # every request the engine batches or will admit counts, decoding, prefilling or waiting (up to max_num_seqs):
        # while others are being admitted, drafted rows would take the step's budget from their prefill chunks
        held = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        speculate = self.speculator is not None and self.speculator.allows(held)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or not _is_decoding(seq):
                continue
            if not self._reserve_slot(seq):
                continue  # seq itself was the newest and got preempted
            draft = self._draft(seq, budget - 1) if speculate else Draft()
            batch.append(ScheduledSeq(seq, seq.num_computed_tokens, 1 + len(draft.tokens), *draft))
            budget -= 1 + len(draft.tokens)
        preempted = self.counters.num_preemptions != preemptions_before
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        # 2. prefill chunks of running sequences
        prefill = 0  # this step's prefill tokens
        for seq in self.running:
            if budget == 0:
                break
            if _is_decoding(seq):
                continue
            n = self._chunk(seq, budget, alone=not batch)
            if n:
                batch.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
                budget -= n
                prefill += n
        # 3. admissions
        group = self.config.prefill_group_tokens
        assert isinstance(group, int), "the engine resolves prefill_group_tokens before the scheduler runs"
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = self._chunk(seq, budget, alone=not batch, uncomputed=seq.num_tokens)
            if n == 0 or (prefill and prefill + self._fresh_tokens(seq, n) > group):
                break
            if not self.bm.can_allocate(seq.token_ids, seq.uses_prefix_cache, seq.cache_salt):
                break
            self.waiting.pop(0)
            self._admit(seq, now)
            n = self._chunk(seq, budget, alone=not batch)
            batch.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
            prefill += n
        return batch

    def _fresh_tokens(self, seq: Sequence, n: int) -> int:
        """Of the first `n` prompt tokens a waiting `seq` would compute, those its prefix-cache hit leaves to compute
        (a cached system prompt does not count against the prefill group)."""
        cached = self.bm.cached_prefix_tokens(seq.token_ids, seq.uses_prefix_cache, seq.cache_salt)
        return min(n, seq.num_tokens - cached)

    def _chunk(self, seq: Sequence, budget: int, alone: bool, uncomputed: int | None = None) -> int:
        """Tokens of seq's prefill to compute this step (0: wait)."""
        left = seq.num_uncomputed_tokens if uncomputed is None else uncomputed
        if self.config.enable_chunked_prefill:
            return min(left, self.config.prefill_chunk_size, budget)
        return left if left <= budget or alone else 0

    def _admit(self, seq: Sequence, now: float) -> None:
        alloc = self.bm.allocate(seq.token_ids, seq.uses_prefix_cache, seq.cache_salt)
        seq.block_table = alloc.blocks
        seq.block_hashes = list(alloc.hashes)
        seq.num_computed_tokens = alloc.num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
            seq.num_cached_prompt_tokens = min(alloc.num_cached_tokens, seq.num_prompt_tokens)
            self.counters.cached_prompt_tokens_total += seq.num_cached_prompt_tokens
        bisect.insort(self.running, seq, key=lambda s: s.seq_index)

    def _reserve_slot(self, seq: Sequence) -> bool:
        """Make sure seq has a block for its next token, preempting the newest sequences if needed.

        Returns False if seq itself had to be preempted.
        """
        while len(seq.block_table) < self.bm.blocks_for(seq.num_tokens):
            block = self.bm.append_block()
            if block is not None:
                seq.block_table.append(block)
                continue
            victim = max((s for s in self.running if s.status is SequenceStatus.RUNNING), key=lambda s: s.seq_index)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _draft(self, seq: Sequence, budget: int) -> Draft:
        """The drafts seq verifies this step, with cache slots for them: never more than the output, the context,
        the step's token budget or the free blocks allow (drafts never preempt anyone, and a proposer that writes
        no K/V gets slots only for what it drafted)."""
        assert self.speculator is not None
        cap = min(
            budget,
            seq.sampling.max_new_tokens - seq.num_output_tokens - 1,  # the added token comes on top of the drafts
            self.max_model_len - seq.num_tokens - 1,
        )
        k = self.speculator.num_drafts(seq, cap) if cap > 0 else 0
        if k == 0:
            return Draft()
        if self.speculator.writes_kv:  # a draft model writes K/V at the drafted positions while it drafts
            draft = self.speculator.propose(seq, self._reserve_draft_slots(seq, k))
        else:
            draft = self.speculator.propose(seq, k)
            n = self._reserve_draft_slots(seq, len(draft.tokens))
            draft = Draft(draft.tokens[:n], None if draft.probs is None else draft.probs[:n])
        keep = self.bm.blocks_for(seq.num_tokens + len(draft.tokens))
        if len(seq.block_table) > keep:
            self.bm.free(seq.block_table[keep:])
            del seq.block_table[keep:]
        return draft

    def _reserve_draft_slots(self, seq: Sequence, k: int) -> int:
        """Free blocks for k drafts past seq's tokens, as far as there are any: how many drafts got slots."""
        while len(seq.block_table) < self.bm.blocks_for(seq.num_tokens + k):
            block = self.bm.append_block()
            if block is None:
                return len(seq.block_table) * self.bm.block_size - seq.num_tokens
            seq.block_table.append(block)
        return k

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.add(seq)

    # ------------------------------------------------------------------ postprocessing
    def postprocess(
        self,
        batch: list[ScheduledSeq],
        emitted: list[Emitted],
        now: float,
        prompt_logprobs: dict[int, list[TokenLogprob]] | None = None,
    ) -> list[StepEvent]:
        """`emitted` holds one entry per sampling item of `batch`, in order (`failed`: its logits were not
        finite); `prompt_logprobs` maps a batch index to the prompt logprobs its chunk computed."""
        events: list[StepEvent] = []
        results = iter(emitted)
        for i, item in enumerate(batch):
            seq = item.seq
            if prompt_logprobs and i in prompt_logprobs:
                if seq.prompt_logprobs is None:
                    seq.prompt_logprobs = [None]
                seq.prompt_logprobs += prompt_logprobs[i]
            if not item.samples:
                seq.num_computed_tokens += item.num_tokens
                self._register_full_blocks(seq)
                continue
            out = next(results)
            if out.failed:
                seq.num_computed_tokens += item.num_tokens
                events.append(self._fail(seq, now))
                continue
            if item.draft:
                self._count_verify(seq, out, item)
            event = self._emit(seq, out, now)
            if seq.sampling.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
                seq.prompt_logprobs_sent = True
                event.prompt_logprobs = seq.prompt_logprobs or [None]
            events.append(event)
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        return events

    def _emit(self, seq: Sequence, out: Emitted, now: float) -> StepEvent:
        """Append out's tokens one by one up to a stop (the tokens after it are dropped, K/V and all), register
        the newly full blocks, then finish the sequence or give back the blocks of its rejected drafts."""
        event = StepEvent(seq)
        seq.num_token_steps += 1
        reason: FinishReason | None = None
        for j, token in enumerate(out.tokens):
            event.new_token_ids.append(token)
            delta, reason = self._append_token(seq, token, now)
            event.text_delta += delta
            if seq.sampling.wants_logprobs and out.logprobs is not None:
                event.logprobs = (event.logprobs or []) + [out.logprobs[j]]
                if seq.sampling.top_logprobs and out.top is not None:
                    event.top_logprobs = (event.top_logprobs or []) + [_trimmed(out.top[j], seq.sampling.top_logprobs)]
            if reason is not None:
                break
        # every sampling item leaves exactly its newest token uncomputed: the K/V of a verify item's rejected
        # drafts (and of kept ones after a stop) lie past this and are never read
        seq.num_computed_tokens = seq.num_tokens - 1
        self._register_full_blocks(seq)
        if reason is not None:
            event.text_delta += self._finish(seq, reason, now).text_delta
            event.finished = True
            return event
        keep = self.bm.blocks_for(seq.num_tokens)  # blocks reserved for rejected drafts go back, never cached
        if len(seq.block_table) > keep:
            self.bm.free(seq.block_table[keep:])
            del seq.block_table[keep:]
        return event

    def _count_verify(self, seq: Sequence, out: Emitted, item: ScheduledSeq) -> None:
        c = self.counters
        c.spec_verify_steps_total += 1
        c.spec_draft_tokens_total += len(item.draft)
        c.spec_accepted_tokens_total += out.num_accepted
        c.spec_emitted_tokens_total += len(out.tokens)
        seq.num_draft_tokens += len(item.draft)
        seq.num_accepted_tokens += out.num_accepted
        if self.speculator is not None:
            self.speculator.observe(seq, len(item.draft), out.num_accepted)

    def _register_full_blocks(self, seq: Sequence) -> None:
        bs = self.bm.block_size
        for idx in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = self.bm.register(seq.block_table[idx], parent, seq.token_ids[idx * bs : (idx + 1) * bs], seq.cache_salt)
            seq.block_hashes.append(h)

    def _append_token(self, seq: Sequence, token: int, now: float) -> tuple[str, FinishReason | None]:
        """Append one output token: the text it completes, and why the sequence stops there (None: it goes on)."""
        seq.token_ids.append(token)
        self.counters.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        params = seq.sampling
        reason: FinishReason | None = None
        delta = ""
        may_stop = seq.num_output_tokens > params.min_tokens  # the sampler kept EOS and stop ids out until then
        if may_stop and token in params.stop_token_ids:
            reason, seq.stop_reason = FinishReason.STOP, token
        elif may_stop and token in seq.eos_ids and not params.ignore_eos:
            reason = FinishReason.STOP
        else:
            delta = seq.detokenizer.add(token, match_stops=seq.num_output_tokens >= params.min_tokens)
            if seq.detokenizer.stopped:
                reason, seq.stop_reason = FinishReason.STOP, seq.detokenizer.matched_stop
        if reason is None and (seq.num_output_tokens >= params.max_new_tokens or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        return delta, reason

    def _fail(self, seq: Sequence, now: float) -> StepEvent:
        """Finish with ERROR: its blocks are discarded (K/V that may be NaN is neither cached nor left behind)."""
        if self.speculator is not None:
            self.speculator.forget(seq.request_id)
        scrub = self.bm.discard(seq.block_table) if seq.block_table else []
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = FinishReason.ERROR
        seq.finish_time = now
        error = "the model produced non-finite logits for this request"
        return StepEvent(seq, finished=True, error=error, scrub_blocks=scrub)

    def _finish(self, seq: Sequence, reason: FinishReason, now: float) -> StepEvent:
        if self.speculator is not None:
            self.speculator.forget(seq.request_id)
        if seq.block_table:
            self.bm.free(seq.block_table)
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now
        return StepEvent(seq, text_delta=seq.detokenizer.flush(), finished=True)


def _trimmed(entry: TokenLogprob, k: int) -> TokenLogprob:
    """`entry` with at most k alternatives (the batch computed as many as its most demanding row asked)."""
    return entry if len(entry.top) <= k else TokenLogprob(entry.token_id, entry.logprob, entry.top[:k])


def _is_decoding(seq: Sequence) -> bool:
    """Prefill done: exactly the last token (the one sampled last step) is left to compute."""
    return seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens > 0
