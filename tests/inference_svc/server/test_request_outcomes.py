"""Counting and logging (issue 34): one table of outcomes for HTTP and gRPC, every outcome counted once under its
code in `tandem_request_errors_total`, a client's own deadline or disconnect logged at most once at INFO (the
access line) and never with a traceback, one `tandem.access` line per request, and `created` = the request's
arrival. Real servers on loopback ports; the log is read with caplog (the server runs in this process)."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest

from inference_svc.client import NO_RETRY
from tests.inference_svc.server.conftest import ServerThread, make_server, metric_value, wait_idle

PROMPT = "def read(self, size=-1):\n    "


@pytest.fixture(scope="module")
def srv(bundle_dir: Path) -> Iterator[ServerThread]:
    server = make_server(bundle_dir, http_port=0)
    yield server
    server.close()


@pytest.fixture
def slow(srv: ServerThread) -> Iterator[None]:
    """Test-only fault hook: 30 ms per increment of requests whose id starts with 'slow-'."""
    engine = srv.server.engine
    assert engine is not None
    engine.fault_hook = lambda out: time.sleep(0.03) if out.request_id.startswith("slow-") else None
    yield
    engine.fault_hook = None


def _url(srv: ServerThread, path: str = "/v1/completions") -> str:
    return f"http://127.0.0.1:{srv.server.http_port}{path}"


def _count(srv: ServerThread, code: str) -> float:
    return metric_value(srv.server.metrics.render(), "tandem_request_errors_total", code=code)


def _wait_count(srv: ServerThread, code: str, at_least: float, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while (value := _count(srv, code)) < at_least and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def _tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


# ---------------------------------------------------------------------------------------- disconnects
def test_http_disconnects_count_as_cancelled(srv: ServerThread, slow, caplog) -> None:
    caplog.set_level(logging.INFO)
    before, internal = _count(srv, "CANCELLED"), _count(srv, "INTERNAL")
    body = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # a whole request: the client gives up and closes the connection
        httpx.post(_url(srv), json=body, headers={"X-Request-Id": "slow-gone-1"}, timeout=httpx.Timeout(30, read=0.3))
    assert _wait_count(srv, "CANCELLED", before + 1) == before + 1
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", _url(srv), json={**body, "stream": True}, headers={"X-Request-Id": "slow-gone-2"}) as r,
    ):
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data: "))
    assert _wait_count(srv, "CANCELLED", before + 2) == before + 2
    wait_idle(srv)
    assert _count(srv, "CANCELLED") == before + 2 and _count(srv, "INTERNAL") == internal
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.access" and "slow-gone" in r.getMessage()]
    assert len(lines) == 2 and all(" 499 CANCELLED " in line for line in lines), lines
    assert not _tracebacks(caplog)


def test_a_client_hanging_up_mid_body_is_cancelled_without_a_traceback(srv: ServerThread, caplog) -> None:
    caplog.set_level(logging.INFO)
    before, internal = _count(srv, "CANCELLED"), _count(srv, "INTERNAL")
    with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=30) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
        sock.sendall(head + b"\r\n" + b'{"prompt": ')  # 11 of 100 bytes, then the client hangs up
    assert _wait_count(srv, "CANCELLED", before + 1) == before + 1
    assert _count(srv, "INTERNAL") == internal
    assert not _tracebacks(caplog) and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_grpc_deadline_counts_as_deadline_exceeded(srv: ServerThread, slow) -> None:
    from inference_svc.grpc_service.servicer import DEADLINE_SLACK_S, cut_by_deadline

    before, cancelled = _count(srv, "DEADLINE_EXCEEDED"), _count(srv, "CANCELLED")
    with srv.client(retry=NO_RETRY) as c:
        for rid in ("slow-deadline-1", "slow-deadline-2"):
            with pytest.raises(grpc.RpcError) as info:
                c.generate(PROMPT, max_new_tokens=60, ignore_eos=True, request_id=rid, timeout=0.3)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait_count(srv, "DEADLINE_EXCEEDED", before + 2) == before + 2
    wait_idle(srv)
    assert _count(srv, "CANCELLED") == cancelled
    # the client's timer fires before the server's (by the request's transit time): a cut that close to the
    # deadline is the deadline, one well before it is a cancel
    assert cut_by_deadline(0.0) and cut_by_deadline(-1.0) and cut_by_deadline(DEADLINE_SLACK_S / 2)
    assert not cut_by_deadline(None) and not cut_by_deadline(1.0)


def test_an_http_timeout_is_logged_once_at_info_without_a_traceback(srv: ServerThread, slow, caplog) -> None:
    caplog.set_level(logging.INFO)
    before = _count(srv, "DEADLINE_EXCEEDED")
    body = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "timeout": 0.3}
    r = httpx.post(_url(srv), json=body, headers={"X-Request-Id": "slow-timeout-1"}, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "DEADLINE_EXCEEDED"
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", _url(srv), json={**body, "stream": True}, headers={"X-Request-Id": "slow-timeout-2"}) as s,
    ):
        events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == "DEADLINE_EXCEEDED" and events[-1] == "[DONE]"
    assert _wait_count(srv, "DEADLINE_EXCEEDED", before + 2) == before + 2
    for rid in ("slow-timeout-1", "slow-timeout-2"):
        about = [r for r in caplog.records if rid in r.getMessage()]
        assert len(about) == 1 and about[0].levelno == logging.INFO and about[0].name == "tandem.access", about
        assert "DEADLINE_EXCEEDED" in about[0].getMessage()
    assert not _tracebacks(caplog) and not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ---------------------------------------------------------------------------------------- access log
def test_one_access_line_per_request_for_http_and_grpc(srv: ServerThread, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tandem.access")
    body = {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(_url(srv), json=body, headers={"X-Request-Id": "acc-1"}, timeout=30).status_code == 200
    bad = httpx.post(_url(srv), json={"prompt": "x", "top_p": 5}, headers={"X-Request-Id": "acc-2"}, timeout=30)
    assert bad.status_code == 400
    with srv.client(retry=NO_RETRY) as c:
        c.generate([5, 6, 7], max_new_tokens=4, ignore_eos=True, request_id="acc-3")
        c.generate([5, 6], max_new_tokens=1, request_id="acc-4\nforged line")  # one line, whatever the id holds

    def lines_of(rid: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "tandem.access" and f"id={rid} " in r.getMessage()]

    deadline = time.monotonic() + 30
    while not lines_of("acc-3") and time.monotonic() < deadline:  # a call's record ends just after its answer
        time.sleep(0.02)
    lines = {rid: lines_of(rid) for rid in ("acc-1", "acc-2", "acc-3")}
    assert all(len(v) == 1 for v in lines.values()), lines
    assert lines["acc-1"][0].startswith("http POST /v1/completions 200 OK id=acc-1 peer=127.0.0.1:")
    assert " tokens_in=5 tokens_out=6 " in lines["acc-1"][0]
    assert lines["acc-2"][0].startswith("http POST /v1/completions 400 INVALID_ARGUMENT id=acc-2 ")
    assert lines["acc-3"][0].startswith("grpc Generate tandem.inference.v1.Inference/Generate OK id=acc-3 ")
    assert " tokens_in=3 tokens_out=4 " in lines["acc-3"][0]
    assert all(r.levelno == logging.INFO and not r.exc_info for r in caplog.records if r.name == "tandem.access")
    while not lines_of("acc-4\\nforged\\x20line") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(lines_of("acc-4\\nforged\\x20line")) == 1
    assert not [r for r in caplog.records if r.name == "tandem.access" and "\n" in r.getMessage()]


def test_access_log_off_with_the_flag_still_counts(bundle_dir: Path, caplog) -> None:
    from inference_svc.cli import build_serve_config

    assert build_serve_config(["--model", str(bundle_dir)])[0].access_log is True
    assert build_serve_config(["--model", str(bundle_dir), "--no-access-log"])[0].access_log is False
    caplog.set_level(logging.INFO)
    quiet = make_server(bundle_dir, http_port=0, access_log=False)
    try:
        before = _count(quiet, "INVALID_ARGUMENT")
        assert httpx.post(_url(quiet), json={"prompt": "x", "max_tokens": 2}, timeout=30).status_code == 200
        assert httpx.post(_url(quiet), json={"prompt": "x", "top_p": 5}, timeout=30).status_code == 400
        with quiet.client(retry=NO_RETRY) as c:
            c.generate([5, 6], max_new_tokens=2)
        assert _count(quiet, "INVALID_ARGUMENT") == before + 1
        assert not [r for r in caplog.records if r.name == "tandem.access"]
    finally:
        quiet.close()


# ---------------------------------------------------------------------------------------- created
def test_created_is_the_request_arrival_the_same_in_every_chunk(srv: ServerThread) -> None:
    deadline = time.monotonic() + 5
    started = int(time.time())
    while int(time.time()) == started and time.monotonic() < deadline:  # a second after the server was built
        time.sleep(0.05)
    t0 = int(time.time())
    whole = httpx.post(_url(srv), json={"prompt": PROMPT, "max_tokens": 2}, timeout=30).json()
    body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", _url(srv), json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    chat = httpx.post(
        _url(srv, "/v1/chat/completions"), json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30
    )
    t1 = int(time.time())
    assert t0 <= whole["created"] <= t1
    assert len(chunks) >= 2 and len({ch["created"] for ch in chunks}) == 1 and t0 <= chunks[0]["created"] <= t1
    assert chat.status_code == 400  # this folder has no chat template: errors carry no `created`


# ---------------------------------------------------------------------------------------- shutdown
def test_shutdown_with_slow_uploads_pending_writes_no_tracebacks(bundle_dir: Path, caplog, capfd) -> None:
    """Neither in the log records nor on the process's stderr (uvicorn logs through its own handlers)."""
    caplog.set_level(logging.INFO)
    victim = make_server(bundle_dir, http_port=0, http_body_timeout=60.0)
    socks: list[socket.socket] = []
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", victim.server.http_port), timeout=30)
            sock.sendall(head + b"\r\n" + b'{"prompt": "')  # a slow upload: 12 of 1000 bytes so far
            socks.append(sock)
        deadline = time.monotonic() + 30
        while len([r for r in caplog.records if r.name == "tandem.access"]) == 0 and time.monotonic() < deadline:
            # bounded wait until the server holds the uploads: a probe request is logged after them
            httpx.get(_url(victim, "/v1/models"), timeout=30)
        victim.close(grace=0.5)
    finally:
        for sock in socks:
            sock.close()
    assert not _tracebacks(caplog), [r.getMessage()[:200] for r in _tracebacks(caplog)][:3]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err[-2000:]
