"""What `/metrics` says, read from a real `ServiceMetrics`'s rendered text (no server): every series labelled with
the served model's name, the prefix cache as hit and query counters advanced by difference, the KV usage ratio,
build info, and no `_created` samples."""

from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inference_svc.engine import EngineStats
from inference_svc.engine.types import Timing
from inference_svc.executor.plan import Choice, LoadPlan
from inference_svc.metrics import ServiceMetrics

MODEL = "tiny-coder"


def _stats(**overrides: float) -> EngineStats:
    base = dict(
        num_running=2,
        num_waiting=1,
        kv_blocks_total=64,
        kv_blocks_used=16,
        kv_blocks_free=48,
        kv_blocks_cached=4,
        prefix_cache_hit_tokens=0,
        prefix_cache_queried_tokens=0,
        num_preemptions=0,
        prompt_tokens_total=0,
        generation_tokens_total=0,
        cached_prompt_tokens_total=0,
    )
    return EngineStats(**{**base, **overrides})


def _samples(metrics: ServiceMetrics) -> list:
    """Tandem's own `tandem_*` samples (the `vllm:*` ones, labelled as vLLM's: tests/.../test_metrics_vllm.py)."""
    families = text_string_to_metric_families(metrics.render().decode())
    return [s for family in families for s in family.samples if s.name.startswith("tandem_")]


def _value(metrics: ServiceMetrics, name: str, **labels: str) -> float:
    """The one sample named `name` whose labels include `labels`."""
    found = [s.value for s in _samples(metrics) if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) == 1, f"{len(found)} samples {name}{labels}"
    return found[0]


def _exercised(model_name: str = MODEL) -> ServiceMetrics:
    """A `ServiceMetrics` through every call site the service uses, so every metric has a series."""
    m = ServiceMetrics(model_name=model_name)
    m.observe_model(
        SimpleNamespace(
            dtype="float32", quantization="int8", weight_bytes=1234,
            kv_cache_dtype="int8", kv_cache_bytes=8320, kv_bytes_per_token=130, compile_seconds=12.5,
            kv_blocks_total=64, config=SimpleNamespace(block_size=16, enable_prefix_caching=True),
            load_plan=LoadPlan((Choice("compile", "on", "--compile on"),)),
        )
    )  # fmt: skip
    m.observe_stats(_stats())
    m.observe_admission(3, 300)
    m.observe_tokenizer(10, 100)
    m.observe_finished("length", Timing(queue_ms=1.0, ttft_ms=20.0, tpot_ms=5.0, total_ms=60.0))
    m.observe_error("CANCELLED")
    m.observe_inter_token(0.004)
    return m


def test_every_series_carries_the_model_name() -> None:
    samples = _samples(_exercised())
    names = {s.name for s in samples}
    for expected in (
        "tandem_time_to_first_token_seconds_count",
        "tandem_requests_finished_total",
        "tandem_request_errors_total",
        "tandem_model_weight_bytes",
        "tandem_tokenized_chars_total",
        "tandem_prefix_cache_hits_total",
        "tandem_kv_cache_usage_ratio",
        "tandem_kv_cache_bytes",
        "tandem_kv_bytes_per_token",
        "tandem_compile_seconds",
        "tandem_build_info",
    ):
        assert expected in names, expected
    unlabelled = [s.name for s in samples if s.labels.get("model_name") != MODEL]
    assert not unlabelled, f"series without model_name={MODEL!r}: {unlabelled}"
    m = _exercised()
    assert _value(m, "tandem_requests_finished_total", model_name=MODEL, finish_reason="length") == 1
    assert _value(m, "tandem_request_errors_total", model_name=MODEL, code="CANCELLED") == 1
    assert _value(m, "tandem_model_weight_bytes", dtype="float32", quantization="int8") == 1234
    assert _value(m, "tandem_kv_cache_bytes", kv_cache_dtype="int8") == 8320
    assert _value(m, "tandem_kv_bytes_per_token", kv_cache_dtype="int8") == 130
    assert _value(m, "tandem_compile_seconds") == 12.5
    assert _value(m, "tandem_time_to_first_token_seconds_sum") == pytest.approx(0.020)
    assert _value(m, "tandem_admission_queue_tokens") == 300


def test_without_a_model_name_the_label_is_left_out() -> None:
    """The default "": no model_name label at all (to Prometheus the same series as model_name="")."""
    m = _exercised(model_name="")
    samples = _samples(m)
    assert samples and all("model_name" not in s.labels for s in samples)
    assert _value(m, "tandem_requests_finished_total", finish_reason="length") == 1
    assert _value(m, "tandem_requests_running") == 2


def test_prefix_cache_hits_and_queries_advance_by_difference() -> None:
    m = ServiceMetrics(model_name=MODEL)
    m.observe_stats(_stats(prefix_cache_hit_tokens=30, prefix_cache_queried_tokens=100))
    assert _value(m, "tandem_prefix_cache_hits_total") == 30
    assert _value(m, "tandem_prefix_cache_queries_total") == 100
    m.observe_stats(_stats(prefix_cache_hit_tokens=75, prefix_cache_queried_tokens=160))
    assert _value(m, "tandem_prefix_cache_hits_total") == 75
    assert _value(m, "tandem_prefix_cache_queries_total") == 160
    m.observe_stats(_stats(prefix_cache_hit_tokens=75, prefix_cache_queried_tokens=160))  # nothing new
    assert _value(m, "tandem_prefix_cache_hits_total") == 75
    assert _value(m, "tandem_prefix_cache_queries_total") == 160
    names = {s.name for s in _samples(m)}
    assert "tandem_prefix_cache_hit_rate" not in names  # the gauge is gone: rate(hits) / rate(queries)


def test_kv_cache_usage_ratio() -> None:
    m = ServiceMetrics(model_name=MODEL)
    m.observe_stats(_stats(kv_blocks_total=64, kv_blocks_used=16, kv_blocks_free=48))
    assert _value(m, "tandem_kv_cache_usage_ratio") == 0.25
    m.observe_stats(_stats(kv_blocks_total=64, kv_blocks_used=64, kv_blocks_free=0))
    assert _value(m, "tandem_kv_cache_usage_ratio") == 1.0
    m.observe_stats(_stats(kv_blocks_total=0, kv_blocks_used=0, kv_blocks_free=0))  # no pool: 0, not a division
    assert _value(m, "tandem_kv_cache_usage_ratio") == 0.0


def test_build_info_is_one_with_the_versions() -> None:
    m = ServiceMetrics(model_name=MODEL)
    [info] = [s for s in _samples(m) if s.name == "tandem_build_info"]
    assert info.value == 1
    assert info.labels == {
        "model_name": MODEL,
        "version": importlib.metadata.version("tandem"),
        "torch_version": importlib.metadata.version("torch"),
    }


def test_no_created_samples() -> None:
    m = _exercised()
    text = m.render().decode()
    assert "_created" not in text
    assert not [s.name for s in _samples(m) if s.name.endswith("_created")]
    # prometheus_client would have added them: render() drops them, the registry itself is left alone
    assert "tandem_requests_finished_created" in generate_latest(m.registry).decode()


def test_two_services_in_one_process_keep_their_own_series() -> None:
    a, b = ServiceMetrics(model_name="a"), ServiceMetrics(CollectorRegistry(), model_name="b")
    a.observe_error("INTERNAL")
    assert _value(a, "tandem_request_errors_total", model_name="a", code="INTERNAL") == 1
    assert not [s for s in _samples(b) if s.name == "tandem_request_errors_total"]
    assert {s.labels["model_name"] for s in _samples(b)} == {"b"}
