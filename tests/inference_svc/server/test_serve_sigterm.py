"""`tandem serve` as a real subprocess: `tandem generate` against it, then SIGTERM drains it — health NOT_SERVING, new
requests UNAVAILABLE, a short in-flight request finishes, a long one ends UNAVAILABLE after the grace period, and
the process exits 0.

The server runs with the test-only slow-step hook (`serve_with_slow_steps`): the long request's id starts with
'slow-', so it is still decoding when the grace period ends on a machine of any speed."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from inference_svc.client import NO_RETRY, TandemClient
from inference_svc.engine.types import FinishReason
from shared_model.bundle import save_bundle
from shared_model.model import build_model
from tests.conftest import free_port, tiny_config

pytestmark = pytest.mark.slow  # a tandem serve subprocess and its drain (not in make test-fast)

REPO = Path(__file__).resolve().parents[3]
GRACE_S = 1.5
LONG_TOKENS = 2000  # with the hook's 20 ms per token: at least 40 s, far beyond GRACE_S


@pytest.fixture(scope="module")
def long_context_bundle(tmp_path_factory: pytest.TempPathFactory, small_tokenizer) -> Path:
    config = tiny_config(max_position_embeddings=2048)
    return save_bundle(tmp_path_factory.mktemp("sigterm") / "bundle", config, build_model(config), small_tokenizer)


def _start_server(bundle: Path, port: int) -> tuple[subprocess.Popen, queue.Queue]:
    cmd = [
        sys.executable, "-m", "tests.inference_svc.server.serve_with_slow_steps",
        "--model", str(bundle), "--port", str(port),
        "--no-metrics", "--http-port", "0", "--device", "cpu", "--kv-cache-memory", "4MiB", "--max-new-tokens", "2040",
        "--shutdown-grace", str(GRACE_S), "--log-level", "WARNING",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def _wait_for_line(lines: queue.Queue, needle: str, timeout: float, seen: list[str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if line is None:
            raise AssertionError("server exited early:\n" + "".join(seen))
        seen.append(line)
        if needle in line:
            return
    raise AssertionError(f"no {needle!r} within {timeout} s:\n" + "".join(seen))


def test_generate_cli_then_sigterm_drain(long_context_bundle: Path) -> None:
    port = free_port()
    proc, lines = _start_server(long_context_bundle, port)
    seen: list[str] = []
    try:
        _wait_for_line(lines, "SERVING", 120, seen)
        target = f"127.0.0.1:{port}"

        gen = subprocess.run(
            [sys.executable, "-m", "shared_model.cli", "generate", "--target", target, "def main():",
             "--max-new-tokens", "6", "--ignore-eos"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert gen.returncode == 0, gen.stderr
        assert "TTFT" in gen.stderr and "time per output token" in gen.stderr and "completion 6 tokens" in gen.stderr

        results: dict[str, object] = {}
        started = {name: threading.Event() for name in ("long", "short")}

        def stream(name: str, max_new_tokens: int) -> None:
            with TandemClient(target, retry=NO_RETRY, timeout=60) as c:
                tokens = 0
                try:
                    for msg in c.generate_stream(
                        "x = 1\n", request_id=f"slow-{name}" if name == "long" else "", max_new_tokens=max_new_tokens,
                        ignore_eos=True,
                    ):  # fmt: skip
                        tokens += len(msg.token_ids)
                        started[name].set()
                        if msg.finish_reason is not None:
                            results[name] = ("done", tokens, msg.finish_reason)
                except grpc.RpcError as exc:
                    results[name] = ("error", tokens, exc.code())
                finally:
                    started[name].set()

        long_t = threading.Thread(target=stream, args=("long", LONG_TOKENS))
        long_t.start()
        assert started["long"].wait(30)
        short_t = threading.Thread(target=stream, args=("short", 4))
        short_t.start()
        assert started["short"].wait(30)

        t_sig = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        with TandemClient(target, retry=NO_RETRY, timeout=5) as c:
            deadline = time.monotonic() + 10
            while c.health() != "NOT_SERVING":
                assert time.monotonic() < deadline, "health did not turn NOT_SERVING"
                time.sleep(0.02)
            with pytest.raises(grpc.RpcError) as info:
                c.generate("x = 1\n", max_new_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        short_t.join(30)
        long_t.join(30)
        assert proc.wait(timeout=30) == 0
        elapsed = time.monotonic() - t_sig
        assert results["short"] == ("done", 4, FinishReason.LENGTH), results
        outcome, tokens, code = results["long"]  # type: ignore[misc]
        assert (outcome, code) == ("error", grpc.StatusCode.UNAVAILABLE), results
        assert 0 < tokens < LONG_TOKENS
        assert elapsed >= GRACE_S  # the drain waited for the grace period (the waits above bound the rest)
        rest = []
        while (line := lines.get(timeout=5)) is not None:
            rest.append(line)
        assert any("stopped" in line for line in rest), rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
