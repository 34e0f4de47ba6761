"""vLLM-compatible metrics (issue 36, goal 1): the `vllm:*` series a router built for vLLM reads, with vLLM's names,
types, label names and bucket edges, fed with the same figures as Tandem's own; `--metrics-names` chooses the
families.

`VLLM_TABLE` is transcribed from vLLM's documentation and source, not from Tandem's code:
- docs/usage/metrics.md and docs/design/metrics.md of vllm-project/vllm (the metric list and types);
- vllm/v1/metrics/loggers.py, `PrometheusStatLogger` (label names `model_name`/`engine`, bucket edges, the info
  gauges' label names);
- the Gateway API Inference Extension's model-server protocol
  (docs/proposals/003-model-server-protocol/README.md): the endpoint picker reads `vllm:num_requests_waiting`,
  `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, the `block_size`/`num_gpu_blocks` labels of
  `vllm:cache_config_info` and `vllm:lora_requests_info` (value: the last update's Unix time).

The server test scrapes a real server on a free loopback port; every wait is bounded and none asserts a duration.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference_svc.cli import build_serve_config
from inference_svc.engine import EngineStats
from inference_svc.engine.types import Timing
from inference_svc.executor.plan import LoadPlan
from inference_svc.metrics import ServiceMetrics
from inference_svc.settings import ScaleOutSettings, SettingsError
from tests.inference_svc.server.conftest import engine_config, make_server

MODEL = "tiny-coder"
ENGINE_LABELS = {"model_name", "engine"}

TTFT_EDGES = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
              80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_EDGES = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_EDGES = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
VLLM_TABLE: dict[str, tuple[str, set[str], tuple[float, ...] | None]] = {
    "vllm:num_requests_running": ("gauge", ENGINE_LABELS, None),
    "vllm:num_requests_waiting": ("gauge", ENGINE_LABELS, None),
    "vllm:kv_cache_usage_perc": ("gauge", ENGINE_LABELS, None),
    "vllm:gpu_cache_usage_perc": ("gauge", ENGINE_LABELS, None),  # deprecated in vLLM 0.9; older pickers read it
    "vllm:prefix_cache_queries": ("counter", ENGINE_LABELS, None),
    "vllm:prefix_cache_hits": ("counter", ENGINE_LABELS, None),
    "vllm:prompt_tokens": ("counter", ENGINE_LABELS, None),
    "vllm:generation_tokens": ("counter", ENGINE_LABELS, None),
    "vllm:num_preemptions": ("counter", ENGINE_LABELS, None),
    "vllm:request_success": ("counter", ENGINE_LABELS | {"finished_reason"}, None),
    "vllm:time_to_first_token_seconds": ("histogram", ENGINE_LABELS, TTFT_EDGES),
    "vllm:inter_token_latency_seconds": ("histogram", ENGINE_LABELS, ITL_EDGES),
    "vllm:e2e_request_latency_seconds": ("histogram", ENGINE_LABELS, REQUEST_EDGES),
    "vllm:request_queue_time_seconds": ("histogram", ENGINE_LABELS, REQUEST_EDGES),
    "vllm:cache_config_info": (
        "gauge",
        {"engine", "block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"},
        None,
    ),
    "vllm:lora_requests_info": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}, None),
}
"""family → (type, label names of each sample besides `le`, bucket edges or None)"""
ENDPOINT_PICKER_READS = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def _stats(**overrides: float) -> EngineStats:
    base = dict(
        num_running=2, num_waiting=1, kv_blocks_total=64, kv_blocks_used=16, kv_blocks_free=48, kv_blocks_cached=4,
        prefix_cache_hit_tokens=0, prefix_cache_queried_tokens=0, num_preemptions=0, prompt_tokens_total=0,
        generation_tokens_total=0, cached_prompt_tokens_total=0,
    )  # fmt: skip
    return EngineStats(**{**base, **overrides})


def _info() -> SimpleNamespace:
    return SimpleNamespace(
        dtype="float32", quantization="none", weight_bytes=1, kv_cache_dtype="float32", kv_cache_bytes=2,
        kv_bytes_per_token=3, compile_seconds=0.0, kv_blocks_total=64,
        config=SimpleNamespace(block_size=16, enable_prefix_caching=True), load_plan=LoadPlan(),
    )  # fmt: skip


def _exercised(names: str = "both") -> ServiceMetrics:
    m = ServiceMetrics(model_name=MODEL, names=names)
    m.observe_model(_info())
    m.observe_stats(_stats(prefix_cache_hit_tokens=32, prefix_cache_queried_tokens=100, prompt_tokens_total=100))
    m.observe_finished("length", Timing(queue_ms=1.0, ttft_ms=20.0, tpot_ms=5.0, total_ms=600.0))
    m.observe_finished("cancelled", Timing(queue_ms=1.0, ttft_ms=30.0, tpot_ms=5.0, total_ms=900.0))
    m.observe_inter_token(0.004)
    return m


def _families(text: str | bytes) -> dict:
    body = text.decode() if isinstance(text, bytes) else text
    return {f.name: f for f in text_string_to_metric_families(body)}


def _value(families: dict, family: str, sample: str, **labels: str) -> float:
    found = [s.value for s in families[family].samples if s.name == sample and labels.items() <= s.labels.items()]
    assert len(found) == 1, f"{len(found)} samples {sample}{labels}"
    return found[0]


def _check_table(families: dict, model_name: str) -> None:
    """Every row of VLLM_TABLE: present, of its type, with exactly its label names and (histograms) bucket edges."""
    for name, (kind, label_names, buckets) in VLLM_TABLE.items():
        assert name in families, f"{name} missing"
        family = families[name]
        assert family.type == kind, f"{name}: {family.type} != {kind}"
        assert family.samples, f"{name} has no series"
        for s in family.samples:
            assert set(s.labels) - {"le"} == label_names, f"{name}: labels {sorted(s.labels)}"
            if "model_name" in label_names:
                assert s.labels["model_name"] == model_name and s.labels["engine"] == "0", s
        if buckets is not None:
            edges = [float(s.labels["le"]) for s in family.samples if s.name == name + "_bucket"]
            assert edges == [*buckets, float("inf")], f"{name}: bucket edges {edges}"


def test_vllm_names_types_labels_and_buckets_match_vllms_table() -> None:
    m = _exercised()
    families = _families(m.render())
    _check_table(families, MODEL)
    # the figures are the same quantities as Tandem's
    assert _value(families, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0.25  # 16 of 64 blocks
    assert _value(families, "vllm:gpu_cache_usage_perc", "vllm:gpu_cache_usage_perc") == 0.25
    assert _value(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 32
    assert _value(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 100
    assert _value(families, "vllm:num_requests_running", "vllm:num_requests_running") == 2
    assert _value(families, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 1
    ttft = "vllm:time_to_first_token_seconds"
    assert _value(families, ttft, ttft + "_count") == 2
    assert _value(families, ttft, ttft + "_sum") == pytest.approx(0.050)
    assert _value(families, ttft, ttft + "_bucket", le="0.02") == 1  # 20 ms lands at its edge, 30 ms above
    e2e = "vllm:e2e_request_latency_seconds"
    assert (
        _value(families, e2e, e2e + "_bucket", le="0.8") == 1 and _value(families, e2e, e2e + "_bucket", le="1.0") == 2
    )
    itl = "vllm:inter_token_latency_seconds"
    assert _value(families, itl, itl + "_bucket", le="0.01") == 1
    success = "vllm:request_success"
    assert _value(families, success, success + "_total", finished_reason="length") == 1
    assert _value(families, success, success + "_total", finished_reason="abort") == 1
    assert _value(families, success, success + "_total", finished_reason="stop") == 0
    info = families["vllm:cache_config_info"].samples
    assert [(s.labels["block_size"], s.labels["num_gpu_blocks"], s.value) for s in info] == [("16", "64", 1.0)]
    [lora] = families["vllm:lora_requests_info"].samples
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(lora.value - time.time()) < 3600  # a Unix time (the endpoint picker takes the newest), not a count


def test_counters_advance_by_difference_and_never_go_back() -> None:
    m = ServiceMetrics(model_name=MODEL)
    m.observe_stats(_stats(prefix_cache_hit_tokens=16, prefix_cache_queried_tokens=40))
    m.observe_stats(_stats(prefix_cache_hit_tokens=48, prefix_cache_queried_tokens=90))
    m.observe_stats(_stats(prefix_cache_hit_tokens=48, prefix_cache_queried_tokens=90))
    families = _families(m.render())
    assert _value(families, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 48
    assert _value(families, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 90


@pytest.mark.parametrize(
    ("names", "has_tandem", "has_vllm"), [("both", True, True), ("tandem", True, False), ("vllm", False, True)]
)
def test_metrics_names_choose_the_families(names: str, has_tandem: bool, has_vllm: bool) -> None:
    families = _families(_exercised(names).render())
    assert any(n.startswith("tandem_") for n in families) == has_tandem
    assert any(n.startswith("vllm:") for n in families) == has_vllm
    if has_vllm:
        _check_table(families, MODEL)


def test_metrics_names_flag_is_validated(tmp_path: Path) -> None:
    settings, _, _ = build_serve_config(["--model", str(tmp_path), "--metrics-names", "vllm"])
    assert settings.scale_out.metrics_names == "vllm"
    assert build_serve_config(["--model", str(tmp_path)])[0].scale_out.metrics_names == "both"
    with pytest.raises(SystemExit):
        build_serve_config(["--model", str(tmp_path), "--metrics-names", "prometheus"])
    with pytest.raises(SettingsError, match="metrics_names"):
        ScaleOutSettings(metrics_names="all")
    with pytest.raises(ValueError, match="metrics names"):
        ServiceMetrics(names="all")


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return _families(r.read())


def test_a_real_servers_vllm_metrics_move_with_its_work(bundle_dir: Path) -> None:
    """Scrape a real server: KV usage and running > 0 while a stream is held mid-decode, prefix hits after a repeated
    prompt equal to Tandem's own counter, histograms counting each finished request, the endpoint picker's names."""
    held, release = threading.Event(), threading.Event()
    increments: dict[str, int] = {}

    def hold_third_increment(out) -> None:  # runs on the engine thread, after the step's stats were published
        n = increments[out.request_id] = increments.get(out.request_id, 0) + 1
        if out.request_id == "held" and n == 3:
            held.set()
            release.wait(60)

    srv = make_server(bundle_dir, metrics_port=0, engine=engine_config(block_size=4), fault_hook=hold_third_increment)
    try:
        port = srv.server.metrics_port
        assert port
        info = srv.server.engine.info
        idle = _scrape(port)
        _check_table(idle, "bundle")
        for name in ENDPOINT_PICKER_READS:
            assert _value(idle, name, name) == 0
        [cache] = idle["vllm:cache_config_info"].samples
        assert cache.labels["block_size"] == "4" and cache.labels["num_gpu_blocks"] == str(info.kv_blocks_total)

        prompt = list(range(5, 5 + 30))  # 7 whole blocks of 4 before the last token
        with srv.client(timeout=60) as c:
            chunks: list = []
            reader = threading.Thread(
                target=lambda: chunks.extend(
                    c.generate_stream(prompt, request_id="held", max_new_tokens=8, ignore_eos=True)
                )
            )
            reader.start()
            try:
                assert held.wait(60), "the stream never reached its third increment"
                busy = _scrape(port)
                assert _value(busy, "vllm:num_requests_running", "vllm:num_requests_running") == 1
                usage = _value(busy, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc")
                assert 0 < usage <= 1
                st = srv.server.engine.engine.stats()
                assert usage == pytest.approx(st.kv_blocks_used / st.kv_blocks_total)
            finally:
                release.set()
                reader.join(60)
            assert chunks and chunks[-1].finish_reason
            before = _scrape(port)
            hits_before = _value(before, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
            c.generate(prompt, request_id="again", max_new_tokens=2, ignore_eos=True)
        after = _scrape(port)
        hits = _value(after, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
        assert hits - hits_before == 28  # the 7 whole blocks of the repeated prompt, counted in tokens
        assert hits == _value(after, "tandem_prefix_cache_hits", "tandem_prefix_cache_hits_total")
        queries = _value(after, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
        assert queries == _value(after, "tandem_prefix_cache_queries", "tandem_prefix_cache_queries_total") > 0
        for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
            assert _value(after, name, name + "_count") == _value(before, name, name + "_count") + 1
        itl = "vllm:inter_token_latency_seconds"
        tandem_itl = _value(after, "tandem_inter_token_latency_seconds", "tandem_inter_token_latency_seconds_count")
        assert _value(after, itl, itl + "_count") == tandem_itl > 0
        assert _value(after, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0  # all freed (cached)
    finally:
        release.set()
        srv.close()
