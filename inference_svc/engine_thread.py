"""The one thread that runs a served model's torch work: loading, compiling, warm-up and every decode step.

Contract:
- `EngineThread()` starts one daemon thread named `tandem-engine`. `submit(fn, *args)` queues `fn(*args)` there
  and returns a `concurrent.futures.Future` (RuntimeError after `close()`); `await run(fn, *args)` does the same
  from an event loop. Calls run one at a time, in the order submitted. A long-running call (`AsyncEngine`'s
  engine loop) holds the thread until it returns; calls submitted meanwhile wait for it.
- `ident` is the thread's `threading.get_ident()`. `close()` lets queued calls finish and ends the thread; it does
  not wait for a running call (the engine loop is stopped through its own inbox first).
- Why one thread for all of it: torch's CPU kernels run on OpenMP (libgomp in torch's CPU wheels), and libgomp
  keeps one pool of worker threads per thread that ever started a parallel region, for that thread's lifetime.
  When the workers of all pools outnumber the CPUs, libgomp stops letting idle workers spin between parallel
  regions ("throttled" spinning: about 100 spins, then a futex sleep), so each of the hundreds of parallel regions
  of a decode step waits for its workers to wake. A model loaded on one live thread (the event loop's default
  executor) and stepped on another thus decoded 2-3x slower: on the 2-core VM, the 82M int8 model at 2 threads
  gave 41.7 tok/s against 113.8 tok/s when loaded and stepped on one thread (`benchmarks/engine_thread.py`,
  docs/benchmarks.md §7).
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


class EngineThread:
    """One named daemon thread running submitted calls in order (see the module docstring)."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[tuple[Callable[..., Any], tuple, concurrent.futures.Future] | None]
        self._inbox = queue.SimpleQueue()
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
        self._inbox.put((fn, args, future))
        return future

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the thread, awaited from the running event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def close(self) -> None:
        """End the thread once the queued calls have run (a running call is not waited for); idempotent."""
        if not self._closed:
            self._closed = True
            self._inbox.put(None)

    def _serve(self) -> None:
        while (item := self._inbox.get()) is not None:
            fn, args, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the caller, whatever it is
                future.set_exception(exc)
            else:
                future.set_result(result)
