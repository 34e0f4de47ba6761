"""The bounded front of tokenization: long texts are tokenized one at a time, in a child process, metered in characters.

Contract:
- `TokenizeGate.run(chars, job, *args)` returns `job(tokenizer, *args)`, a job of `inference_svc.tokenizer_jobs`
  (encode a prompt, build a Tokenize response, render and encode a chat, decode ids) metered as `chars`
  characters of tokenizer work; `encode(text, add_bos)` is `run` of the encode job.
- Short work (at most `inline_chars`) runs inline on the caller's thread: that costs less than any hop. Jobs in
  `tokenizer_jobs.OFF_LOOP` (a chat template's render, whose cost the input does not bound) never do.
- Longer work goes to the gate's single worker thread, which hands it to a `TokenizerProcess`: a child process at
  lower CPU priority with its own copy of the tokenizer. So a large text costs the server's process no GIL time
  and no heap beyond the text and the result, and on a busy machine the decode loop gets the cores first.
  `process=False` (or a child that cannot start, logged once) runs it on the worker thread instead, where
  `Tokenizer.encode` still releases the GIL while it works. `start()` starts the child ahead of the first long
  text, in the background.
- Work is metered in characters: the characters of every long text accepted and not yet finished are summed, and
  a text that would take that sum past `max_pending_chars` is refused at once with `CapacityError` (the gRPC
  layer answers RESOURCE_EXHAUSTED) before any work is done on it; a text longer than the whole budget could
  never pass and gets `InvalidRequestError` naming `field` instead. So a flood of large texts costs at most
  `max_pending_chars` of queued work and one encoding at a time, not one thread and one copy each.
  `refusal(n, at_least=True)` tells the same from a lower bound on a text's length, for a request refused from
  its wire bytes before it is parsed.
  A caller that is cancelled does not stop work already running: its characters stay counted until it ends.
- After long texts finish or are refused (`trim_soon`, also called by the async engine when it refuses a text
  unread), the gate asks the C allocator to hand freed memory back to the system (glibc's `malloc_trim`, a second
  later, on the worker thread, once none is in flight; nothing elsewhere): a burst of large requests leaves many
  freed pages behind that the allocator would otherwise keep. The child trims its own heap after every job.
- Meters, owned by the event loop (the only caller), read by tests and reported to `on_meter` (the Prometheus
  metrics) on every change: `pending_chars` (long texts accepted and not finished), `encoded_chars` (all
  characters ever handed to the tokenizer), and `refused`.
- `close()` stops the worker thread, then the child; accepted work finishes first, for up to `CLOSE_GRACE_S`,
  after which work still queued is cancelled and the child is killed (its job fails), so that a shutdown never
  hangs on it. A job in the child is also killed after a bound scaled by its characters (`CALL_TIMEOUT_S`,
  `CALL_TIMEOUT_S_PER_CHAR`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from inference_svc import tokenizer_jobs
from inference_svc.errors import CapacityError, InferenceError, InvalidRequestError
from inference_svc.tokenizer_process import TokenizerProcess, TokenizerProcessError
from shared_model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

INLINE_CHARS = 2048
"""Texts up to this many characters are encoded on the caller's thread (well under a millisecond)."""
CALL_TIMEOUT_S = 60.0
CALL_TIMEOUT_S_PER_CHAR = 60e-6
"""A job in the tokenizer process is killed after `CALL_TIMEOUT_S` plus this per character (about 60x what a
tokenizer needs on one core): only a hung child takes that long."""
CLOSE_GRACE_S = 10.0
"""How long `close()` lets accepted work finish before it kills the tokenizer process."""
TRIM_DELAY_S = 1.0
"""How long after the last long text the allocator is trimmed (the responses are sent and freed by then)."""


class TokenizeGate:
    """Metered, single-worker tokenization for one tokenizer (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_pending_chars: int,
        inline_chars: int = INLINE_CHARS,
        on_meter: Callable[[int, int], None] | None = None,
        process: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self._on_meter = on_meter  # (pending_chars, encoded_chars) after each change, e.g. to the metrics
        self.max_pending_chars = max_pending_chars
        self.inline_chars = inline_chars
        self.pending_chars = 0
        self.encoded_chars = 0
        self.refused = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenize")
        self.process: TokenizerProcess | None = TokenizerProcess(tokenizer) if process else None
        """Where long work runs (None: on the worker thread); used and, on a failed start, dropped by the worker."""
        self._closed = False
        self._trim_timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start the tokenizer process in the background, so that the first long text does not wait for it."""
        if self.process is not None:
            self._pool.submit(self._start_process)

    async def encode(self, text: str, add_bos: bool = False, field: str = "prompt") -> list[int]:
        """Ids of `text`; `field` names the request field in an error (see the module docstring)."""
        return await self.run(len(text), tokenizer_jobs.encode, text, add_bos, field=field)

    async def run(self, n: int, job: Callable[..., Any], *args: Any, field: str = "prompt") -> Any:
        """`job(tokenizer, *args)` metered as tokenizing `n` characters: inline when short, else in the tokenizer
        process (or on the worker) within the budget, refused beyond it (see the module docstring)."""
        if n <= self.inline_chars and job not in tokenizer_jobs.OFF_LOOP:
            self.encoded_chars += n
            self._meter()
            return job(self.tokenizer, *args)
        refusal = self.refusal(n, field)
        if refusal is not None:
            raise refusal
        loop = asyncio.get_running_loop()
        self.pending_chars += n
        self.encoded_chars += n
        self._meter()
        future = self._pool.submit(self._work, job, args, CALL_TIMEOUT_S + n * CALL_TIMEOUT_S_PER_CHAR)
        future.add_done_callback(lambda _: _call_soon(loop, self._release, n))
        return await asyncio.wrap_future(future)

    def refusal(self, n: int, field: str = "prompt", at_least: bool = False) -> InferenceError | None:
        """The error `run` gives a text of `n` characters now (`at_least`: of `n` or more, a bound read from a
        request's bytes before it is parsed), counted as a refusal; None when it would be accepted."""
        if n <= self.inline_chars:
            return None
        chars = f"at least {n} characters" if at_least else f"{n} characters"
        if n > self.max_pending_chars:  # could never pass: not a reason to retry
            self.trim_soon()
            return InvalidRequestError(
                field, f"{chars} are more than the server tokenizes at once ({self.max_pending_chars})"
            )
        if self.pending_chars + n > self.max_pending_chars:
            self.refused += 1
            self.trim_soon()
            return CapacityError(
                f"the tokenizer is busy ({self.pending_chars} characters queued, limit {self.max_pending_chars}; "
                f"this text has {chars}); retry later"
            )
        return None

    # -- the worker thread
    def _start_process(self) -> None:
        if self.process is None:
            return
        try:
            self.process.start()
        except TokenizerProcessError as exc:
            log.error("%s: tokenizing long texts on the server's own thread instead", exc)
            self.process = None

    def _work(self, job: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
        self._start_process()
        if self.process is not None:
            return self.process.call(job, *args, timeout=timeout)
        return job(self.tokenizer, *args)

    def _meter(self) -> None:
        if self._on_meter is not None:
            self._on_meter(self.pending_chars, self.encoded_chars)

    def _release(self, n: int) -> None:
        self.pending_chars -= n
        self._meter()
        self.trim_soon()

    def trim_soon(self) -> None:
        """Trim the C heap `TRIM_DELAY_S` from now, on the worker, once no long text is in flight (one timer at a
        time). Called after long texts end or are refused, whoever refused them: their buffers die with the RPC."""
        if self._trim_timer is None and not self._closed:
            self._trim_timer = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._trim)

    def _trim(self) -> None:
        self._trim_timer = None
        if self.pending_chars:  # the last one to finish schedules it again
            return
        with contextlib.suppress(RuntimeError):  # shut down in the meantime
            self._pool.submit(release_free_memory)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._trim_timer is not None:
            self._trim_timer.cancel()
        drained = self._pool.submit(lambda: None)  # done once all work accepted before it is done (one worker)
        try:
            drained.result(timeout=CLOSE_GRACE_S)
        except FutureTimeout:  # work still running: queued work cancelled, the child's job ended with the child
            self._pool.shutdown(wait=False, cancel_futures=True)
            if self.process is not None:
                self.process.kill()
        self._pool.shutdown(wait=True)
        if self.process is not None:
            self.process.close()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_memory() -> bool:
    """Return the C heap's free pages to the system where the allocator can (glibc); False elsewhere."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is metering any more
        loop.call_soon_threadsafe(fn, *args)
