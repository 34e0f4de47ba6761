"""The /metrics HTTP server is bounded (issue 15): half-open connections start no thread, are closed after the
server's timeout, and do not stop a normal scrape; past `metrics_max_connections` a connection is closed on accept;
/metrics binds `metrics_host`, not the gRPC host.

Real servers on free loopback ports; every wait is bounded and none asserts a duration."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference_svc.settings import ServerSettings, SettingsError
from tests.inference_svc.server.conftest import ServerThread, make_server

HALF_OPEN = 50
PARTIAL_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # no blank line: the request never ends


def _scrape(host: str, port: int, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def _closed_by_peer(sock: socket.socket, deadline: float) -> bool:
    """True once the server closes `sock` (EOF or reset), False if `deadline` passes first."""
    try:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        return sock.recv(1024) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@contextlib.contextmanager
def _half_open(port: int, n: int) -> Iterator[list[socket.socket]]:
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(PARTIAL_REQUEST)
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


def _threads() -> int:
    return threading.active_count()


@pytest.fixture
def metrics_server(bundle_dir: Path) -> Iterator[ServerThread]:
    srv = make_server(bundle_dir, metrics_port=0, metrics_timeout=2.0, metrics_max_connections=64)
    yield srv
    srv.close()


def test_half_open_connections_are_bounded_and_time_out(metrics_server: ServerThread) -> None:
    port = metrics_server.server.metrics_port
    assert port
    _scrape("127.0.0.1", port)  # warm: whatever the first scrape starts is counted in the baseline
    baseline = _threads()
    with _half_open(port, HALF_OPEN) as socks:
        # a normal scrape is served while the 50 are open (it was accepted after them, so they are all accepted)
        text = _scrape("127.0.0.1", port)
        assert "tandem_requests_running" in text
        assert _threads() <= baseline + 2, f"{_threads() - baseline} threads for {HALF_OPEN} half-open connections"
        deadline = time.monotonic() + 60  # far beyond the 2 s timeout on any machine
        still_open = [s for s in socks if not _closed_by_peer(s, deadline)]
        assert not still_open, f"{len(still_open)} of {HALF_OPEN} half-open connections not closed by the server"
    assert _threads() <= baseline + 2
    assert "tandem_requests_running" in _scrape("127.0.0.1", port)


def test_connections_past_the_limit_are_closed_on_accept(bundle_dir: Path) -> None:
    srv = make_server(bundle_dir, metrics_port=0, metrics_timeout=120.0, metrics_max_connections=4)
    try:
        port = srv.server.metrics_port
        assert port
        with _half_open(port, 4) as held, _half_open(port, 3) as extra:
            deadline = time.monotonic() + 30
            assert all(_closed_by_peer(s, deadline) for s in extra)  # refused at once, not after 120 s
            assert srv.server._metrics_http is not None and srv.server._metrics_http.open_connections == 4
            for s in held:
                s.close()
        # the held ones are gone (EOF), so their slots free up: a scrape works again within a bounded wait
        deadline = time.monotonic() + 30
        while True:
            try:
                assert "tandem_kv_blocks_total" in _scrape("127.0.0.1", port, timeout=10)
                break
            except OSError:
                assert time.monotonic() < deadline, "no slot freed after the clients closed"
                time.sleep(0.05)
    finally:
        srv.close()


def test_metrics_answers_only_metrics(metrics_server: ServerThread) -> None:
    port = metrics_server.server.metrics_port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.1 405")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /secret HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.1 404")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # not HTTP at all: closed, nothing sent
        s.sendall(b"\xff\xfe\x00garbage\r\n\r\n")
        assert _closed_by_peer(s, time.monotonic() + 30)


def test_metrics_host_defaults_to_loopback_apart_from_host(bundle_dir: Path) -> None:
    settings = ServerSettings(model=str(bundle_dir), host="::1")
    assert settings.metrics_host == "127.0.0.1"
    for bad in ("example.com", "[127.0.0.1]", ""):
        with pytest.raises(SettingsError) as info:
            ServerSettings(model=str(bundle_dir), metrics_host=bad)
        assert info.value.field == "metrics_host"
    for field, value in (("metrics_timeout", 0), ("metrics_max_connections", 0)):
        with pytest.raises(SettingsError) as info:
            ServerSettings(model=str(bundle_dir), **{field: value})
        assert info.value.field == field


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_metrics_do_not_follow_the_grpc_host(bundle_dir: Path) -> None:
    """gRPC on [::1], metrics left at the default: /metrics is on 127.0.0.1 and not on [::1]."""
    if not _has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")
    from tests.inference_svc.server.test_serve_startup import free_port6

    srv = make_server(bundle_dir, host="::1", port=free_port6(), metrics_port=0)
    try:
        port = srv.server.metrics_port
        assert port
        assert "tandem_requests_running" in _scrape("127.0.0.1", port)
        with pytest.raises(OSError), socket.create_connection(("::1", port), timeout=10):
            pass
    finally:
        srv.close()
