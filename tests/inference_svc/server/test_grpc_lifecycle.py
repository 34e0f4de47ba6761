"""Health follows the lifecycle: NOT_SERVING (and Inference RPCs UNAVAILABLE) from the moment the port is bound
until the model is loaded and warmed up, SERVING then, NOT_SERVING once draining."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from inference_svc.async_engine import AsyncEngine
from inference_svc.client import NO_RETRY, TandemClient
from inference_svc.server import TandemServer
from inference_svc.settings import ServerSettings
from tests.conftest import free_port
from tests.inference_svc.server.conftest import engine_config


def test_not_serving_until_warmed_up(bundle_dir, monkeypatch) -> None:
    gate, warming = threading.Event(), threading.Event()
    original = AsyncEngine.warmup

    def gated_warmup(self, prompt_ids=None) -> None:  # the real warm-up, held back until the test lets it run
        warming.set()
        assert gate.wait(60)
        original(self, prompt_ids)

    monkeypatch.setattr(AsyncEngine, "warmup", gated_warmup)
    port = free_port()
    server = TandemServer(
        ServerSettings(model=str(bundle_dir), port=port, metrics_port=None, http_port=None), engine_config()
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started = asyncio.run_coroutine_threadsafe(server.start(), loop)
    try:
        assert warming.wait(60)
        with TandemClient(f"127.0.0.1:{port}", retry=NO_RETRY, timeout=10) as c:
            assert c.health() == "NOT_SERVING"
            assert c.health("tandem.inference.v1.Inference") == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as info:
                c.generate("hello", max_new_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in info.value.details()
            gate.set()
            started.result(60)
            assert c.health() == "SERVING"
            assert len(c.generate("hello", max_new_tokens=2, ignore_eos=True).token_ids) == 2
            assert server.engine is not None  # test-only fault hook: 50 ms extra per increment of this request
            server.engine.fault_hook = lambda out: time.sleep(0.05) if out.request_id == "slow" else None
            stream = c.generate_stream("hello", request_id="slow", max_new_tokens=60, ignore_eos=True)
            next(stream)
            drained = asyncio.run_coroutine_threadsafe(server.shutdown(grace=0.2), loop)
            deadline = time.monotonic() + 10
            while c.health() != "NOT_SERVING":
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert drained.result(30) == 1  # the open stream was cut at the end of the grace period
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        gate.set()
        if not server.draining:
            asyncio.run_coroutine_threadsafe(server.shutdown(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_the_load_is_frozen_out_of_full_collections_while_serving(bundle_dir) -> None:
    """What the load built (the engine among it) is in no collector generation while the server serves, so a
    full collection never walks it again; it is collectable again once the server stops."""
    import gc

    from tests.inference_svc.server.conftest import make_server

    srv = make_server(bundle_dir)
    try:
        engine = srv.server.engine
        assert gc.get_freeze_count() > 0
        assert not any(o is engine for o in gc.get_objects(generation=2))
        with srv.client(retry=NO_RETRY, timeout=30) as c:  # serving works as before
            assert len(c.generate("hello", max_new_tokens=2, ignore_eos=True).token_ids) == 2
    finally:
        srv.close()
    assert gc.get_freeze_count() == 0
    assert any(o is engine for o in gc.get_objects(generation=2))
