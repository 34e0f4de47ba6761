"""The bounded front of tokenization: text is tokenized on one dedicated thread, metered in characters.

Contract:
- `TokenizeGate.encode(text, add_bos, build)` returns the token ids of `text`, or `build(ids)` when a
  `build` is given (e.g. the Tokenize RPC's response with every token's string), computed on the same thread.
  `run(chars, work)` meters any other tokenizer work the same way (a chat rendered and encoded).
  Short texts (at most `inline_chars`) run inline on the caller's thread: that costs less than a thread hop.
  Longer ones run on the gate's own single worker thread, with the GIL released by the tokenizer while it works
  (`Tokenizer.encode`), so the event loop and the engine thread keep running while a large text is tokenized.
- Work is metered in characters: the characters of every long text accepted and not yet finished are summed, and
  a text that would take that sum past `max_pending_chars` is refused at once with `CapacityError` (the gRPC
  layer answers RESOURCE_EXHAUSTED) before any work is done on it; a text longer than the whole budget could
  never pass and gets `InvalidRequestError` naming `field` instead. So a flood of large texts costs at most
  `max_pending_chars` of queued work and one encoding's memory at a time, not one thread and one copy each.
  A caller that is cancelled does not stop an encoding already running: its characters stay counted until it ends.
- After long texts finish or are refused (`trim_soon`, also called by the async engine when it refuses a text
  unread), the gate asks the C allocator to hand freed memory back to the system (glibc's `malloc_trim`, a second
  later, on the worker thread, once none is in flight; nothing elsewhere): a burst of large requests leaves many
  freed pages behind that the allocator would otherwise keep.
- Meters, owned by the event loop (the only caller), read by tests and reported to `on_meter` (the Prometheus
  metrics) on every change: `pending_chars` (long texts accepted and not finished), `encoded_chars` (all
  characters ever handed to the tokenizer), and `refused`.
- `close()` stops the worker thread; pending encodings finish first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from inference_svc.errors import CapacityError, InvalidRequestError
from shared_model.tokenizer import Tokenizer

INLINE_CHARS = 2048
"""Texts up to this many characters are encoded on the caller's thread (well under a millisecond)."""
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
    ) -> None:
        self.tokenizer = tokenizer
        self._on_meter = on_meter  # (pending_chars, encoded_chars) after each change, e.g. to the metrics
        self.max_pending_chars = max_pending_chars
        self.inline_chars = inline_chars
        self.pending_chars = 0
        self.encoded_chars = 0
        self.refused = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenize")
        self._closed = False
        self._trim_timer: asyncio.TimerHandle | None = None

    async def encode(
        self,
        text: str,
        add_bos: bool = False,
        build: Callable[[list[int]], Any] | None = None,
        field: str = "prompt",
    ) -> Any:
        """Ids of `text` (or `build(ids)`); `field` names the request field in an error (see the module docstring)."""
        return await self.run(len(text), functools.partial(_encode, self.tokenizer, text, add_bos, build), field)

    async def run(self, n: int, work: Callable[[], Any], field: str = "prompt") -> Any:
        """`work()` metered as tokenizing `n` characters (e.g. rendering and encoding a chat): inline when short,
        else on the gate's worker within the budget, refused like `encode` beyond it."""
        if n <= self.inline_chars:
            self.encoded_chars += n
            self._meter()
            return work()
        if n > self.max_pending_chars:  # could never pass: not a reason to retry
            self.trim_soon()
            raise InvalidRequestError(
                field, f"{n} characters are more than the server tokenizes at once ({self.max_pending_chars})"
            )
        if self.pending_chars + n > self.max_pending_chars:
            self.refused += 1
            self.trim_soon()
            raise CapacityError(
                f"the tokenizer is busy ({self.pending_chars} characters queued, limit {self.max_pending_chars}; "
                f"this text has {n}); retry later"
            )
        loop = asyncio.get_running_loop()
        self.pending_chars += n
        self.encoded_chars += n
        self._meter()
        future = self._pool.submit(work)
        future.add_done_callback(lambda _: _call_soon(loop, self._release, n))
        return await asyncio.wrap_future(future)

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
        self._closed = True
        if self._trim_timer is not None:
            self._trim_timer.cancel()
        self._pool.shutdown(wait=True)


def _encode(tokenizer: Tokenizer, text: str, add_bos: bool, build: Callable[[list[int]], Any] | None) -> Any:
    ids = tokenizer.encode(text, add_bos)
    return ids if build is None else build(ids)


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
