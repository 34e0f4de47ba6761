"""The one thread that runs a served model's torch work: loading, compiling, warm-up and every decode step.

Contract:
- `EngineThread()` starts one daemon thread named `tandem-engine`, and owns the thread's one queue, `inbox`.
  `submit(fn, *args)` queues `fn(*args)` there as a `Call` and returns a `concurrent.futures.Future`
  (RuntimeError after `close()`); `await run(fn, *args)` does the same from an event loop. Calls run one at a
  time, in the order queued.
- One queue for everything the thread does: while a long-running call holds the thread (`AsyncEngine`'s engine
  loop), that loop drains `inbox` itself: the engine commands put with `put` (add, abort, stop) and the `Call`s
  submitted meanwhile, which it runs between two steps (`Call.run`), at most `MAX_COMMANDS_PER_STEP` of them
  per step. A command put when no such loop runs is dropped (only a late abort can be).
- `ident` is the thread's `threading.get_ident()`. `close()` lets queued calls finish and ends the thread; it does
  not wait for a running call (the engine loop is stopped through the inbox first).
- Why one thread for all of it: torch's CPU kernels run on OpenMP (libgomp in torch's CPU wheels), and libgomp
  keeps one pool of worker threads per thread that ever started a parallel region, for that thread's lifetime.
  When the workers of all pools outnumber the CPUs, libgomp stops letting idle workers spin between parallel
  regions ("throttled" spinning: about 100 spins, then a futex sleep), so each of the hundreds of parallel regions
  of a decode step waits for its workers to wake. A model loaded on one live thread (the event loop's default
  executor) and stepped on another thus decoded several times slower (`benchmarks/engine_thread.py`; the figures
  are in docs/benchmarks.md §14).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

THREAD_NAME = "tandem-engine"


class Call:
    """`fn(*args)` to run on the engine thread, and the future its result or exception goes to."""

    __slots__ = ("args", "fn", "future")

    def __init__(self, fn: Callable[..., Any], args: tuple, future: concurrent.futures.Future) -> None:
        self.fn, self.args, self.future = fn, args, future

    def run(self) -> None:
        """Run it (unless its future was cancelled) and settle the future; never raises."""
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args)
        except BaseException as exc:  # handed to the caller, whatever it is
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


class EngineThread:
    """One named daemon thread running submitted calls in order (see the module docstring)."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        """The thread's one queue: `Call`s, the engine loop's commands, and None (the end)."""
        # a daemon thread, unlike ThreadPoolExecutor's: an engine loop still running at exit must not block it
        self._thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
        self._thread.start()
        assert self._thread.ident is not None
        self.ident: int = self._thread.ident
        """The thread's `threading.get_ident()`."""
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue `fn(*args)` on the thread; its future. RuntimeError once `close()` was called."""
        if self._closed:
            raise RuntimeError("the engine thread is closed")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.inbox.put(Call(fn, args, future))
        return future

    def put(self, command: object) -> None:
        """Queue a command for the loop that holds the thread (`AsyncEngine`'s engine loop); never raises (a
        command put after `close()` is never read)."""
        self.inbox.put(command)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the thread, awaited from the running event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def close(self) -> None:
        """End the thread once the queued calls have run (a running call is not waited for); idempotent."""
        if not self._closed:
            self._closed = True
            self.inbox.put(None)

    def _serve(self) -> None:
        while (item := self.inbox.get()) is not None:
            if isinstance(item, Call):
                item.run()
            # else: a command for an engine loop that no longer runs (a late abort): nothing to do
