"""Speculative decoding (n-gram drafts) changes how many tokens a step produces, never which tokens.

Every test compares an engine that speculates with one that does not, on the same model and prompts, and checks
that drafts were really verified, kept and rejected (a comparison in which nothing was drafted would prove
nothing). Prompt lookup runs on a briefly trained model (`trained_dir`), whose loops it matches; on random weights
it rarely matches anything, so there the drafts come from `KnownContinuation`: the plain engine's own output with
a seeded fraction of its tokens made wrong, which exercises acceptance and rejection at chosen rates through the
engine's real verify path.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from inference_svc.engine import SamplingParams
from inference_svc.engine.speculative import Draft

NEW_TOKENS = 24


def _prompts(seed: int, vocab: int, n: int) -> list[list[int]]:
    """Prompts with repeats inside (prompt lookup finds matches) and a shared prefix (the prefix cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(37)]
    out = []
    for i in range(n):
        motif = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 9))]
        body = motif * rng.randrange(2, 5) + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
        out.append(shared + body if i % 3 == 0 else body)
    return out


def _tokens(engine, prompts, params) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts, params)]


class KnownContinuation:
    """A drafter that knows each prompt's plain greedy output and gets every `wrong_every`-th output position
    wrong (so rejections happen at known places, whatever the step boundaries)."""

    writes_kv = False

    def __init__(self, prompts, outputs, wrong_every: int, vocab: int = 512) -> None:
        self.reference = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
        self.wrong_every = wrong_every
        self.vocab = vocab

    def propose(self, seq, k: int) -> Draft:
        ref = self.reference[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        done = seq.num_output_tokens
        return Draft(tuple(
            (t + 1) % self.vocab if (done + i) % self.wrong_every == self.wrong_every - 1 else t
            for i, t in enumerate(ref[done : done + k])
        ))  # fmt: skip

    def forget(self, request_id: str) -> None:
        pass


def _drafting_from(engine, prompts, outputs, wrong_every: int):
    engine.scheduler.speculator.proposer = KnownContinuation(prompts, outputs, wrong_every)
    return engine


@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_output_is_unchanged_with_prompt_lookup(trained_dir, make_engine, batch):
    texts = ["def __init__(self, x):\n    self.x = x\n", "import os\nimport sys\n", "for i in range(10):\n"]
    prompts = [texts[i % 3] + "#" * (i // 3) for i in range(batch)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain = _tokens(make_engine(trained_dir), prompts, params)
    spec = make_engine(trained_dir, speculative="ngram", num_speculative_tokens=4, speculative_max_batch=0)
    assert _tokens(spec, prompts, params) == plain
    stats = spec.stats()
    assert stats.spec_accepted_tokens_total > 0
    assert stats.spec_tokens_per_step > 1.0
    assert spec.block_manager.num_used == 0


@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_output_is_unchanged_when_drafts_are_rejected(model_dir, make_engine, batch):
    prompts = _prompts(batch, 512, batch)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    plain = _tokens(make_engine(model_dir), prompts, params)
    spec = make_engine(model_dir, speculative="ngram", num_speculative_tokens=4, speculative_verify_cost=0.0,
                       speculative_max_batch=0)  # fmt: skip
    assert _tokens(_drafting_from(spec, prompts, plain, wrong_every=4), prompts, params) == plain
    stats = spec.stats()
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    assert spec.block_manager.num_used == 0


def test_greedy_unchanged_under_chunked_prefill_prefix_cache_and_preemption(llama_dir, make_engine):
    prompts = _prompts(7, 512, 10)
    bytes_per_token = 2 * 2 * 32 * 4  # layers=2, kv width 2·16, fp32
    tight = dict(
        block_size=8,
        kv_cache_memory=24 * 8 * bytes_per_token,  # 24 blocks = 192 tokens for ~700 tokens of demand
        max_num_batched_tokens=48,
        prefill_chunk_size=8,
        max_num_seqs=6,
    )
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    plain = _tokens(make_engine(llama_dir), prompts, params)
    spec = make_engine(llama_dir, speculative="ngram", speculative_verify_cost=0.0, speculative_max_batch=0,
                       **tight)  # fmt: skip
    assert _tokens(_drafting_from(spec, prompts, plain, wrong_every=5), prompts, params) == plain
    stats = spec.stats()
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert stats.prefix_cache_hit_tokens > 0
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    assert spec.block_manager.num_used == 0


def test_speculating_and_plain_requests_share_steps(qwen3_dir, make_engine):
    """Per request: half the batch asks for drafts on an engine that does not speculate by default."""
    prompts = _prompts(3, 512, 8)
    per = [SamplingParams(max_new_tokens=NEW_TOKENS, num_speculative_tokens=3 if i % 2 else 0) for i in range(8)]
    plain = _tokens(make_engine(qwen3_dir), prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    engine = make_engine(qwen3_dir, speculative_max_batch=0)
    results = engine.generate(prompts, per)
    assert [r.token_ids for r in results] == plain
    assert all(r.usage.draft_tokens == 0 for r in results[0::2])
    assert sum(r.usage.accepted_draft_tokens for r in results[1::2]) > 0


def test_every_decoding_rule_applies_position_by_position(llama_dir, make_engine):
    """Penalties, logit_bias, min_tokens, stop ids and strings, EOS and max_new_tokens with speculation."""
    prompts = _prompts(11, 512, 4)
    plain_engine = make_engine(llama_dir)
    spec_engine = make_engine(llama_dir, speculative="ngram", num_speculative_tokens=5, speculative_max_batch=0)
    reference = _tokens(plain_engine, prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    frequent = max(range(512), key=lambda t: sum(r.count(t) for r in reference))
    cases = [
        SamplingParams(max_new_tokens=NEW_TOKENS, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=NEW_TOKENS, presence_penalty=0.8, frequency_penalty=0.5),
        SamplingParams(max_new_tokens=NEW_TOKENS, logit_bias={frequent: -100.0}),
        SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=(frequent,), min_tokens=3),
        SamplingParams(max_new_tokens=7),
        SamplingParams(max_new_tokens=NEW_TOKENS, stop=[plain_engine.tokenizer.decode([frequent])]),
        SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=True, top_logprobs=3),
    ]
    drafted = 0
    for params in cases:
        plain = plain_engine.generate(prompts, params)
        spec = spec_engine.generate(prompts, params)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain], params
        assert [r.text for r in spec] == [r.text for r in plain], params
        assert [(r.finish_reason, r.stop_reason) for r in spec] == [(r.finish_reason, r.stop_reason) for r in plain]
        if params.logprobs:
            for s, p in zip(spec, plain, strict=True):
                assert s.logprobs == pytest.approx(p.logprobs, abs=1e-4)
                assert [t.token_id for t in s.top_logprobs] == [t.token_id for t in p.top_logprobs]
        drafted += sum(r.usage.draft_tokens for r in spec)
        assert spec_engine.block_manager.num_used == 0
    assert drafted > 0


def test_usage_reports_acceptance_and_tokens_per_step(llama_dir, make_engine):
    engine = make_engine(llama_dir, speculative="ngram", speculative_max_batch=0)
    [result] = engine.generate([[5, 6, 7, 8] * 6], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    u = result.usage
    assert u.completion_tokens == NEW_TOKENS
    assert 0 < u.accepted_draft_tokens <= u.draft_tokens
    assert u.decode_steps == NEW_TOKENS - u.accepted_draft_tokens  # each kept draft saved exactly one step
    assert u.tokens_per_step == pytest.approx(NEW_TOKENS / u.decode_steps)


def test_abort_after_a_verify_step_frees_every_block(llama_dir, make_engine):
    engine = make_engine(llama_dir, speculative="ngram", num_speculative_tokens=8, speculative_max_batch=0)
    for i in range(3):
        engine.add_request(f"r{i}", [9, 10, 11, 12] * 8, SamplingParams(max_new_tokens=200, ignore_eos=True))
    for _ in range(200):
        engine.step()
        if engine.stats().spec_draft_tokens_total > 0:
            break
    assert engine.stats().spec_draft_tokens_total > 0
    for i in range(3):
        assert engine.abort_request(f"r{i}")
    outputs = engine.step()
    assert {o.request_id for o in outputs if o.finished} == {"r0", "r1", "r2"}
    assert engine.block_manager.num_used == 0
    assert not engine.has_unfinished_requests()


def test_rejected_drafts_leave_no_trace(llama_dir, make_engine):
    """After a run with many rejections, blocks in use equal what the kept tokens need, and the prefix cache holds
    only blocks of tokens that are really in the sequences."""
    engine = make_engine(llama_dir, speculative="ngram", num_speculative_tokens=8, speculative_max_batch=0)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10] * 4 + [40, 41]
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))
    seq = engine._requests["r"]
    while engine.has_unfinished_requests():
        engine.step()
        if not seq.is_finished:
            bm = engine.block_manager  # the computed tokens' blocks, and at most the newest token's, never more
            assert bm.blocks_for(seq.num_computed_tokens) <= len(seq.block_table) <= bm.blocks_for(seq.num_tokens)
            assert seq.num_computed_tokens == seq.num_tokens - 1
    stats = engine.stats()
    assert stats.spec_draft_tokens_total > stats.spec_accepted_tokens_total  # some drafts were rejected
    # the same tokens asked again hit the cache for every full block of what was generated, and only those
    again = prompt + seq.output_token_ids
    before = engine.block_manager.hit_tokens
    [cached] = engine.generate([again], SamplingParams(max_new_tokens=6, ignore_eos=True))
    hit = engine.block_manager.hit_tokens - before
    bs = engine.config.block_size
    assert hit == (len(again) - 1) // bs * bs  # every full block of computed tokens: rejected drafts left none
    # and what those blocks hold is the kept tokens' K/V: continuing from them equals computing everything afresh
    [fresh] = make_engine(llama_dir, enable_prefix_caching=False).generate(
        [again], SamplingParams(max_new_tokens=6, ignore_eos=True)
    )
    assert cached.token_ids == fresh.token_ids
    assert cached.usage.cached_prompt_tokens == hit


def test_verify_items_run_as_decode_queries_with_the_prefill_paths_logits(model_dir, make_engine, monkeypatch):
    """A verify item (last token + drafts) runs as one decode query per token over its context so far
    (`model_runner.QUERY_CHUNK_MAX`); every such step is also run through the prefill path first, in place (both
    write the same K/V to the same slots), and the two give the same logits."""
    from inference_svc.engine import model_runner

    prompts = _prompts(5, 512, 4)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    plain = _tokens(make_engine(model_dir), prompts, params)
    spec = _drafting_from(
        make_engine(model_dir, speculative="ngram", speculative_verify_cost=0.0, speculative_max_batch=0),
        prompts, plain, wrong_every=3,
    )  # fmt: skip
    runner = spec.runner
    run, factory = runner.run, runner.backend_factory
    # per step with a verify item: its verify tokens and the step's decode queries, each as (the blocks of its
    # context, its context length), so a query is its sequence's (a prompt chunk in the same step runs as a prefill
    # chunk and is in neither)
    seen: list[tuple[Counter[tuple], Counter[tuple]]] = []
    bs = spec.config.block_size

    def query(blocks, length: int) -> tuple:
        return tuple(blocks[: -(-length // bs)]), length

    def checked_run(batch):
        if not any(b.draft for b in batch):
            return run(batch)
        verify = Counter(
            query(b.seq.block_table, p + 1) for b in batch if b.draft for p in range(b.start, b.start + b.num_tokens)
        )

        def recording_factory(cache, meta):
            n = meta.num_decode_tokens
            lens, tables = meta.decode_context_lens[:n].tolist(), meta.decode_block_tables[:n].tolist()
            seen.append((verify, Counter(query(t, length) for t, length in zip(tables, lens, strict=True))))
            return factory(cache, meta)

        with monkeypatch.context() as m:
            m.setattr(model_runner, "QUERY_CHUNK_MAX", 0)  # every chunk a prefill chunk
            as_prefill = run(batch).sample
        runner.backend_factory = recording_factory
        try:
            out = run(batch)
        finally:
            runner.backend_factory = factory
        torch.testing.assert_close(out.sample, as_prefill, rtol=1e-4, atol=1e-4)  # fp32 sums in another order
        return out

    runner.run = checked_run
    assert _tokens(spec, prompts, params) == plain
    assert seen, "no verify step ran"
    assert all(not verify - queries for verify, queries in seen)  # every verify token was a decode query
    assert max(verify.total() for verify, _ in seen) > len(prompts)  # and there were drafts among them


def test_no_drafts_while_the_engine_holds_more_requests_than_the_cap(model_dir, make_engine) -> None:
    """`speculative_max_batch` counts every request in the engine, running or waiting: under a cap of 2, no step
    drafts while three requests are in (even in the first steps, when only some of them decode); once one has
    finished, the others draft."""
    prompts = _prompts(7, 512, 3)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    plain = _tokens(make_engine(model_dir), prompts, params)
    spec = make_engine(model_dir, speculative="ngram", speculative_verify_cost=0.0, speculative_max_batch=2,
                       max_num_batched_tokens=32, prefill_chunk_size=16)  # fmt: skip
    spec.scheduler.speculator.proposer = KnownContinuation(prompts, plain, wrong_every=4)  # drafts whenever allowed
    scheduler, schedule = spec.scheduler, spec.scheduler.schedule
    steps: list[tuple[int, bool]] = []  # (requests in the engine, whether the step drafted)

    def recording_schedule(now):
        held = len(scheduler.running) + len(scheduler.waiting)
        batch = schedule(now)
        steps.append((held, any(b.draft for b in batch)))
        return batch

    scheduler.schedule = recording_schedule
    assert _tokens(spec, prompts, params) == plain
    assert not any(drafted for held, drafted in steps if held > 2)
    assert any(drafted for held, drafted in steps if held <= 2)
    assert any(held == 3 for held, _ in steps)
