"""Every RPC against a real server on a free loopback port: Generate, GenerateStream, Tokenize, GetModelInfo, health,
the async client, /metrics, and `tandem generate`."""

from __future__ import annotations

import asyncio
import contextlib
import io
import urllib.request

from inference_svc import tokenizer_jobs
from inference_svc.client import AsyncTandemClient
from inference_svc.client_results import GenerateResult, StreamChunk
from inference_svc.engine.types import FinishReason
from inference_svc.generate_cli import generate_main, stream_completion
from inference_svc.proto_gen import inference_pb2 as pb
from shared_model.tokenizer import Tokenizer
from tests.inference_svc.server.conftest import MAX_CONTEXT, MAX_NEW_TOKENS_LIMIT, make_server, metric_value

PROMPT = "def parse(self, text):\n    return"


def test_generate_unary(client) -> None:
    r = client.generate(PROMPT, max_new_tokens=12, ignore_eos=True, request_id="unary-1")
    assert r.request_id == "unary-1"
    assert len(r.token_ids) == 12
    assert r.finish_reason is FinishReason.LENGTH
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 0
    assert r.timing.total_ms >= r.timing.ttft_ms >= r.timing.queue_ms >= 0
    assert r.timing.tpot_ms > 0


def test_stream_deltas_concatenate_to_unary(client, small_tokenizer: Tokenizer) -> None:
    unary = client.generate(PROMPT, max_new_tokens=20)
    msgs = list(client.generate_stream(PROMPT, max_new_tokens=20))
    assert "".join(m.text for m in msgs) == unary.text
    assert [t for m in msgs for t in m.token_ids] == list(unary.token_ids)
    assert unary.text == small_tokenizer.decode(list(unary.token_ids), skip_special_tokens=True)
    *body, last = msgs
    assert all(m.finish_reason is None and m.usage is None for m in body)
    assert last.finish_reason is unary.finish_reason is not None
    assert last.usage is not None and last.timing is not None
    assert last.usage.completion_tokens == len(unary.token_ids)


def test_token_id_prompt_equals_text_prompt(client, small_tokenizer: Tokenizer) -> None:
    ids = small_tokenizer.encode(PROMPT)
    by_text = client.generate(PROMPT, max_new_tokens=8)
    by_ids = client.generate(ids, max_new_tokens=8)
    assert list(by_ids.token_ids) == list(by_text.token_ids)
    assert by_ids.usage.prompt_tokens == len(ids)


def test_logprobs_and_stop_string(client) -> None:
    r = client.generate(PROMPT, max_new_tokens=8, ignore_eos=True, logprobs=True)
    assert len(r.logprobs) == len(r.token_ids) and all(lp <= 0 for lp in r.logprobs)
    stop = r.text[2:5]
    if stop:
        stopped = client.generate(PROMPT, max_new_tokens=8, ignore_eos=True, stop=[stop])
        assert stopped.finish_reason is FinishReason.STOP
        assert stop not in stopped.text and r.text.startswith(stopped.text)


def test_seeded_sampling_is_reproducible(client) -> None:
    a = client.generate(PROMPT, max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    b = client.generate(PROMPT, max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    assert list(a.token_ids) == list(b.token_ids)


def test_tokenize_response_in_pieces_is_one_message(small_tokenizer: Tokenizer) -> None:
    """A Tokenize response is serialized in pieces (bounded GIL holds); the pieces parse as one whole message."""
    text = "hello world, tokenized in pieces of three tokens each"
    ids = small_tokenizer.encode(text, add_bos=True)
    assert len(ids) > 7 and len(ids) % 3  # several pieces and a short last one
    raw = tokenizer_jobs.tokenize_response(small_tokenizer, text, True, chunk_tokens=3)
    r = pb.TokenizeResponse.FromString(raw)
    assert list(r.token_ids) == ids
    assert list(r.tokens) == [small_tokenizer.id_to_token(i) for i in ids]
    assert len(raw) > len(r.SerializeToString())  # each piece repeats the packed field's tag and length


def test_tokenize(client, small_tokenizer: Tokenizer) -> None:
    r = client.tokenize("hello world")
    assert list(r.token_ids) == small_tokenizer.encode("hello world")
    assert list(r.tokens) == [small_tokenizer.id_to_token(i) for i in r.token_ids]
    with_bos = client.tokenize("hello world", add_bos=True)
    assert with_bos.token_ids[0] == small_tokenizer.bos_id


def test_model_info(client) -> None:
    info = client.model_info()
    assert info.config.model_type == "qwen3" and info.config.vocab_size == 512 and info.config.num_layers == 2
    assert info.max_context == MAX_CONTEXT
    assert info.max_new_tokens_limit == MAX_NEW_TOKENS_LIMIT
    assert info.dtype == "float32" and info.attention_backend == "torch" and info.device == "cpu"
    assert info.kv_capacity_tokens == info.ledger.kv_capacity_tokens > 0
    # the ledger's 2·N·d·b per token: 2 layers × 2 kv heads × 16 × 4 bytes × (K and V)
    assert info.ledger.kv_bytes_per_token == 2 * 2 * 32 * 4
    assert info.ledger.kv_cache_bytes == info.ledger.kv_blocks_total * 16 * info.ledger.kv_bytes_per_token
    # every parameter in fp32, with each layer's q_norm and k_norm (2 × 16) replaced by the merged q/k-norm table:
    # 2 layers × (4 + 2 - 2) heads × 16 × 4 bytes more
    assert info.ledger.weight_bytes == info.config.num_parameters * 4 + 2 * 4 * 16 * 4
    assert info.quantization == "none"
    assert info.ledger.extra["ledger.weight_bytes"] == info.ledger.weight_bytes
    assert '"qk_norm": true' in info.config.config_json


def test_health_serving(client) -> None:
    assert client.health() == "SERVING"
    assert client.health("tandem.inference.v1.Inference") == "SERVING"


def test_async_client(server) -> None:
    async def main() -> tuple[GenerateResult, list[StreamChunk], str]:
        async with AsyncTandemClient(server.target, timeout=60) as c:
            unary = await c.generate(PROMPT, max_new_tokens=6)
            msgs = [m async for m in c.generate_stream(PROMPT, max_new_tokens=6)]
            return unary, msgs, await c.health()

    unary, msgs, health = asyncio.run(main())
    assert "".join(m.text for m in msgs) == unary.text
    assert health == "SERVING"


def test_generate_cli(server, capsys) -> None:
    rc = generate_main(["--target", server.target, PROMPT, "--max-new-tokens", "5", "--ignore-eos"])
    _out, err = capsys.readouterr()
    assert rc == 0
    assert "TTFT" in err and "time per output token" in err and "completion 5 tokens" in err
    figures = stream_completion(server.target, PROMPT, out=io.StringIO(), err=io.StringIO(), max_new_tokens=5)
    assert figures["ttft_ms"] > 0 and figures["completion_tokens"] <= 5


def test_generate_cli_reports_status(server, capsys) -> None:
    assert generate_main(["--target", server.target, PROMPT, "--temperature", "-1"]) == 1
    assert "INVALID_ARGUMENT: temperature" in capsys.readouterr().err


def test_metrics_endpoint(bundle_dir) -> None:
    srv = make_server(bundle_dir, metrics_port=0)
    try:
        with srv.client() as c:
            c.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
            list(c.generate_stream(PROMPT, max_new_tokens=4, ignore_eos=True))
            with contextlib.suppress(Exception):
                c.generate(PROMPT, max_new_tokens=0)
        url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"
        # an error the server answers is counted before its status is sent: one scrape after the call sees it
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for name in (
            "tandem_time_to_first_token_seconds_bucket",
            "tandem_time_per_output_token_seconds_count",
            "tandem_inter_token_latency_seconds_count",
            "tandem_e2e_request_latency_seconds_count",
            "tandem_request_queue_time_seconds_count",
            "tandem_requests_running",
            "tandem_requests_waiting",
            "tandem_kv_blocks_used",
            "tandem_kv_blocks_total",
            "tandem_kv_blocks_cached",
            "tandem_prefix_cache_hits_total",
            "tandem_prefix_cache_queries_total",
            "tandem_kv_cache_usage_ratio",
            "tandem_build_info",
            "tandem_preemptions_total",
        ):
            assert name in text, name
        assert "_created" not in text

        def value(name: str, **labels: str) -> float:
            return metric_value(text, name, model_name="bundle", **labels)

        assert value("tandem_requests_finished_total", finish_reason="length") == 2
        assert value("tandem_request_errors_total", code="INVALID_ARGUMENT") == 1
        assert value("tandem_generation_tokens_total") >= 8
        assert value("tandem_prompt_tokens_total") > 0
        assert value("tandem_e2e_request_latency_seconds_count") == 2
        assert value("tandem_kv_blocks_total") > 0
    finally:
        srv.close()
