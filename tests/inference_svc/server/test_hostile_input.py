"""Hostile input against a real server on a free loopback port (issue 15, server side):

- malformed protobuf (garbage, invalid UTF-8 in `prompt`, a truncated length prefix) gets INVALID_ARGUMENT
  "malformed request: ..." with no parser internals, is counted in `tandem_request_errors`, and writes at most one
  log line per call (rate-limited, never a traceback);
- with API keys on, an unauthenticated client sending garbage gets UNAUTHENTICATED (the key is checked first);
- two `authorization` headers are ambiguous: UNAUTHENTICATED saying so, even when both carry a valid key;
- `GetModelInfo.model_name` is the folder's name, not the server's absolute path;
- every client cancel of a stream is counted exactly once as CANCELLED.

Raw bytes go through `channel.unary_unary(method)` / `unary_stream(method)` with no serializer.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inference_svc.client import NO_RETRY
from inference_svc.errors import MalformedRequestError
from inference_svc.grpc_service.auth import ApiKeyInterceptor
from inference_svc.grpc_service.wire_guard import MalformedLog
from inference_svc.proto_gen import inference_pb2 as pb
from inference_svc.proto_gen import inference_pb2_grpc as pb_grpc
from tests.inference_svc.server.conftest import MAX_NEW_TOKENS_LIMIT, ServerThread, make_server, metric_value

KEY = "tk-hostile-0123456789"
SERVICE = "/tandem.inference.v1.Inference/"

# GenerateRequest.prompt is field 2 (a string): tag 0x12, then a length prefix, then the bytes
BAD_UTF8_PROMPT = b"\x12\x02\xc3\x28"
TRUNCATED_PREFIX = b"\x12\x50abc"  # says 80 bytes follow, 3 do
GARBAGE = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"
PAYLOADS = {"garbage": GARBAGE, "bad-utf8-prompt": BAD_UTF8_PROMPT, "truncated-length-prefix": TRUNCATED_PREFIX}
INTERNALS = ("Traceback", "DecodeError", "Error parsing", "google.protobuf", "Unexpected", "<class", 'File "', ".py")


def _errors(srv: ServerThread, code: str) -> float:
    """tandem_request_errors_total{code=CODE} from the server's own exposition text. An error the server answers is
    counted before its status is sent, so once a call has its error this counts it: no wait, exact."""
    return metric_value(srv.server.metrics.render(), "tandem_request_errors_total", code=code)


def _wait_for_errors(srv: ServerThread, code: str, at_least: float, timeout: float = 30.0) -> float:
    """Poll the counter until it reaches `at_least` (bounded), then return it: for outcomes the server learns after
    its client (a client's cancel is counted when the server sees the call end)."""
    deadline = time.monotonic() + timeout
    while (value := _errors(srv, code)) < at_least and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def _raw_call(target: str, method: str, payload: bytes, *, streaming: bool, metadata=None) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel:
        if streaming:
            call = channel.unary_stream(SERVICE + method)
            with pytest.raises(grpc.RpcError) as info:
                list(call(payload, timeout=30, metadata=metadata))
        else:
            call = channel.unary_unary(SERVICE + method)
            with pytest.raises(grpc.RpcError) as info:
                call(payload, timeout=30, metadata=metadata)
    return info.value


@pytest.fixture(scope="module")
def keyed_server(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    keys = tmp_path_factory.mktemp("hostile-keys") / "api-keys"
    keys.write_text(f"{KEY}\n")
    srv = make_server(bundle_dir, api_key_file=str(keys))
    yield srv
    srv.close()


# ------------------------------------------------------------------------------ malformed protobuf
CASES = [
    *[("Generate", False, name) for name in PAYLOADS],
    *[("GenerateStream", True, name) for name in PAYLOADS],
    ("Tokenize", False, "garbage"),
    ("Tokenize", False, "truncated-length-prefix"),
    ("Tokenize", False, "bad-utf8-text"),
    ("GetModelInfo", False, "garbage"),
    ("GetModelInfo", False, "truncated-length-prefix"),
]


@pytest.mark.parametrize(("method", "streaming", "payload_name"), CASES)
def test_malformed_request_is_invalid_argument(server: ServerThread, method, streaming, payload_name, caplog) -> None:
    payload = b"\x0a\x02\xc3\x28" if payload_name == "bad-utf8-text" else PAYLOADS[payload_name]  # text = 1
    caplog.set_level(logging.DEBUG)
    before = _errors(server, "INVALID_ARGUMENT")
    err = _raw_call(server.target, method, payload, streaming=streaming)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    details = err.details() or ""
    assert details.startswith("malformed request: "), details
    assert not any(s in details for s in INTERNALS), details
    assert _errors(server, "INVALID_ARGUMENT") == before + 1
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(noisy) <= 1, [r.getMessage() for r in noisy]
    assert all(r.exc_info is None and r.levelno < logging.ERROR for r in noisy)


def test_oversized_request_is_refused_by_its_byte_count_unparsed(server: ServerThread, caplog) -> None:
    """More bytes than max_request_bytes (4096 here) are refused as `request:` before parsing: garbage that would
    be "malformed" if parsed gets the size answer, and no malformed-request log line."""
    caplog.set_level(logging.DEBUG)
    oversized_garbage = GARBAGE * 500  # 5,500 bytes
    for method, streaming in (("Generate", False), ("GenerateStream", True), ("Tokenize", False)):
        err = _raw_call(server.target, method, oversized_garbage, streaming=streaming)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert (err.details() or "").startswith("request: the request is 5500 bytes; the limit is 4096"), err
    assert not [r for r in caplog.records if "malformed" in r.getMessage()]


def test_bad_utf8_is_named_as_such(server: ServerThread) -> None:
    err = _raw_call(server.target, "Generate", BAD_UTF8_PROMPT, streaming=False)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in (err.details() or "")


def test_malformed_log_is_rate_limited(server: ServerThread, caplog, monkeypatch) -> None:
    """A flood of malformed calls writes one WARNING line (within the rate limit), with no traceback, and every call
    is counted by the time its client has the error (the count once failed here, 27 for 26, when it came from the
    RPC's done-callback: the previous test's call was counted after this one read `before`)."""
    caplog.set_level(logging.DEBUG)
    # the server's limiter on a stopped clock: every call falls in one window, however slow the machine
    monkeypatch.setattr(server.server, "malformed_log", MalformedLog(interval=10.0, clock=lambda: 0.0))
    n = 12
    before = _errors(server, "INVALID_ARGUMENT")
    for i in range(n):
        payload = list(PAYLOADS.values())[i % len(PAYLOADS)]
        assert _raw_call(server.target, "Generate", payload, streaming=False).code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _errors(server, "INVALID_ARGUMENT") == before + i + 1
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].exc_info is None and "malformed request" in lines[0].getMessage()
    assert "\n" not in lines[0].getMessage()


def test_malformed_log_window_follows_its_clock(caplog) -> None:
    """One line per `interval` of the limiter's clock: calls less than `interval` after the last line are counted
    and named by the next line, the one at `interval` or later."""
    caplog.set_level(logging.DEBUG)
    now = [100.0]
    limiter = MalformedLog(interval=10.0, clock=lambda: now[0])
    error = MalformedRequestError("GenerateRequest", "truncated")
    for t in (100.0, 101.0, 109.999, 110.0, 110.0, 125.0, 134.9):
        now[0] = t
        limiter.note("ipv4:127.0.0.1:1", error)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 3, lines
    assert "more since" not in lines[0]
    assert lines[1].endswith("(2 more since the last such line)")  # 101 and 109.999
    assert lines[2].endswith("(1 more since the last such line)")  # the second call at 110; 134.9 is still quiet
    assert all("truncated" in line and "ipv4:127.0.0.1:1" in line for line in lines)


def test_an_answered_error_is_counted_before_the_answer_leaves(server: ServerThread, monkeypatch) -> None:
    """The record of an error the server answers ends before the status is sent. Checked in the order itself:
    while the record ends, the server waits (bounded) for the client to say it has the answer; it cannot have it
    yet. (Ended from the RPC's done-callback instead, the status has left and the client's answer comes.)"""
    access_log = server.server.access_log
    answered = threading.Event()
    client_had_it: list[bool] = []
    finish = access_log.finish

    def finish_after_looking(record) -> None:
        if record.failed and not record.finished:
            client_had_it.append(answered.wait(1.0))
        finish(record)

    monkeypatch.setattr(access_log, "finish", finish_after_looking)
    for method, streaming in (("Generate", False), ("GenerateStream", True), ("Tokenize", False)):
        answered.clear()
        err = _raw_call(server.target, method, GARBAGE, streaming=streaming)
        answered.set()
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert client_had_it == [False, False, False]


def test_server_still_serves_after_malformed_requests(server: ServerThread) -> None:
    for payload in PAYLOADS.values():
        _raw_call(server.target, "GenerateStream", payload, streaming=True)
    with server.client(timeout=60) as c:
        assert len(c.generate("hello", max_new_tokens=3, ignore_eos=True).token_ids) == 3


@pytest.mark.parametrize("payload", list(PAYLOADS.values()), ids=list(PAYLOADS))
@pytest.mark.parametrize(("method", "streaming"), [("Generate", False), ("GenerateStream", True)])
def test_unauthenticated_garbage_is_unauthenticated(keyed_server: ServerThread, method, streaming, payload) -> None:
    before = _errors(keyed_server, "UNAUTHENTICATED")
    err = _raw_call(keyed_server.target, method, payload, streaming=streaming)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    assert _errors(keyed_server, "UNAUTHENTICATED") == before + 1
    # the same bytes with a valid key are parsed, and refused as malformed
    err = _raw_call(
        keyed_server.target, method, payload, streaming=streaming, metadata=(("authorization", f"Bearer {KEY}"),)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err


# ------------------------------------------------------------------------------ duplicate authorization
@pytest.mark.parametrize("second", [KEY, "wrong"], ids=["same-key-twice", "valid-then-wrong"])
@pytest.mark.parametrize("order", ["valid-first", "valid-last"])
def test_duplicate_authorization_is_refused(keyed_server: ServerThread, second: str, order: str) -> None:
    headers = [("authorization", f"Bearer {KEY}"), ("authorization", f"Bearer {second}")]
    if order == "valid-last":
        headers.reverse()
    with grpc.insecure_channel(keyed_server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Tokenize(pb.TokenizeRequest(text="hello"), metadata=tuple(headers), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "ambiguous" in (info.value.details() or "")
        assert KEY not in (info.value.details() or "")
        # exactly one header with the key is fine
        ok = stub.Tokenize(pb.TokenizeRequest(text="hello"), metadata=(headers[0 if order == "valid-first" else 1],))
        assert len(ok.token_ids) > 0


def test_denial_reason_of_duplicate_headers() -> None:
    icpt = ApiKeyInterceptor([KEY.encode()])
    assert icpt.denial([("authorization", f"Bearer {KEY}")]) is None
    reason = icpt.denial([("authorization", "Bearer x"), ("Authorization", f"Bearer {KEY}")])
    assert reason is not None and "ambiguous" in reason
    assert not icpt.authorized([("authorization", f"Bearer {KEY}"), ("authorization", f"Bearer {KEY}")])


# ------------------------------------------------------------------------------ model_name
def test_model_name_is_the_folder_name(client, bundle_dir: Path) -> None:
    info = client.model_info()
    assert info.model_name == bundle_dir.name
    assert "/" not in info.model_name and str(bundle_dir.parent) not in info.model_name
    assert str(bundle_dir.parent) not in info.config.config_json


# ------------------------------------------------------------------------------ CANCELLED counter
def test_every_client_cancel_is_counted_once(bundle_dir: Path) -> None:
    """40 concurrent streams cancelled by the client, CANCELLED rises by exactly 40.

    Half are cancelled at a random point while the server waits on the engine. The other half stop reading after
    their first message, on a channel with a small HTTP/2 window, and are cancelled only once the engine has
    generated everything: their handlers are then blocked inside gRPC's own write, where the CancelledError
    lands in gRPC's code rather than in the handler (the cancels that used to go uncounted). Each stream asks
    for more tokens than fit in that window, so none can finish first on any machine."""
    srv = make_server(bundle_dir)
    try:
        n = 40
        before = _errors(srv, "CANCELLED")
        sampling = pb.SamplingParams(max_new_tokens=MAX_NEW_TOKENS_LIMIT, ignore_eos=True, logprobs=True)
        req = pb.GenerateRequest(prompt="for i in range(10):\n    ", sampling=sampling)
        rng = random.Random(15)
        plans = [(rng.randint(1, 3), rng.uniform(0.0, 0.004), i % 2 == 1) for i in range(n)]
        engine_done = threading.Event()
        early_done = threading.Barrier(n // 2 + 1)
        codes: list[grpc.StatusCode] = []
        errors: list[BaseException] = []

        def cancel_one(channel: grpc.Channel, reads: int, pause: float, late: bool) -> None:
            try:
                call = pb_grpc.InferenceStub(channel).GenerateStream(req, timeout=120)
                for _ in range(reads):
                    next(call)
                if late:
                    assert engine_done.wait(60)
                else:
                    time.sleep(pause)  # where the cancel lands, not a timing assertion
                call.cancel()
                codes.append(call.code())
            except BaseException as exc:  # reported below
                errors.append(exc)
            finally:
                if not late:
                    early_done.wait(60)

        small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        with grpc.insecure_channel(srv.target, options=small_window) as channel:
            threads = [threading.Thread(target=cancel_one, args=(channel, *plan)) for plan in plans]
            for t in threads:
                t.start()
            early_done.wait(60)
            deadline = time.monotonic() + 60  # the late half: the engine generates all their tokens
            while (st := srv.stats()).num_running or st.num_waiting:
                assert time.monotonic() < deadline, f"engine still busy: {st}"
                time.sleep(0.02)
            engine_done.set()
            for t in threads:
                t.join(60)
        assert not errors, errors
        assert codes == [grpc.StatusCode.CANCELLED] * n, "a stream finished before its cancel"
        got = _wait_for_errors(srv, "CANCELLED", before + n)
        assert got == before + n, f"{got - before} of {n} client cancels counted"
        with srv.client(retry=NO_RETRY, timeout=60) as c:  # nothing counted late or twice
            c.generate("hello", max_new_tokens=2)
        assert _errors(srv, "CANCELLED") == before + n
    finally:
        srv.close()


# ------------------------------------------------------------------------------ health stays open, and safe
@pytest.mark.parametrize("payload", [GARBAGE, TRUNCATED_PREFIX, b"\x0a\x02\xc3\x28"], ids=["garbage", "trunc", "utf8"])
def test_malformed_health_check_is_invalid_argument(keyed_server: ServerThread, payload: bytes, caplog) -> None:
    """Health needs no key, so it is the one RPC anyone can send garbage to: it gets the same answer, no traceback."""
    caplog.set_level(logging.DEBUG)
    with grpc.insecure_channel(keyed_server.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/grpc.health.v1.Health/Check")(payload, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith("malformed request: ")
        with pytest.raises(grpc.RpcError) as info:
            list(channel.unary_stream("/grpc.health.v1.Health/Watch")(payload, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all(r.exc_info is None and r.levelno < logging.ERROR for r in caplog.records)
    with keyed_server.client(retry=NO_RETRY) as c:
        assert c.health() == "SERVING"
