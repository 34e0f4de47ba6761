"""The Engine API: request validation, abort, streaming outputs, stats and info."""

from __future__ import annotations

import pytest

from inference_svc.engine import Engine, EngineConfig, EngineConfigError, FinishReason, SamplingParams, parse_bytes
from inference_svc.errors import InvalidRequestError
from shared_model.ledger import kv_cache_bytes


@pytest.fixture
def engine(qwen3_dir, make_engine) -> Engine:
    return make_engine(qwen3_dir, kv_cache_memory="256KiB")


def _field(excinfo) -> str:
    return excinfo.value.field


def test_invalid_requests_name_the_field(engine):
    p = SamplingParams(max_new_tokens=4)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("a", "", p)
    assert _field(e) == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("a", [], p)
    assert _field(e) == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("a", [1, 512], p)
    assert _field(e) == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as e:  # 256KiB / (16 tok · 512 B) = 32 blocks = 512 tokens
        engine.add_request("a", [5] * 600, p)
    assert _field(e) == "prompt" and "context" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("a", [5], SamplingParams(max_new_tokens=5000))
    assert _field(e) == "max_new_tokens"
    engine.add_request("a", [5], p)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("a", [6], p)
    assert _field(e) == "request_id"


def test_prompt_that_can_never_fit_the_pool_is_refused_at_once(qwen3_dir, make_engine):
    engine = make_engine(qwen3_dir, kv_cache_memory=4 * 16 * 512)  # 4 blocks = 64 tokens
    assert engine.max_model_len == 64
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("big", [5] * 64, SamplingParams())
    assert e.value.field == "prompt" and "KV-cache pool" in str(e.value)
    assert not engine.has_unfinished_requests()


def test_stream_abort_frees_blocks(engine):
    engine.add_request("x", [5, 6, 7, 8] * 10, SamplingParams(max_new_tokens=100, ignore_eos=True))
    engine.add_request("y", [9, 10], SamplingParams(max_new_tokens=3, ignore_eos=True))
    outs = engine.step() + engine.step()
    assert {o.request_id for o in outs} == {"x", "y"}
    assert engine.stats().kv_blocks_used > 0
    assert engine.abort_request("x")
    assert not engine.abort_request("nope")
    final = [o for o in engine.step() if o.request_id == "x"]
    assert len(final) == 1 and final[0].finished and final[0].finish_reason is FinishReason.CANCELLED
    assert final[0].timing is not None
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.stats()
    assert s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0
    assert not engine.abort_request("x")


def test_abort_waiting_request(engine):
    engine.add_request("w", [5, 6], SamplingParams(max_new_tokens=2))
    assert engine.abort_request("w")
    (out,) = engine.step()
    assert out.finished and out.finish_reason is FinishReason.CANCELLED and out.usage.completion_tokens == 0
    assert not engine.has_unfinished_requests()


def test_outputs_stream_and_finish_with_usage(engine):
    engine.add_request("r", "def f(x):", SamplingParams(max_new_tokens=5, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [len(o.new_token_ids) for o in outs] == [1] * 5
    assert [o.finished for o in outs] == [False] * 4 + [True]
    last = outs[-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert last.usage.completion_tokens == 5 and last.usage.prompt_tokens == len(engine.tokenizer.encode("def f(x):"))
    ids = [t for o in outs for t in o.new_token_ids]
    assert "".join(o.text_delta for o in outs) == engine.tokenizer.decode(ids, skip_special_tokens=True)
    t = last.timing
    assert t is not None and 0 <= t.queue_ms <= t.ttft_ms <= t.total_ms


def test_stop_token_ids_and_eos(engine):
    (free,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    stop_at = free.token_ids[2]
    (r,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, stop_token_ids=(stop_at,), ignore_eos=True))
    first = free.token_ids.index(stop_at)
    assert r.token_ids == free.token_ids[: first + 1] and r.finish_reason is FinishReason.STOP
    assert r.text == engine.tokenizer.decode(free.token_ids[:first], skip_special_tokens=True)


def test_stop_string_is_stripped_and_found_across_tokens(engine):
    (free,) = engine.generate([[40, 41, 42]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    text = free.text
    assert len(text) > 6
    stop = text[3:6]  # likely spans a token boundary; found wherever it falls
    (r,) = engine.generate([[40, 41, 42]], SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop,)))
    assert r.finish_reason is FinishReason.STOP
    assert r.text == text[: text.index(stop)]


def test_stats_and_info_accounting(engine):
    info = engine.info()
    c = engine.model_config
    assert info.kv_bytes_per_token == kv_cache_bytes(c.num_layers, 1, 1, c.kv_size, 4) == 512
    assert info.kv_capacity_tokens == info.kv_blocks_total * info.config.block_size
    assert info.kv_cache_bytes == info.kv_capacity_tokens * info.kv_bytes_per_token
    assert info.attention_backend == "torch" and info.model_config is engine.model_config
    qk_table = c.num_layers * (c.num_heads + c.num_kv_heads) * c.head_dim * 4 if c.qk_norm else 0  # merged norms
    assert info.weight_bytes == sum(p.numel() * 4 for p in engine.runner.model.parameters()) + qk_table
    engine.generate([[1, 2, 3] * 12], SamplingParams(max_new_tokens=2))
    engine.generate([[1, 2, 3] * 12 + [4]], SamplingParams(max_new_tokens=2))  # after the first: a cache hit
    s = engine.stats()
    assert s.prompt_tokens_total == 73 and s.generation_tokens_total == 4
    assert s.kv_blocks_used + s.kv_blocks_free == s.kv_blocks_total
    assert s.cached_prompt_tokens_total == 32 and s.kv_blocks_cached >= 2
    assert engine.info().peak_workspace_bytes > 0


def test_prefix_caching_can_be_switched_off(qwen3_dir, make_engine):
    engine = make_engine(qwen3_dir, enable_prefix_caching=False)
    engine.generate([[1, 2, 3] * 12], SamplingParams(max_new_tokens=2))
    engine.generate([[1, 2, 3] * 12 + [4]], SamplingParams(max_new_tokens=2))
    assert engine.stats().cached_prompt_tokens_total == 0 and engine.stats().kv_blocks_cached == 0


def test_config_validation_names_fields():
    for kwargs, field in [
        (dict(block_size=0), "block_size"),
        (dict(kv_cache_memory="lots"), "kv_cache_memory"),
        (dict(gpu_memory_fraction=1.5), "gpu_memory_fraction"),
        (dict(attention_backend="cuda"), "attention_backend"),
        (dict(dtype="int4"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(max_model_len=0), "max_model_len"),
    ]:
        with pytest.raises(EngineConfigError) as e:
            EngineConfig(**kwargs)
        assert e.value.field == field
    assert parse_bytes("2GiB") == 2 * 1024**3 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(10) == 10
