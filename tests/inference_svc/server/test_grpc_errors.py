"""The error contract, each case against a real server over a real channel: INVALID_ARGUMENT naming the field,
RESOURCE_EXHAUSTED with nothing half-admitted, INTERNAL for one request while the server stays SERVING."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from inference_svc.client import NO_RETRY
from inference_svc.client_results import GenerateResult
from inference_svc.engine.types import FinishReason, RequestOutput
from inference_svc.proto_gen import inference_pb2 as pb
from inference_svc.settings import AdmissionLimits
from tests.inference_svc.server.conftest import MAX_CONTEXT, MAX_NEW_TOKENS_LIMIT, ServerThread, make_server, wait_idle

PROMPT = "import os\nimport sys\n"


def _code(fn, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = fn(*args, **kwargs)
        if not hasattr(result, "request_id"):  # a stream: iterate it
            list(result)
    return info.value.code(), info.value.details()


@pytest.mark.parametrize(
    ("prompt", "sampling", "field"),
    [
        ("", {}, "prompt"),
        ([], {}, "prompt_token_ids"),
        ("x " * (MAX_CONTEXT + 10), {}, "prompt"),
        ([5, 512, 7], {}, "prompt_token_ids"),
        ([5, 10**6], {}, "prompt_token_ids"),
        (PROMPT, {"max_new_tokens": 0}, "max_new_tokens"),
        (PROMPT, {"max_new_tokens": -3}, "max_new_tokens"),
        (PROMPT, {"max_new_tokens": MAX_NEW_TOKENS_LIMIT + 1}, "max_new_tokens"),
        (PROMPT, {"temperature": -0.5}, "temperature"),
        (PROMPT, {"top_p": 0.0}, "top_p"),
        (PROMPT, {"top_p": 1.5}, "top_p"),
        (PROMPT, {"top_k": -1}, "top_k"),
        (PROMPT, {"min_p": 2.0}, "min_p"),
        (PROMPT, {"repetition_penalty": 0.0}, "repetition_penalty"),
        (PROMPT, {"stop": ["s"] * 17}, "stop"),
        (PROMPT, {"stop": ["y" * 257]}, "stop"),
        (PROMPT, {"stop_token_ids": [9999]}, "stop_token_ids"),
    ],
)
@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
def test_invalid_argument_names_the_field(client, prompt, sampling, field, streaming) -> None:
    fn = client.generate_stream if streaming else client.generate
    code, details = _code(fn, prompt, **sampling)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(f"{field}:"), details


def test_no_prompt_at_all(client) -> None:
    code, details = _code(client.stub.Generate, pb.GenerateRequest(), timeout=10)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("prompt:")


def test_request_above_size_limit(client) -> None:
    # the module server allows 4096-byte requests; this one is ~6 KB (under the 16 KB transport limit)
    code, details = _code(client.generate, "word " * 1200, max_new_tokens=2)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request:"), details
    code, details = _code(client.tokenize, "word " * 1200)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request:"), details


def test_duplicate_request_id_in_flight(client, slow_steps) -> None:
    stream = client.generate_stream(PROMPT, request_id="slow-dup", max_new_tokens=40, ignore_eos=True)
    next(stream)
    code, details = _code(client.generate, PROMPT, request_id="slow-dup", max_new_tokens=2)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id:")
    stream.close()


def test_server_ok_after_errors(client, server: ServerThread) -> None:
    assert client.health() == "SERVING"
    assert len(client.generate(PROMPT, max_new_tokens=3, ignore_eos=True).token_ids) == 3
    wait_idle(server)


# ------------------------------------------------------------------------------ RESOURCE_EXHAUSTED
@pytest.fixture
def small_queue_server(bundle_dir) -> Iterator[ServerThread]:
    srv = make_server(bundle_dir, admission=AdmissionLimits(max_queued_requests=2, max_queued_tokens=60))
    yield srv
    srv.close()


def _stall_engine(server: ServerThread) -> threading.Event:
    """Park the engine thread (between steps) until the returned event is set: requests stay queued."""
    release = threading.Event()
    entered = threading.Event()

    def park() -> None:
        entered.set()
        release.wait(30)

    assert server.server.engine is not None
    server.submit(server.server.engine.run_in_engine(park))
    assert entered.wait(10)
    return release


def test_queue_full_by_requests_and_tokens(small_queue_server: ServerThread, small_tokenizer) -> None:
    srv = small_queue_server
    before = srv.stats().prompt_tokens_total
    release = _stall_engine(srv)
    results: dict[str, object] = {}

    def run(name: str, prompt: str) -> None:
        with srv.client(retry=NO_RETRY, timeout=60) as c:
            try:
                results[name] = c.generate(prompt, max_new_tokens=3, ignore_eos=True)
            except grpc.RpcError as exc:
                results[name] = exc.code()

    short = "abc def"
    n_short = len(small_tokenizer.encode(short))
    threads = [threading.Thread(target=run, args=(f"q{i}", short)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while srv.server.engine is not None and srv.server.engine.num_in_flight < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with srv.client(retry=NO_RETRY, timeout=10) as c:
        code, details = _code(c.generate, short, max_new_tokens=3)  # a third request: over the request limit
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in details
        code, _ = _code(c.generate_stream, short, max_new_tokens=3)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    release.set()
    for t in threads:
        t.join(30)
    assert all(isinstance(results[f"q{i}"], GenerateResult) for i in range(2)), results
    # nothing half-admitted: the engine saw exactly the two admitted prompts
    assert srv.stats().prompt_tokens_total - before == 2 * n_short

    # by tokens: one queued request of n tokens + one of 60 - n + 1 tokens exceeds 60
    release = _stall_engine(srv)
    t = threading.Thread(target=run, args=("t0", short))
    t.start()
    deadline = time.monotonic() + 10
    while srv.server.engine is not None and srv.server.engine.num_in_flight < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with srv.client(retry=NO_RETRY, timeout=10) as c:
        code, details = _code(c.generate, [5] * (60 - n_short + 1), max_new_tokens=3)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "prompt tokens" in details
        # a prompt that can never fit the token queue is a request error, not a capacity one
        code, details = _code(c.generate, [5] * 61, max_new_tokens=3)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("prompt:")
    release.set()
    t.join(30)
    assert isinstance(results["t0"], GenerateResult)
    wait_idle(srv)


def test_client_retries_resource_exhausted(small_queue_server: ServerThread) -> None:
    srv = small_queue_server
    release = _stall_engine(srv)
    holders = [threading.Thread(target=lambda: srv.client().generate("abc", max_new_tokens=2)) for _ in range(2)]
    for t in holders:
        t.start()
    deadline = time.monotonic() + 10
    while srv.server.engine is not None and srv.server.engine.num_in_flight < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    threading.Timer(0.3, release.set).start()  # capacity comes back while the client backs off
    with srv.client(timeout=30) as c:
        r = c.generate("abc", max_new_tokens=2, ignore_eos=True)
    assert len(r.token_ids) == 2
    for t in holders:
        t.join(30)


# ------------------------------------------------------------------------------ INTERNAL
def _fail_marked_requests(out: RequestOutput) -> None:
    """Test-only fault hook: a real exception raised while serving requests whose id starts with 'fault-'."""
    if out.request_id.startswith("fault-") and out.usage.completion_tokens >= 2:
        raise RuntimeError("injected fault")


def test_internal_failure_is_confined_to_one_request(bundle_dir) -> None:
    srv = make_server(bundle_dir, fault_hook=_fail_marked_requests)
    try:
        with srv.client(retry=NO_RETRY, timeout=60) as c:
            healthy = c.generate_stream(PROMPT, request_id="ok-1", max_new_tokens=30, ignore_eos=True)
            first = next(healthy)
            code, details = _code(c.generate, PROMPT, request_id="fault-1", max_new_tokens=30, ignore_eos=True)
            assert code == grpc.StatusCode.INTERNAL
            assert "injected" not in details  # internals go to the log, not to the client
            code, _ = _code(c.generate_stream, PROMPT, request_id="fault-2", max_new_tokens=30, ignore_eos=True)
            assert code == grpc.StatusCode.INTERNAL
            rest = list(healthy)
            assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 30
            assert rest[-1].finish_reason is FinishReason.LENGTH
            assert c.health() == "SERVING"
            assert len(c.generate(PROMPT, request_id="ok-2", max_new_tokens=4, ignore_eos=True).token_ids) == 4
        wait_idle(srv)
    finally:
        srv.close()
