"""A tokenizer in a child process: long texts are tokenized off the server's GIL, CPU priority and heap.

Contract:
- `TokenizerProcess(tokenizer)` owns at most one child Python process, started by `start()` or by the first
  `call`. The child resolves modules exactly as the server does (it gets the server's `sys.path` and runs in
  isolated mode, so neither its working directory nor PYTHONPATH can put other code first), holds its own copy
  of the tokenizer (sent pickled when it starts) and runs at a lower CPU priority (`NICE` steps), so on a busy
  machine the server's decode loop gets the cores first. It imports neither torch nor gRPC, and is ready in well
  under a second.
- `call(job, *args, timeout=...)` runs `job(tokenizer, *args)` in the child and returns its result. `job` is a
  module-level function (`inference_svc.tokenizer_jobs`), pickled by name; arguments and result travel pickled
  over the child's stdin and stdout, one call at a time. Callers serialize their calls: the gate's one worker
  thread is the only caller. The call blocks with the GIL released while the child works; the server's process
  still spends GIL time pickling the text and unpickling the result, a copy each.
- An exception the job raises is raised again by `call`, with its type and attributes (`InvalidRequestError`
  keeps its `field`). Any other exception is also logged with its traceback on the child's stderr; one that
  does not pickle arrives as a `RequestFailedError` with a generic message (clients never see internals).
- If the child dies mid-call (killed, out of memory), or has not answered within `timeout` seconds and is
  killed, that call raises `RequestFailedError` naming its exit status, and the next call starts a new child
  (`starts` counts them; `calls` counts answered jobs). Failure to start at all (or within `START_TIMEOUT_S`)
  raises `TokenizerProcessError`; the gate then tokenizes on its own thread.
- The child's memory is capped (RLIMIT_DATA) at what it uses once the tokenizer is loaded plus
  `MEMORY_HEADROOM_BYTES`: a job that would need more (a chat template building a huge string) gets a
  MemoryError in the child instead of growing it without bound; its caller decides what that means (a chat
  render's is the request's 400).
- After each call the child hands freed heap pages back to the system, so its memory between calls is its
  working set, not its largest text plus everything freed since.
- The child ignores SIGINT and SIGTERM (a terminal's or a process group's signal is the server's to handle)
  and ends when its stdin closes: at `close()`, or when the server process ends, however it ends (after the job
  in hand, if any). `kill()` ends it at once; `close()` ends it for good.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from typing import IO, Any

from inference_svc.errors import InferenceError, RequestFailedError

log = logging.getLogger(__name__)

NICE = 10
"""How many steps below the server's CPU priority the child runs."""
START_TIMEOUT_S = 60.0
"""How long a new child may take to import and load the tokenizer before it counts as failed to start."""
CALL_TIMEOUT_S = 120.0
"""The default bound on one job; the gate gives each call a bound scaled by its characters."""
MEMORY_HEADROOM_BYTES = 4 * 1024**3
"""How much memory the child's jobs may use beyond the loaded tokenizer (about 20x what tokenizing the largest text
the gate admits needs)."""
_HEADER = struct.Struct("<Q")  # the byte length of the pickled frame that follows
_CHILD = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from inference_svc.tokenizer_process import main; sys.exit(main(sys.argv[2:]))"
)


class TokenizerProcessError(InferenceError):
    """The tokenizer process could not be started."""


class TokenizerProcess:
    """One child process that runs tokenizer jobs (see the module docstring)."""

    def __init__(self, tokenizer: Any, nice: int = NICE) -> None:
        self._payload = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        self.nice = nice
        self.starts = 0
        """Children started so far (more than one means a child died and was replaced)."""
        self.calls = 0
        """Jobs the children have answered."""
        self._proc: subprocess.Popen | None = None
        self._closed = False
        self._lock = threading.Lock()  # start/close/kill from another thread than the caller's

    @property
    def pid(self) -> int | None:
        """The running child's process id, or None."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the child unless one is running; `TokenizerProcessError` when it cannot start (or after
        `close`)."""
        with self._lock:
            if self._closed:
                raise TokenizerProcessError("the tokenizer process is closed")
            if self._proc is not None and self._proc.poll() is None:
                return
            self._proc = None
            # The child resolves modules as this process does (its sys.path, the working directory made absolute),
            # and nothing else: isolated mode ignores PYTHONPATH and the working directory of its own.
            path = json.dumps([os.path.abspath(p) for p in sys.path])
            cmd = [sys.executable, "-I", "-c", _CHILD, path, str(self.nice)]
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            except OSError as exc:
                raise TokenizerProcessError(f"cannot start the tokenizer process ({exc})") from exc
            assert proc.stdin is not None and proc.stdout is not None
            timer = threading.Timer(START_TIMEOUT_S, proc.kill)  # a child that hangs at start-up is ended
            timer.start()
            try:
                _write(proc.stdin, self._payload)
                ready = pickle.loads(_read(proc.stdout))
            except Exception as exc:  # died, hung and was killed, or answered garbage
                status = _end(proc)
                raise TokenizerProcessError(f"the tokenizer process failed to start ({_status(status)})") from exc
            finally:
                timer.cancel()
            if ready != "ready":
                _end(proc)
                raise TokenizerProcessError("the tokenizer process answered its start-up with something else")
            self._proc = proc
            self.starts += 1
            if self.starts > 1:
                log.warning("tokenizer process restarted (pid %d, start %d)", proc.pid, self.starts)

    def call(self, job: Callable[..., Any], *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """`job(tokenizer, *args)` run in the child (see the module docstring); a child that has not answered
        within `timeout` seconds is killed, and the call fails like any other death of the child."""
        self.start()
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _write(proc.stdin, pickle.dumps((job, args), protocol=pickle.HIGHEST_PROTOCOL))
            reply = _read(proc.stdout)
        except (OSError, EOFError):
            status = _end(proc)
            with self._lock:
                if self._proc is proc:
                    self._proc = None
            log.error("tokenizer process %d exited while working (%s)", proc.pid, _status(status))
            raise RequestFailedError(
                f"the tokenizer process exited while tokenizing this text ({_status(status)}); retry", logged=True
            ) from None
        finally:
            timer.cancel()
        self.calls += 1
        ok, value = pickle.loads(reply)
        if ok:
            return value
        raise value

    def kill(self) -> None:
        """Kill the running child now: a call in flight fails, the next call starts a new child."""
        with self._lock:
            proc = self._proc
        if proc is not None:
            proc.kill()

    def close(self) -> None:
        """End the child for good: its stdin closes and it exits (killed if it has not within a few seconds);
        later calls raise `TokenizerProcessError`."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is not None:
            _end(proc, grace=5.0)


def _end(proc: subprocess.Popen, grace: float = 0.0) -> int:
    """Close the child's pipes, let it exit for `grace` seconds, kill it after that; its exit status."""
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    if not grace:
        proc.kill()
    try:
        return proc.wait(grace or None)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _write(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def _read(stream: IO[bytes]) -> bytes:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the stream ended")
    (size,) = _HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        raise EOFError("the stream ended inside a frame")
    return payload


def _status(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-returncode).name}"
        return f"signal {-returncode}"
    return f"exit status {returncode}"


# ---------------------------------------------------------------------------------------------- the child
def _reply(frame: bytes, tokenizer: Any) -> bytes:
    """The pickled (ok, result or exception) for one pickled (job, args) frame. A service error travels as it is;
    anything else is logged here with its traceback and travels as its type and message (the server answers it
    with a generic INTERNAL); what does not pickle becomes a generic `RequestFailedError`."""
    name = "?"
    try:
        job, args = pickle.loads(frame)
        name = getattr(job, "__qualname__", repr(job))
        return pickle.dumps((True, job(tokenizer, *args)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        if not isinstance(exc, InferenceError):
            traceback.print_exc(file=sys.stderr)
        try:
            reply = pickle.dumps((False, exc), protocol=pickle.HIGHEST_PROTOCOL)
            pickle.loads(reply)  # an exception pickles by its args, which its constructor may not take back
            return reply
        except Exception:
            print(f"tokenizer job {name}: {type(exc).__name__} does not pickle", file=sys.stderr)
            failure = RequestFailedError(f"the tokenizer failed on this text ({type(exc).__name__})", logged=True)
            return pickle.dumps((False, failure), protocol=pickle.HIGHEST_PROTOCOL)


def _cap_memory(headroom: int) -> None:
    """Cap this process's data memory at its present size plus `headroom` (Linux; elsewhere no cap)."""
    try:
        import resource

        with open("/proc/self/status") as f:
            data_kb = next(int(line.split()[1]) for line in f if line.startswith("VmData:"))
        _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = data_kb * 1024 + headroom
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    except (ImportError, OSError, StopIteration, ValueError):
        pass


def main(argv: list[str]) -> int:
    """The child's loop: read the tokenizer, answer "ready", then one reply per job until stdin closes."""
    # A terminal's Ctrl-C and a process group's SIGTERM are the server's to handle: it drains, then closes
    # this process's stdin, which ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(int(argv[0]) if argv else NICE)
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    import inference_svc.tokenizer_jobs  # noqa: F401  (imported before the first job, not during it)
    from inference_svc.tokenize_gate import release_free_memory

    try:
        tokenizer = pickle.loads(_read(requests))
        _cap_memory(MEMORY_HEADROOM_BYTES)
        _write(replies, pickle.dumps("ready"))
        while True:
            reply = _reply(_read(requests), tokenizer)
            _write(replies, reply)
            del reply
            release_free_memory()
    except (EOFError, BrokenPipeError):  # the server closed the pipe: done
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
