"""Sampling never overflows on valid parameters, and never samples from a non-finite distribution: extreme
temperatures and penalties pick the right token, and a request whose logits are NaN fails alone."""

from __future__ import annotations

import math

import pytest
import torch

from inference_svc.engine.sampler import Sampler, SampleRequest
from inference_svc.engine.types import FinishReason, SamplingParams
from inference_svc.errors import InvalidRequestError, RequestFailedError


def _logits() -> torch.Tensor:
    # the best token is 7, far from id 0 (what an all-NaN row used to argmax to)
    row = torch.linspace(-3.0, 3.0, 16)
    row[7] = 9.0
    return row[None]  # [1, 16]


@pytest.mark.parametrize("temperature", [1e-37, 1e-38, 1e-45, 5e-324])
def test_tiny_temperature_is_greedy_not_nan(temperature: float) -> None:
    req = SampleRequest(SamplingParams(temperature=temperature, top_p=0.9, top_k=5), [], None)
    samples = Sampler(seed=0).sample(_logits().repeat(8, 1), [req] * 8)
    assert samples.tokens == [7] * 8
    assert samples.failed == []


def test_tiny_repetition_penalty_with_sampling_stays_finite() -> None:
    # a penalty of 1e-38 divides the seen positive logits by 1e-38: they would overflow to inf without the clamp
    logits = _logits()
    seen = [3, 12]  # 12's logit (2.2) is the larger positive one among the seen tokens
    req = SampleRequest(SamplingParams(temperature=1.0, repetition_penalty=1e-38), seen, None)
    samples = Sampler(seed=0).sample(logits.repeat(64, 1), [req] * 64)
    assert samples.failed == []
    assert set(samples.tokens) == {12}


def test_huge_repetition_penalty_with_tiny_temperature() -> None:
    req = SampleRequest(SamplingParams(temperature=1e-38, repetition_penalty=1e38), [7], None)
    samples = Sampler(seed=0).sample(_logits(), [req])
    assert samples.tokens == [15]  # 7 is pushed down to ~0; the next best (3.0, id 15) wins


def test_non_finite_row_is_reported_and_does_not_touch_the_others() -> None:
    batch = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    reqs = [
        SampleRequest(SamplingParams(temperature=1.0, seed=None), [], torch.Generator().manual_seed(i))
        for i in range(3)
    ]
    alone = [
        Sampler()
        .sample(batch[i : i + 1], [SampleRequest(reqs[i].params, [], torch.Generator().manual_seed(i))])
        .tokens[0]
        for i in range(3)
    ]
    poisoned = batch.clone()
    poisoned[1, 4] = math.nan
    poisoned_inf = batch.clone()
    poisoned_inf[1, 2] = math.inf
    for bad in (poisoned, poisoned_inf):
        reqs = [SampleRequest(r.params, [], torch.Generator().manual_seed(i)) for i, r in enumerate(reqs)]
        samples = Sampler().sample(bad, reqs)
        assert samples.failed == [1]
        assert samples.tokens[0] == alone[0] and samples.tokens[2] == alone[2]


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", math.inf), ("repetition_penalty", math.inf), ("repetition_penalty", math.nan)]
)
def test_non_finite_parameters_are_refused(field: str, value: float) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_nan_logits_fail_that_request_alone(make_engine, llama_dir, caplog) -> None:
    engine = make_engine(llama_dir, max_num_seqs=4)
    poison = 300
    bystander_prompt = [5, 6, 7, 8, 9]
    (alone,) = engine.generate([bystander_prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))
    with torch.no_grad():  # a NaN embedding row: every sequence that reads token 300 gets NaN logits
        engine.runner.model.embed_tokens.weight[poison] = math.nan
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine.add_request("bystander", bystander_prompt, params)
    engine.add_request("poisoned", [5, poison, 7], params)
    final, tokens = {}, []
    with caplog.at_level("ERROR", logger="inference_svc.engine.engine"):
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "bystander":
                    tokens += out.new_token_ids
                if out.finished:
                    final[out.request_id] = out
    assert final["poisoned"].finish_reason is FinishReason.ERROR
    assert final["poisoned"].new_token_ids == [] and "non-finite" in (final["poisoned"].error or "")
    assert final["bystander"].finish_reason is FinishReason.LENGTH and tokens == alone.token_ids
    assert engine.block_manager.num_used == 0
    assert [r.message for r in caplog.records] == [
        "request poisoned: the model's logits are not finite; failing it alone"
    ]
    with pytest.raises(RequestFailedError, match="non-finite"):
        engine.generate([[poison, 5]], params)


def test_a_failed_request_leaves_no_nan_behind(make_engine, llama_dir) -> None:
    # NaN left in a freed block would reach its next owner through attention's masked positions (NaN * 0 = NaN)
    engine = make_engine(llama_dir, max_num_seqs=4, kv_cache_memory="256KiB", block_size=16)
    prompts = [[5, 6, 7], list(range(20, 60)), [9] * 21]  # uneven lengths: padded decode rows
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    embed = engine.runner.model.embed_tokens.weight
    saved = embed[300].clone()
    with torch.no_grad():
        embed[300] = math.nan
    long_poisoned = [300, *range(61, 100)]  # 40 tokens: its full blocks would be registered in the prefix cache
    with pytest.raises(RequestFailedError):
        engine.generate([long_poisoned], SamplingParams(max_new_tokens=4, ignore_eos=True))
    with torch.no_grad():
        embed[300] = saved
    assert bool(torch.isfinite(engine.runner.cache.data).all())  # its blocks were zeroed
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used == 0
    again = [r.token_ids for r in engine.generate(prompts, params)]  # reusing the pool, batched with padding
    assert again == alone
    (fresh,) = engine.generate([long_poisoned], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert fresh.usage.cached_prompt_tokens == 0  # none of the failed request's blocks was kept as a prefix
