"""The HTTP listener's connection guard (issue 34) against a real server on a loopback port: idle sockets and a
trickled request head are closed at the head deadline, they never keep `/health` out (a new connection displaces
the oldest idle one, per client and overall), a head above 64 KiB gets 431 even in one packet, and every answer
below the app has the OpenAI error shape.

Liveness bounds only (socket timeouts): nothing here depends on the machine's speed.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from inference_svc.settings import HttpLimits
from tests.inference_svc.server.conftest import ServerThread, make_server

HEAD_TIMEOUT = 1.0
IDLE = 200
BOUND_S = 60.0
"""Liveness bound on anything the server must do (close a socket, answer a request)."""


def _base(srv: ServerThread) -> str:
    return f"http://127.0.0.1:{srv.server.http_port}"


def _connect(srv: ServerThread) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=BOUND_S)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as a close)."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _error(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head.lower(), head
    return status, json.loads(body)["error"]


@pytest.fixture(scope="module", params=[(1024, 32), (32, 1024)], ids=["per-client-cap", "total-cap"])
def guarded(request: pytest.FixtureRequest, bundle_dir: Path) -> Iterator[ServerThread]:
    total, per_client = request.param
    limits = HttpLimits(max_connections=total, max_connections_per_client=per_client, head_timeout=HEAD_TIMEOUT)
    srv = make_server(bundle_dir, http_port=0, http=limits)
    yield srv
    srv.close()


def test_idle_sockets_and_a_trickled_head_are_closed_and_health_answers(guarded: ServerThread) -> None:
    guard = guarded.server._http.guard  # type: ignore[union-attr]
    idle = [_connect(guarded) for _ in range(IDLE)]  # more than either cap: the oldest are displaced at once
    trickler = _connect(guarded)
    stop = threading.Event()

    def trickle() -> None:
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 10_000
        try:
            for i in range(len(head)):
                if stop.is_set():
                    return
                trickler.sendall(head[i : i + 1])
                time.sleep(0.05)
        except OSError:
            pass  # cut off: what we expect

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        for _ in range(5):  # while the flood and the trickle hold their sockets
            r = httpx.get(_base(guarded) + "/health", timeout=BOUND_S)
            assert r.status_code == 200 and r.json() == {"status": "serving"}
        reply = _read_all(trickler)  # the trickler is cut off at the head deadline with a 408
        status, error = _error(reply)
        assert status == 408 and error["code"] == "INVALID_ARGUMENT" and "request head" in error["message"]
        for sock in idle:  # every idle socket is closed by the server (displaced or timed out), no answer sent
            assert _read_all(sock) == b""
    finally:
        stop.set()
        for sock in [*idle, trickler]:
            sock.close()
        t.join(BOUND_S)
    assert guard.evicted > 0 and guard.timed_out > 0
    deadline = time.monotonic() + BOUND_S
    while guard.open and time.monotonic() < deadline:  # everything closed is forgotten
        time.sleep(0.02)
    assert guard.open == 0


def test_keep_alive_connections_get_a_new_head_deadline(guarded: ServerThread) -> None:
    with _connect(guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b'"serving"' not in first:
            chunk = sock.recv(4096)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # a second head, never finished
        status, error = _error(_read_all(sock))
        assert status == 408 and error["code"] == "INVALID_ARGUMENT"


def test_a_head_over_64_kib_gets_431_even_in_one_packet(bundle_dir: Path) -> None:
    srv = make_server(bundle_dir, http_port=0)
    try:
        for size in (70_000, 200_000):  # one send: complete (h11 alone accepted it), and over h11's own buffer
            with _connect(srv) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * size + b"\r\n\r\n")
                status, error = _error(_read_all(sock))
            assert status == 431 and error["param"] == "headers" and error["code"] == "INVALID_ARGUMENT"
        with _connect(srv) as sock:  # malformed HTTP: 400 in the same shape, not uvicorn's plain text
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            status, error = _error(_read_all(sock))
        assert status == 400 and error["type"] == "invalid_request_error"
        with _connect(srv) as sock:  # just under the limit is served
            sock.sendall(
                b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: " + b"a" * 60_000 + b"\r\n\r\n"
            )
            assert _read_all(sock).startswith(b"HTTP/1.1 200")
    finally:
        srv.close()


def test_when_every_slot_serves_a_request_a_new_connection_gets_a_json_503(bundle_dir: Path) -> None:
    limits = HttpLimits(max_connections=1, max_connections_per_client=1, head_timeout=HEAD_TIMEOUT)
    srv = make_server(bundle_dir, http_port=0, http=limits, http_body_timeout=30.0)
    try:
        with _connect(srv) as busy:  # a complete head and half a body: serving, not waiting for a head
            busy.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            deadline = time.monotonic() + BOUND_S
            guard = srv.server._http.guard  # type: ignore[union-attr]
            while guard.open != 1 or guard._waiting:  # bounded: the head is read
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with _connect(srv) as late:
                status, error = _error(_read_all(late))
            assert status == 503 and error["code"] == "UNAVAILABLE"
    finally:
        srv.close()
