"""Speculative decoding with a draft model (`speculative=DRAFT_DIR`): the target's output unchanged, the draft's
K/V inside the same budget, and a draft that does not share the tokenizer refused.

The target drafting for itself keeps (nearly) every draft; the other random model of the session, which shares the
tokenizer and vocabulary, keeps few: both must leave greedy output exactly as plain decoding gives it.
"""

from __future__ import annotations

import shutil

import pytest

from inference_svc.engine import EngineConfig, EngineConfigError, SamplingParams
from inference_svc.errors import ModelLoadError
from tests.inference_svc.engine.test_speculative_exactness import NEW_TOKENS, _prompts, _tokens


def test_target_as_its_own_draft_keeps_nearly_every_draft(llama_dir, make_engine):
    prompts = _prompts(5, 512, 4)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    plain = _tokens(make_engine(llama_dir), prompts, params)
    spec = make_engine(llama_dir, speculative=str(llama_dir), num_speculative_tokens=4, speculative_max_batch=0)
    results = spec.generate(prompts, params)
    assert [r.token_ids for r in results] == plain
    drafted = sum(r.usage.draft_tokens for r in results)
    kept = sum(r.usage.accepted_draft_tokens for r in results)
    assert drafted > 0 and kept >= 0.9 * drafted
    assert spec.block_manager.num_used == 0


def test_another_model_as_draft_under_chunking_prefix_cache_and_preemption(llama_dir, qwen3_dir, make_engine):
    prompts = _prompts(8, 512, 8)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    plain = _tokens(make_engine(llama_dir), prompts, params)
    target_bpt = 2 * 2 * 32 * 4  # layers=2, kv width 2·16, fp32
    draft_bpt = 2 * 2 * 32 * 4  # the qwen3 draft: the same sizes
    spec = make_engine(
        llama_dir,
        speculative=str(qwen3_dir),
        speculative_verify_cost=0.0,
        speculative_max_batch=0,
        block_size=8,
        kv_cache_memory=24 * 8 * (target_bpt + draft_bpt),  # 24 blocks for both models' K/V
        max_num_batched_tokens=48,
        prefill_chunk_size=8,
        max_num_seqs=6,
    )
    assert spec.block_manager.num_blocks == 24
    assert _tokens(spec, prompts, params) == plain
    stats = spec.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert 0 <= stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total
    assert spec.block_manager.num_used == 0


def test_draft_kv_shares_the_budget_and_is_reported(llama_dir, qwen3_dir, make_engine):
    alone = make_engine(llama_dir, kv_cache_memory="4MiB")
    both = make_engine(llama_dir, kv_cache_memory="4MiB", speculative=str(qwen3_dir))
    info = both.info()
    assert info.draft_model_path == qwen3_dir
    assert info.draft_kv_bytes_per_token == alone.info().kv_bytes_per_token  # same sizes
    assert info.kv_blocks_total == alone.info().kv_blocks_total // 2
    assert info.draft_kv_cache_bytes == info.kv_blocks_total * info.draft_kv_bytes_per_block
    assert info.kv_cache_bytes + info.draft_kv_cache_bytes <= 4 * 1024**2
    assert info.draft_weight_bytes > 0


def test_sampled_requests_with_a_draft_model_are_seeded(llama_dir, make_engine):
    engine = make_engine(llama_dir, speculative=str(llama_dir), speculative_max_batch=0)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    first = engine.generate([[5, 6, 7, 8, 9]], params)[0]
    again = engine.generate([[5, 6, 7, 8, 9]], params)[0]
    assert len(first.token_ids) == NEW_TOKENS
    assert first.usage.draft_tokens > 0 and first.usage.accepted_draft_tokens > 0
    assert again.token_ids == first.token_ids  # drafts from the request's own seeded draft stream


def test_a_draft_with_another_vocabulary_is_refused(llama_dir, tmp_path, small_tokenizer):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=600, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    other = tmp_path / "other"
    transformers.LlamaForCausalLM(cfg).save_pretrained(other)
    small_tokenizer.save(other)
    from inference_svc.engine import Engine

    with pytest.raises(ModelLoadError, match=r"vocab_size 600.*share the target's tokenizer"):
        Engine.from_bundle(llama_dir, EngineConfig(dtype="float32", kv_cache_memory="4MiB", speculative=str(other)))


def test_a_draft_with_another_tokenizer_is_refused(llama_dir, tmp_path):
    from inference_svc.engine import Engine
    from shared_model.corpus import CorpusConfig, load_corpus
    from shared_model.tokenizer import Tokenizer

    other = tmp_path / "draft"
    shutil.copytree(llama_dir, other)
    Tokenizer.train(load_corpus(CorpusConfig(max_documents=5)).texts(), vocab_size=512).save(other)
    with pytest.raises(ModelLoadError, match="different tokenizer"):
        Engine.from_bundle(llama_dir, EngineConfig(dtype="float32", kv_cache_memory="4MiB", speculative=str(other)))


def test_speculative_names_a_method_or_a_folder(tmp_path):
    with pytest.raises(EngineConfigError, match="speculative: must be 'off', 'ngram' or the folder"):
        EngineConfig(speculative=str(tmp_path / "missing"))
    assert EngineConfig(speculative=str(tmp_path)).draft_model_path == tmp_path
    assert EngineConfig(speculative="ngram").draft_model_path is None


def test_the_ledger_shows_the_drafts_share_as_the_engine_counts_it(llama_dir, qwen3_dir, make_engine, capsys):
    import json

    from shared_model.ledger_cli import main

    for kv in ("fp32", "int8"):
        info = make_engine(llama_dir, speculative=str(qwen3_dir), kv_cache_dtype=kv).info()
        assert main(["--model", str(llama_dir), "--draft", str(qwen3_dir), "--kv-dtype", kv, "--json"]) == 0
        draft = json.loads(capsys.readouterr().out)["draft"]
        assert draft["kv_bytes_per_token"] == info.draft_kv_bytes_per_token
        assert draft["total_kv_bytes_per_token"] == info.kv_bytes_per_token + info.draft_kv_bytes_per_token
    assert main(["--model", str(llama_dir), "--draft", str(qwen3_dir)]) == 0
    assert "K/V per token, target + draft" in capsys.readouterr().out
