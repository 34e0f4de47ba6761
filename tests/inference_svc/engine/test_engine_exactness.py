"""Greedy exactness against transformers `generate`, and batch invariance.

The engine serves prompts of different lengths concurrently with chunked prefill, prefix caching on (some prompts
share long prefixes) and a KV pool so small that sequences are preempted and recomputed; every request's tokens must
still equal transformers' greedy `generate` for that prompt alone.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import transformers

from inference_svc.engine import SamplingParams
from shared_model.bundle import load_bundle

NEW_TOKENS = 16


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]  # 2.5 blocks shared by three prompts
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 33, 90, 150)]
    prompts += [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (3, 20, 41)]
    return prompts


def _hf_greedy(folder, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [list(x) for x in _hf_greedy_cached(str(folder), tuple(map(tuple, prompts)), n)]


@functools.lru_cache(maxsize=8)
def _hf_greedy_cached(folder: str, prompts: tuple[tuple[int, ...], ...], n: int) -> tuple[tuple[int, ...], ...]:
    """transformers' greedy continuation of each prompt alone (cached: several tests share references)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in map(list, prompts):
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
            out.append(tuple(gen[0, len(p) :].tolist()))
    return tuple(out)


@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_matches_transformers_under_pressure(model_dir, make_engine, chunked):
    bytes_per_token = 2 * 2 * 32 * 4  # layers=2, kv width 2·16, fp32
    engine = make_engine(
        model_dir,
        block_size=16,
        kv_cache_memory=14 * 16 * bytes_per_token,  # 14 blocks = 224 tokens for ~680 tokens of demand
        max_num_batched_tokens=64,
        prefill_chunk_size=24,
        enable_chunked_prefill=chunked,
        max_num_seqs=8,
    )
    assert engine.block_manager.num_blocks == 14
    prompts = _prompts(0, engine.model_config.vocab_size)
    expected = _hf_greedy(model_dir, prompts, NEW_TOKENS)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    for i, (r, ref) in enumerate(zip(results, expected, strict=True)):
        assert r.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) diverged"
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the tiny pool should have forced preemption"
    assert stats.cached_prompt_tokens_total > 0, "shared prefixes should have hit the prefix cache"
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    engine.block_manager.check_invariants()


def test_prefix_cache_hit_is_exact(model_dir, make_engine):
    engine = make_engine(model_dir, prefill_chunk_size=16)
    prompts = _prompts(1, engine.model_config.vocab_size)[-3:]
    expected = _hf_greedy(model_dir, prompts, 12)
    first = engine.generate(prompts[:1], SamplingParams(max_new_tokens=12))
    rest = engine.generate(prompts[1:], SamplingParams(max_new_tokens=12))  # reuse the first prompt's blocks
    assert [r.token_ids for r in first + rest] == expected
    assert all(r.usage.cached_prompt_tokens == 32 for r in rest)  # two full 16-token blocks of the shared 40


def test_engine_logits_match_model_forward(model_dir, make_engine):
    """Log-probabilities of greedy tokens equal those of a full forward pass over prompt + output."""
    engine = make_engine(model_dir, prefill_chunk_size=8)
    prompt = _prompts(2, engine.model_config.vocab_size)[3]
    (r,) = engine.generate([prompt], SamplingParams(max_new_tokens=8, logprobs=True, ignore_eos=True))
    model = load_bundle(model_dir, dtype="float32").model
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + r.token_ids])).float(), dim=-1)[0]
    ref = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(r.token_ids)]
    assert r.logprobs == pytest.approx(ref, abs=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=20, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=1.3, min_p=0.05, repetition_penalty=1.2, seed=7),
    ],
    ids=["greedy", "seeded-topk-topp", "seeded-minp-penalty"],
)
def test_batch_invariance_with_15_others(qwen3_dir, make_engine, params):
    rng = random.Random(5)
    vocab = 512
    target = [rng.randrange(3, vocab) for _ in range(37)]
    alone = make_engine(qwen3_dir, prefill_chunk_size=16).generate([target], params)[0]
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 80))] for _ in range(15)]
    other_params = [
        SamplingParams(max_new_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 0.7, 1.0]), top_k=20)
        for _ in others
    ]
    engine = make_engine(qwen3_dir, prefill_chunk_size=16, max_num_batched_tokens=128)
    batched = engine.generate([*others[:7], target, *others[7:]], [*other_params[:7], params, *other_params[7:]])
    assert batched[7].token_ids == alone.token_ids
    assert batched[7].text == alone.text
