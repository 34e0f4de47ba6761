"""A tokenizer in a child process: long texts are tokenized off the server's GIL, CPU priority and heap.

Contract:
- `TokenizerProcess(tokenizer)` owns at most one child, `python -m inference_svc.tokenizer_process`, started by
  `start()` or by the first `call`. The child holds its own copy of the tokenizer (sent pickled when it starts)
  and runs at a lower CPU priority (`NICE` steps), so on a busy machine the server's decode loop gets the cores
  first. It imports neither torch nor gRPC, and is ready in well under a second.
- `call(job, *args)` runs `job(tokenizer, *args)` in the child and returns its result. `job` is a module-level
  function (`inference_svc.tokenizer_jobs`), pickled by name; arguments and result travel pickled over the
  child's stdin and stdout, one call at a time. Callers serialize their calls: the gate's one worker thread is
  the only caller. The call blocks with the GIL released while the child works.
- An exception the job raises is raised again by `call`, with its type and attributes (`InvalidRequestError`
  keeps its `field`); one that does not pickle arrives as a `RequestFailedError` carrying its text.
- If the child dies mid-call (killed, out of memory), that call raises `RequestFailedError` naming its exit
  status, and the next call starts a new child (`starts` counts them). Failure to start at all raises
  `TokenizerProcessError`; the gate then tokenizes on its own thread.
- After each call the child hands freed heap pages back to the system, so its memory between calls is its
  baseline, not its largest text.
- The child ends when its stdin closes: at `close()`, or when the server process ends, however it ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from inference_svc.errors import InferenceError, RequestFailedError

log = logging.getLogger(__name__)

NICE = 10
"""How many steps below the server's CPU priority the child runs."""
START_TIMEOUT_S = 60.0
"""How long a new child may take to import and load the tokenizer before it counts as failed to start."""
_HEADER = struct.Struct("<Q")  # the byte length of the pickled frame that follows
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])  # the folder holding inference_svc/ and shared_model/


class TokenizerProcessError(InferenceError):
    """The tokenizer process could not be started."""


class TokenizerProcess:
    """One child process that runs tokenizer jobs (see the module docstring)."""

    def __init__(self, tokenizer: Any, nice: int = NICE) -> None:
        self._payload = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        self.nice = nice
        self.starts = 0
        """Children started so far (more than one means a child died and was replaced)."""
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # start/close from another thread than the caller's

    @property
    def pid(self) -> int | None:
        """The running child's process id, or None."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the child unless one is running; `TokenizerProcessError` when it cannot start."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return
            self._proc = None
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
            cmd = [sys.executable, "-m", "inference_svc.tokenizer_process", str(self.nice)]
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            except OSError as exc:
                raise TokenizerProcessError(f"cannot start the tokenizer process ({exc})") from exc
            assert proc.stdin is not None and proc.stdout is not None
            timer = threading.Timer(START_TIMEOUT_S, proc.kill)  # a child that hangs at start-up is ended
            timer.start()
            try:
                _write(proc.stdin, self._payload)
                ready = _read(proc.stdout)
            except (OSError, EOFError) as exc:
                proc.kill()
                status = proc.wait()
                raise TokenizerProcessError(f"the tokenizer process exited at start-up ({_status(status)})") from exc
            finally:
                timer.cancel()
            if pickle.loads(ready) != "ready":
                proc.kill()
                raise TokenizerProcessError("the tokenizer process answered its start-up with something else")
            self._proc = proc
            self.starts += 1
            if self.starts > 1:
                log.warning("tokenizer process restarted (pid %d, start %d)", proc.pid, self.starts)

    def call(self, job: Callable[..., Any], *args: Any) -> Any:
        """`job(tokenizer, *args)` run in the child (see the module docstring)."""
        self.start()
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            _write(proc.stdin, pickle.dumps((job, args), protocol=pickle.HIGHEST_PROTOCOL))
            reply = _read(proc.stdout)
        except (OSError, EOFError):
            proc.kill()
            status = proc.wait()
            with self._lock:
                if self._proc is proc:
                    self._proc = None
            log.error("tokenizer process %d exited while working (%s)", proc.pid, _status(status))
            raise RequestFailedError(
                f"the tokenizer process exited while tokenizing this text ({_status(status)}); retry", logged=True
            ) from None
        ok, value = pickle.loads(reply)
        if ok:
            return value
        raise value

    def close(self) -> None:
        """End the child: its stdin closes and it exits; killed if it has not within a few seconds."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


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
def _reply(job: Callable[..., Any], tokenizer: Any, args: tuple[Any, ...]) -> bytes:
    try:
        return pickle.dumps((True, job(tokenizer, *args)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        try:
            reply = pickle.dumps((False, exc), protocol=pickle.HIGHEST_PROTOCOL)
            pickle.loads(reply)  # an exception pickles by its args, which its constructor may not take back
            return reply
        except Exception:
            failure = RequestFailedError(f"tokenizer job {getattr(job, '__name__', job)!r} failed: {exc}")
            return pickle.dumps((False, failure), protocol=pickle.HIGHEST_PROTOCOL)


def main(argv: list[str]) -> int:
    """The child's loop: read the tokenizer, answer "ready", then one reply per job until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    with contextlib.suppress(OSError):
        os.nice(int(argv[0]) if argv else NICE)
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    import inference_svc.tokenizer_jobs  # noqa: F401  (imported before the first job, not during it)
    from inference_svc.tokenize_gate import release_free_memory

    try:
        tokenizer = pickle.loads(_read(requests))
        _write(replies, pickle.dumps("ready"))
        while True:
            job, args = pickle.loads(_read(requests))
            reply = _reply(job, tokenizer, args)
            del job, args
            _write(replies, reply)
            del reply
            release_free_memory()
    except (EOFError, BrokenPipeError):  # the server closed the pipe: done
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
