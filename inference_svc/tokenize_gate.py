"""The bounded front of tokenization: text is checked cheaply, then tokenized on one dedicated thread, metered.

Contract:
- `TokenizeGate.encode(text, ...)` returns the token ids of `text`. Short texts (at most `inline_chars`) are
  encoded inline on the caller's thread: that costs less than a thread hop. Longer ones run on the gate's own
  single worker thread, with the GIL released by the tokenizer (`Tokenizer.encode`), so the event loop and the
  engine thread keep running while a large prompt is tokenized.
- Work is metered in characters: the characters of every long text accepted and not yet finished are summed, and
  a text that would take that sum past `max_pending_chars` is refused at once with `CapacityError` (the gRPC
  layer answers RESOURCE_EXHAUSTED) before any work is done on it. So a flood of large prompts costs at most
  `max_pending_chars` of queued work and one encoding's memory at a time, not one thread and one copy each.
- Meters, owned by the event loop (the only caller), read by tests and metrics: `pending_chars` (long texts
  accepted and not finished), `encoded_chars` (all characters ever handed to the tokenizer), `refused`.
- `close()` stops the worker thread; pending encodings finish first.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

from inference_svc.errors import CapacityError
from shared_model.tokenizer import Tokenizer

INLINE_CHARS = 2048
"""Texts up to this many characters are encoded on the caller's thread (well under a millisecond)."""


class TokenizeGate:
    """Metered, single-worker tokenization for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, max_pending_chars: int, inline_chars: int = INLINE_CHARS) -> None:
        self.tokenizer = tokenizer
        self.max_pending_chars = max_pending_chars
        self.inline_chars = inline_chars
        self.pending_chars = 0
        self.encoded_chars = 0
        self.refused = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenize")

    async def encode(self, text: str, add_bos: bool = False, literal: bool = False) -> list[int]:
        n = len(text)
        if n <= self.inline_chars:
            self.encoded_chars += n
            return self.tokenizer.encode(text, add_bos, literal)
        if self.pending_chars + n > self.max_pending_chars:
            self.refused += 1
            raise CapacityError(
                f"the tokenizer is busy ({self.pending_chars} characters queued, limit {self.max_pending_chars}; "
                f"this text has {n}); retry later"
            )
        loop = asyncio.get_running_loop()
        self.pending_chars += n
        self.encoded_chars += n
        work = self._pool.submit(self.tokenizer.encode, text, add_bos, literal)
        # released when the work really ends (a cancelled caller does not stop an encoding already running)
        work.add_done_callback(lambda _: _call_soon(loop, self._release, n))
        return await asyncio.wrap_future(work)

    def _release(self, n: int) -> None:
        self.pending_chars -= n

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: object, *args: object) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is metering any more
        loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]
