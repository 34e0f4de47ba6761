"""Speculative decoding through the service: `--speculative ngram`, the per-request override over gRPC and HTTP,
usage (drafts, kept drafts, steps) in each response, and the acceptance counters in /metrics.

A `logit_bias` that forces one token makes the output a loop that prompt lookup matches, so drafts are certain to
be proposed and kept on the tiny random model.
"""

from __future__ import annotations

import time

import grpc
import httpx2 as httpx
import pytest

from inference_svc.client import TandemClient
from tests.inference_svc.server.conftest import ServerThread, engine_config, make_server, metric_value, wait_idle

PROMPT = "def read(self, size=-1):\n    "
LOOP = {100: 100.0}


@pytest.fixture(scope="module")
def spec_server(bundle_dir) -> ServerThread:
    srv = make_server(
        bundle_dir,
        http_port=0,
        metrics_port=0,
        engine=engine_config(speculative="ngram", num_speculative_tokens=4, speculative_max_batch=0),
    )
    yield srv
    srv.close()


def test_grpc_usage_reports_drafts_and_output_is_unchanged(spec_server: ServerThread) -> None:
    with TandemClient(spec_server.target, timeout=60) as client:
        spec = client.generate(PROMPT, max_new_tokens=20, logit_bias=LOOP, ignore_eos=True)
        plain = client.generate(PROMPT, max_new_tokens=20, logit_bias=LOOP, ignore_eos=True, num_speculative_tokens=0)
        free = client.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
        free_plain = client.generate(PROMPT, max_new_tokens=20, ignore_eos=True, num_speculative_tokens=0)
        last = list(client.generate_stream(PROMPT, max_new_tokens=20, logit_bias=LOOP, ignore_eos=True))[-1]
    assert spec.token_ids == plain.token_ids and free.token_ids == free_plain.token_ids
    u = spec.usage
    assert u.completion_tokens == 20
    assert 0 < u.accepted_draft_tokens <= u.draft_tokens
    assert u.decode_steps == 20 - u.accepted_draft_tokens
    assert plain.usage.draft_tokens == 0 and plain.usage.decode_steps == 20
    assert last.usage is not None and last.usage.accepted_draft_tokens == u.accepted_draft_tokens


def test_bad_per_request_value_names_the_field(spec_server: ServerThread) -> None:
    with TandemClient(spec_server.target, timeout=60) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPT, max_new_tokens=4, num_speculative_tokens=17)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "num_speculative_tokens" in err.value.details()


def test_http_usage_uses_openais_prediction_fields_and_metrics_count(spec_server: ServerThread) -> None:
    base = f"http://127.0.0.1:{spec_server.server.http_port}"
    metrics = f"http://127.0.0.1:{spec_server.server.metrics_port}/metrics"
    before = httpx.get(metrics, timeout=30).text
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logit_bias": {"100": 100}, "ignore_eos": True}
    whole = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    details = whole["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert details["rejected_prediction_tokens"] >= 0
    off = httpx.post(f"{base}/v1/completions", json={**body, "num_speculative_tokens": 0}, timeout=60).json()
    assert off["choices"][0]["text"] == whole["choices"][0]["text"]
    assert "completion_tokens_details" not in off["usage"]
    bad = httpx.post(f"{base}/v1/completions", json={**body, "num_speculative_tokens": -1}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_speculative_tokens"
    after = httpx.get(metrics, timeout=30).text
    name = "tandem_spec_decode_accepted_tokens_total"
    assert metric_value(after, name) - metric_value(before, name) == details["accepted_prediction_tokens"]
    drafted = metric_value(after, "tandem_spec_decode_draft_tokens_total")
    assert drafted >= metric_value(after, name) > 0
    steps = metric_value(after, "tandem_spec_decode_verify_steps_total")
    assert metric_value(after, "tandem_spec_decode_emitted_tokens_total") > steps > 0


def test_cancel_and_deadline_during_speculation_free_every_block(bundle_dir) -> None:
    """Each increment of a 'slow-' request costs 0.3 s in the engine thread (a test-only hook), so 60 tokens at up
    to 5 per step take over 3 s whatever the machine: the 1 s deadline always lands mid-generation."""

    def slow(out) -> None:
        if out.request_id.startswith("slow-"):
            time.sleep(0.3)

    srv = make_server(bundle_dir, fault_hook=slow, engine=engine_config(speculative="ngram", speculative_max_batch=0))
    try:
        with TandemClient(srv.target, timeout=60) as client:
            stream = client.generate_stream(
                PROMPT, request_id="slow-cancel", max_new_tokens=60, logit_bias=LOOP, ignore_eos=True
            )
            got = [next(stream), next(stream)]
            stream.close()
            wait_idle(srv)
            with pytest.raises(grpc.RpcError) as err:
                client.generate(PROMPT, request_id="slow-deadline", max_new_tokens=60, logit_bias=LOOP,
                                ignore_eos=True, timeout=1.0)  # fmt: skip
            assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            stats = wait_idle(srv)
        assert sum(len(m.token_ids) for m in got) >= 2
        assert stats.spec_draft_tokens_total > 0 and stats.spec_verify_steps_total >= 2
    finally:
        srv.close()


def test_model_info_reports_the_draft_models_share_of_the_budget(bundle_dir) -> None:
    srv = make_server(bundle_dir, engine=engine_config(speculative=str(bundle_dir), kv_cache_memory="2MiB"))
    try:
        with TandemClient(srv.target, timeout=60) as client:
            info = client.model_info()
            r = client.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    finally:
        srv.close()
    led = info.ledger
    assert info.draft_model == bundle_dir.name
    assert led.draft_kv_bytes_per_block == led.kv_bytes_per_block  # the bundle drafts for itself: same sizes
    assert led.draft_kv_cache_bytes == led.kv_blocks_total * led.draft_kv_bytes_per_block
    assert led.kv_cache_bytes + led.draft_kv_cache_bytes <= 2 * 1024**2
    assert led.draft_weight_bytes == led.weight_bytes
    assert r.usage.accepted_draft_tokens > 0
