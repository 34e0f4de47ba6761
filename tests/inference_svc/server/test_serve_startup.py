"""`tandem serve` start-up as a real subprocess (issue 15): a busy gRPC port or a busy metrics port gives one line
naming HOST:PORT and exit 1 (no traceback); `--host ::1` and `--host [::1]` (and the same for `--metrics-host`)
serve gRPC health and /metrics over [::1]. The IPv6 tests skip only where the machine has no IPv6 loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference_svc.client import NO_RETRY, TandemClient
from tests.conftest import free_port

pytestmark = pytest.mark.slow  # tandem serve subprocesses (not in make test-fast)

REPO = Path(__file__).resolve().parents[3]
COMMON = ["--device", "cpu", "--kv-cache-memory", "2MiB", "--no-warmup", "--log-level", "WARNING"]


def free_port6() -> int:
    """A TCP port free on [::1] right now."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]


def _has_ipv6_loopback() -> bool:
    try:
        free_port6()
        return True
    except OSError:
        return False


def _serve(*args: str) -> list[str]:
    http = [] if "--http-port" in args else ["--http-port", "0"]
    return [sys.executable, "-m", "shared_model.cli", "serve", *args, *http, *COMMON]


def _run_to_exit(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 held by a listening socket for the test's duration."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def _one_line(proc: subprocess.CompletedProcess) -> str:
    out = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 1, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(out) == 1, out
    return out[0]


def test_busy_grpc_port_is_one_line(bundle_dir: Path, busy_port: int) -> None:
    proc = _run_to_exit(_serve("--model", str(bundle_dir), "--port", str(busy_port), "--no-metrics"))
    line = _one_line(proc)
    assert line.startswith("tandem serve: ") and f"127.0.0.1:{busy_port}" in line and "gRPC" in line, line


def test_busy_metrics_port_is_one_line(bundle_dir: Path, busy_port: int) -> None:
    cmd = _serve("--model", str(bundle_dir), "--port", str(free_port()), "--metrics-port", str(busy_port))
    line = _one_line(_run_to_exit(cmd))
    assert line.startswith("tandem serve: ") and f"127.0.0.1:{busy_port}" in line and "metrics" in line, line


def test_busy_http_port_is_one_line(bundle_dir: Path, busy_port: int) -> None:
    cmd = _serve("--model", str(bundle_dir), "--port", str(free_port()), "--no-metrics", "--http-port", str(busy_port))
    line = _one_line(_run_to_exit(cmd))
    assert line.startswith("tandem serve: ") and f"127.0.0.1:{busy_port}" in line and "HTTP" in line, line


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_ipv6_loopback_for_grpc_and_metrics(bundle_dir: Path, host: str) -> None:
    if not _has_ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")
    port, metrics_port, http_port = free_port6(), free_port6(), free_port6()
    cmd = _serve("--model", str(bundle_dir), "--host", host, "--port", str(port), "--http-port", str(http_port))
    cmd += ["--metrics-host", host, "--metrics-port", str(metrics_port)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with TandemClient(f"[::1]:{port}", retry=NO_RETRY, timeout=10) as client:
            client.wait_until_serving(120)
            assert client.tokenize("hello").token_ids
        with urllib.request.urlopen(f"http://[::1]:{metrics_port}/metrics", timeout=30) as r:
            assert "tandem_kv_blocks_total" in r.read().decode()
        with urllib.request.urlopen(f"http://[::1]:{http_port}/health", timeout=30) as r:
            assert r.read() == b'{"status":"serving"}'
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert f"listening on [::1]:{port}" in out, out
