"""`tandem serve` as a child process: started on free loopback ports, waited on until SERVING, stopped by SIGTERM.

Contract:
- `free_port(host)` is a TCP port free on `host` (127.0.0.1 by default) right now: bound to 0, read back, released.
  Every launcher in the project (bench, benchmarks, the demo, the tests) takes its ports from here.
- `ServeProcess(model, flags)` starts `python -m shared_model.cli serve --model MODEL --host 127.0.0.1 --port P
  FLAGS...` (the gRPC port `P` chosen here; `--http-port` and `--metrics-port` are the caller's flags, else the
  serve defaults), its output appended to `log` (a file, created), shown on this process's own output (`echo`), or
  discarded. `command` replaces the module run
  (a test's `-m tests....serve_with_slow_steps`); `env` is merged over the caller's environment, with
  `PYTHONUNBUFFERED=1`. It never binds anything but loopback.
- `wait_serving(timeout)` polls gRPC health until SERVING and returns the seconds it took; a server that exits first
  raises `ServeExited` (its exit code and its own last word from the log: `last_line()`), one that is still not
  SERVING at the timeout raises `TimeoutError`.
- `stop(timeout)` sends SIGTERM and returns the exit code, or kills it after `timeout` s and returns None. The
  context manager stops it on exit, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on `host` right now (bind to 0, read it back, release it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServeExited(RuntimeError):
    """The server exited before it reported SERVING; `code` is its exit status."""

    def __init__(self, code: int, last_line: str) -> None:
        super().__init__(f"server exited with {code} before SERVING: {last_line or '(no output)'}")
        self.code = code
        self.last_line = last_line


class ServeProcess:
    """One `tandem serve` child on a free loopback gRPC port (see the module docstring)."""

    def __init__(
        self,
        model: str | Path,
        flags: Sequence[str] = (),
        *,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        command: Sequence[str] = ("-m", "shared_model.cli", "serve"),
        cwd: Path | None = None,
        echo: bool = False,
    ) -> None:
        self.port = free_port()
        self.log = log
        cmd = [sys.executable, *command, "--model", str(model), "--host", LOOPBACK, "--port", str(self.port), *flags]
        self.cmd = cmd
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log_file: IO[bytes] | None = None
        out: Any = None if echo else subprocess.DEVNULL
        if log is not None:
            self._log_file = open(log, "ab")  # noqa: SIM115 - closed in stop()
            self._log_file.write(("$ " + shlex.join(cmd) + "\n").encode())
            self._log_file.flush()
            out = self._log_file
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                                     cwd=cwd)  # fmt: skip

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def last_line(self) -> str:
        """The server's own last word in its log: its last `tandem serve:` or error line, else its last line."""
        if self.log is None:
            return ""
        if self._log_file is not None:
            self._log_file.flush()
        try:
            lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        own = [ln for ln in lines if ln.startswith("tandem serve:") or "Error" in ln]
        return (own or lines or [""])[-1][:300]

    def wait_serving(self, timeout: float) -> float:
        """Seconds until gRPC health said SERVING (see the module docstring for the failures)."""
        import grpc

        from inference_svc.client import NO_RETRY, TandemClient

        t0 = time.perf_counter()
        deadline = t0 + timeout
        with TandemClient(self.target, retry=NO_RETRY, timeout=5.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise ServeExited(code, self.last_line())
                with contextlib.suppress(grpc.RpcError):
                    if client.health(timeout=2.0) == "SERVING":
                        return time.perf_counter() - t0
                if time.perf_counter() >= deadline:
                    raise TimeoutError(f"server did not report SERVING within {timeout:g} s: {self.last_line()}")
                time.sleep(0.1)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then the exit code (None: it had to be killed)."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    return self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
                    return None
            return self.proc.returncode
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
