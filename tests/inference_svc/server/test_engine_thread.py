"""One thread runs a served model's torch work: `EngineThread` itself, and a server that loads, warms up and steps
its engine on that thread (two live threads with OpenMP pools halved decode speed: inference_svc/engine_thread.py)."""

from __future__ import annotations

import threading

import pytest

from inference_svc.async_engine import AsyncEngine
from inference_svc.engine import SamplingParams
from inference_svc.engine_thread import THREAD_NAME, EngineThread
from tests.inference_svc.server.conftest import make_server


def test_engine_thread_runs_calls_in_order_on_one_daemon_thread() -> None:
    thread = EngineThread()
    try:
        seen: list[tuple[int, int]] = []
        futures = [thread.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(20)]
        for f in futures:
            f.result(10)
        assert [i for i, _ in seen] == list(range(20))
        assert {ident for _, ident in seen} == {thread.ident}
        assert thread.ident != threading.get_ident()
        worker = next(t for t in threading.enumerate() if t.ident == thread.ident)
        assert worker.daemon and worker.name == THREAD_NAME
        with pytest.raises(ZeroDivisionError):
            thread.submit(lambda: 1 / 0).result(10)
        assert thread.submit(lambda: "still serving").result(10) == "still serving"  # one failure ends nothing
    finally:
        thread.close()
    worker.join(10)
    assert not worker.is_alive()


def test_server_loads_warms_up_and_steps_on_the_engine_thread(bundle_dir, monkeypatch) -> None:
    warmed_on: list[int] = []
    original = AsyncEngine.warmup

    def recorded_warmup(self, prompt_ids=None) -> None:  # the real warm-up, its thread noted
        warmed_on.append(threading.get_ident())
        original(self, prompt_ids)

    monkeypatch.setattr(AsyncEngine, "warmup", recorded_warmup)
    stepped_on: set[int] = set()
    srv = make_server(bundle_dir, fault_hook=lambda out: stepped_on.add(threading.get_ident()))
    try:
        with srv.client(timeout=60) as c:
            assert len(c.generate([5, 6, 7], max_new_tokens=4, ignore_eos=True).token_ids) == 4
        engine = srv.server.engine
        assert engine is not None and engine.thread is not None
        ident = engine.thread.ident
        assert engine.engine.thread_ident == ident  # Engine.from_bundle ran there
        assert warmed_on == [ident]
        assert stepped_on == {ident}
        assert ident not in (threading.get_ident(), srv._thread.ident)  # neither the caller nor the event loop
    finally:
        srv.close()


def test_one_queue_a_call_submitted_while_serving_runs_between_steps(bundle_dir) -> None:
    """The engine thread has one queue: a call submitted to it while the engine loop holds the thread is run by
    that loop between two steps, on the engine thread, even while a stream decodes (with a second queue inside
    the loop, the call waited behind the loop until the server stopped: this `result(30)` timed out)."""
    srv = make_server(bundle_dir)
    try:
        engine = srv.server.engine
        assert engine is not None and engine.thread is not None
        thread = engine.thread
        assert thread.submit(threading.get_ident).result(30) == thread.ident  # idle loop

        async def during_a_stream() -> tuple[int, int]:
            stream = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=24, ignore_eos=True), request_id="s")
            await anext(stream)  # decoding
            ident = await thread.run(threading.get_ident)
            n = 1
            async for _ in stream:
                n += 1
            return ident, n

        ident, n = srv.call(during_a_stream(), timeout=60)
        assert ident == thread.ident and n >= 2
    finally:
        srv.close()


def test_a_closed_engine_thread_refuses_work() -> None:
    thread = EngineThread()
    thread.close()
    thread.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        thread.submit(lambda: None)
