"""The OpenAI/vLLM sampling surface in the engine: logit_bias, presence and frequency penalties, min_tokens,
top logprobs, prompt logprobs, the matched stop, and `n` completions through the async engine.

Logprobs are checked against transformers' own forward pass of the same folder (teacher-forced on the tokens the
engine produced), so a wrong position, an off-by-one between a prompt token and the logits that predict it, or
penalties leaking into the reported distribution all fail here.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time

import pytest
import torch
import transformers

from inference_svc.async_engine import AsyncEngine
from inference_svc.engine import SamplingParams
from inference_svc.engine.detokenizer import IncrementalDetokenizer
from inference_svc.engine.sampler import Sampler, SampleRequest
from inference_svc.engine.types import FinishReason
from inference_svc.errors import InvalidRequestError

PROMPT = [5, 77, 301, 12, 9, 410, 33, 250, 18, 99, 101, 7, 64, 200, 311, 45, 2 * 61, 17, 8, 400]


@functools.lru_cache(maxsize=4)
def _reference_logprobs(folder: str, ids: tuple[int, ...]) -> torch.Tensor:
    """log_softmax of transformers' logits over `ids`: row i predicts token i + 1. [len(ids), V] fp32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 8, "ignore_eos": True, **kw})


# ---------------------------------------------------------------------------------------- logit transforms
def test_logit_bias_forces_and_bans_tokens(llama_dir, make_engine):
    engine = make_engine(llama_dir)
    plain = engine.generate([PROMPT], _greedy())[0].token_ids
    forced = engine.generate([PROMPT], _greedy(logit_bias={123: 100.0}))[0].token_ids
    assert forced == [123] * 8
    banned = engine.generate([PROMPT], _greedy(logit_bias={plain[0]: -100.0}))[0].token_ids
    assert banned[0] != plain[0]


def test_logit_bias_ids_are_checked_against_the_vocabulary(llama_dir, make_engine):
    engine = make_engine(llama_dir)
    with pytest.raises(InvalidRequestError, match="logit_bias") as err:
        engine.add_request("x", PROMPT, _greedy(logit_bias={10_000: 1.0}))
    assert err.value.field == "logit_bias"
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})


def test_presence_and_frequency_penalties_follow_openai():
    """logit[t] -= presence·[count(t) > 0] + frequency·count(t), counted over generated tokens only."""
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.5, 0.5, 0.0]])
    prompt = [2, 2, 2]  # in the prompt: never penalized by these two
    sampler = Sampler(seed=0)

    def pick(tokens: list[int], **kw) -> int:
        req = SampleRequest(SamplingParams(**kw), prompt + tokens, None, num_prompt_tokens=len(prompt))
        return sampler.sample(logits.clone(), [req]).tokens[0]

    assert pick([], frequency_penalty=2.0, presence_penalty=2.0) == 2  # nothing generated yet
    assert pick([2], presence_penalty=0.6) == 3  # 3.0 - 0.6 < 2.5
    assert pick([2], presence_penalty=0.4) == 2  # 3.0 - 0.4 > 2.5
    assert pick([2, 2], frequency_penalty=0.3) == 3  # 3.0 - 2·0.3 < 2.5
    assert pick([2], frequency_penalty=0.3) == 2  # 3.0 - 0.3 > 2.5
    assert pick([2, 3, 3], frequency_penalty=-1.0) == 3  # negative values reward repeats: 2.5 + 2 beats 3.0 + 1


def test_penalties_do_not_change_the_reported_logprobs():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.5]])
    req = SampleRequest(SamplingParams(presence_penalty=2.0, logprobs=True), [2], None, num_prompt_tokens=0)
    s = Sampler(seed=0).sample(logits, [req])
    assert s.tokens == [3]
    assert s.logprobs is not None
    assert s.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[3].item(), abs=1e-6)


def test_min_tokens_holds_back_eos_and_stop_ids(llama_dir, make_engine):
    engine = make_engine(llama_dir)
    eos = engine.tokenizer.eos_id
    assert eos is not None
    eager = SamplingParams(max_new_tokens=20, logit_bias={eos: 100.0})
    out = engine.generate([PROMPT], eager)[0]
    assert out.token_ids == [eos] and out.finish_reason is FinishReason.STOP and out.stop_reason is None
    held = engine.generate([PROMPT], SamplingParams(max_new_tokens=20, logit_bias={eos: 100.0}, min_tokens=5))[0]
    assert len(held.token_ids) == 6 and held.token_ids[-1] == eos and eos not in held.token_ids[:5]
    assert held.finish_reason is FinishReason.STOP
    stop = SamplingParams(max_new_tokens=20, logit_bias={77: 100.0}, stop_token_ids=(77,), min_tokens=3)
    stopped = engine.generate([PROMPT], stop)[0]
    assert len(stopped.token_ids) == 4 and stopped.token_ids[-1] == 77 and 77 not in stopped.token_ids[:3]
    assert stopped.stop_reason == 77


def test_min_tokens_above_max_new_tokens_is_refused():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_new_tokens=4, min_tokens=5)


def test_matched_stop_string_is_reported(llama_dir, make_engine):
    engine = make_engine(llama_dir)
    plain = engine.generate([PROMPT], _greedy(max_new_tokens=12))[0]
    assert len(plain.text) >= 6, "the reference continuation should have text to stop on"
    needle = plain.text[3:6]
    out = engine.generate([PROMPT], _greedy(max_new_tokens=12, stop=("\x00never", needle)))[0]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == needle
    assert out.text == plain.text[: plain.text.index(needle)]


# ---------------------------------------------------------------------------------------- logprobs
def test_top_logprobs_match_the_reference_distribution(llama_dir, make_engine):
    engine = make_engine(llama_dir)
    out = engine.generate([PROMPT], _greedy(top_logprobs=3))[0]
    assert out.logprobs is not None and out.top_logprobs is not None
    ref = _reference_logprobs(str(llama_dir), tuple(PROMPT + out.token_ids))
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.top_logprobs, strict=True)):
        row = ref[len(PROMPT) - 1 + i]
        assert entry.token_id == tok
        assert entry.logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert out.logprobs[i] == entry.logprob
        assert len(entry.top) == 3
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
        assert entry.top[0][0] == tok  # greedy: the chosen token is the best one
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_match_the_reference(llama_dir, make_engine, chunk):
    kw = {} if chunk is None else {"enable_chunked_prefill": True, "prefill_chunk_size": chunk}
    engine = make_engine(llama_dir, **kw)
    engine.generate([PROMPT], _greedy(max_new_tokens=2))  # the prefix cache now holds the prompt's blocks
    out = engine.generate([PROMPT], _greedy(max_new_tokens=2, prompt_logprobs=2))[0]
    ref = _reference_logprobs(str(llama_dir), tuple(PROMPT))
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(PROMPT) and entries[0] is None
    for i in range(1, len(PROMPT)):
        entry = entries[i]
        assert entry is not None and entry.token_id == PROMPT[i]
        assert entry.logprob == pytest.approx(ref[i - 1, PROMPT[i]].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == ref[i - 1].topk(2).indices.tolist()
    assert out.usage.cached_prompt_tokens == 0  # computed, not read from the cache: cached positions have no logits


def test_prompt_logprobs_survive_batching_and_preemption(llama_dir, make_engine):
    bytes_per_token = 2 * 2 * 32 * 4
    engine = make_engine(
        llama_dir,
        block_size=16,
        kv_cache_memory=6 * 16 * bytes_per_token,  # 6 blocks: the three requests cannot all stay resident
        max_num_batched_tokens=32,
        prefill_chunk_size=16,
        enable_chunked_prefill=True,
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (40, 30, 25)]
    params = [_greedy(max_new_tokens=24, prompt_logprobs=0)] * 3
    outs = engine.generate(prompts, params)
    assert engine.scheduler.counters.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _reference_logprobs(str(llama_dir), tuple(prompt))
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt)
        got = torch.tensor([e.logprob for e in entries[1:]])  # type: ignore[union-attr]
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_logprob_counts_are_bounded():
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        SamplingParams(top_logprobs=21)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


# ---------------------------------------------------------------------------------------- n completions
async def _collect(engine: AsyncEngine, prompt, sampling: SamplingParams, n: int, rid: str) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    finished: set[int] = set()
    async for out in engine.generate(prompt, sampling, request_id=rid, n=n):
        assert out.request_id == rid
        tokens.setdefault(out.index, []).extend(out.new_token_ids)
        if out.finished:
            finished.add(out.index)
    assert finished == set(range(n))
    return tokens


def test_n_completions_are_seeded_children(llama_dir, make_engine):
    async def main() -> None:
        engine = AsyncEngine(make_engine(llama_dir))
        await engine.start()
        try:
            sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
            many = await _collect(engine, PROMPT, sampling, 3, "many")
            assert sorted(many) == [0, 1, 2]
            assert len({tuple(v) for v in many.values()}) > 1, "three seeded completions should differ"
            for i in range(3):  # completion i is the request with seed + i, alone
                alone = await _collect(engine, PROMPT, SamplingParams(**{**_kw(sampling), "seed": 1234 + i}), 1, "a")
                assert alone[0] == many[i]
            assert engine.num_in_flight == 0
            with pytest.raises(InvalidRequestError, match="n"):
                await _collect(engine, PROMPT, sampling, 17, "too-many")
        finally:
            await engine.stop()

    asyncio.run(main())


def _kw(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in ("max_new_tokens", "temperature", "seed", "ignore_eos")}


def test_leaving_n_completions_early_frees_every_child(llama_dir, make_engine):
    async def main() -> None:
        inner = make_engine(llama_dir)
        engine = AsyncEngine(inner)
        await engine.start()
        try:
            gen = engine.generate(PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True), request_id="r", n=4)
            seen = 0
            async for out in gen:
                seen += len(out.new_token_ids)
                if seen >= 6:
                    break
            await gen.aclose()
            deadline = time.monotonic() + 30.0  # the aborts apply at the engine's next step; bounded wait
            while True:
                stats = await engine.stats()
                if (stats.num_running == 0 and stats.num_waiting == 0) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
            assert stats.num_running == 0 and stats.num_waiting == 0
            assert stats.kv_blocks_used == 0
        finally:
            await engine.stop()

    asyncio.run(main())


def test_stop_strings_are_matched_only_after_min_tokens(small_tokenizer):
    text = "x = 1; STOP y = 2; STOP z"
    ids = small_tokenizer.encode(text)
    cut = len(small_tokenizer.encode("x = 1; STOP y"))  # tokens fed before min_tokens: the first STOP is inside
    detok = IncrementalDetokenizer(small_tokenizer, ("STOP",))
    shown = "".join(detok.add(t, match_stops=i >= cut) for i, t in enumerate(ids))
    assert detok.stopped and detok.matched_stop == "STOP"
    assert detok.final_text() == "x = 1; STOP y = 2; "
    assert shown + detok.flush() == detok.final_text()
