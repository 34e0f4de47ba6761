"""The engine wedge (issue 34): a request is validated and admitted whole or refused whole before any engine
work, one that can never fit gets 400 / INVALID_ARGUMENT naming the parameter (429 only for one that would fit an
emptier queue), and a flood of commands cannot keep the engine thread from stepping.

"No engine work" is read from the engine's own counters (`Engine.stats().prompt_tokens_total` counts every prompt
token ever added to the engine), never from timing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest

from inference_svc.async_engine import MAX_COMMANDS_PER_STEP
from inference_svc.client import NO_RETRY
from inference_svc.engine.types import SamplingParams
from inference_svc.settings import AdmissionLimits
from tests.inference_svc.server.conftest import ServerThread, make_server, wait_idle


@pytest.fixture(scope="module")
def http_server(bundle_dir: Path) -> Iterator[ServerThread]:
    srv = make_server(bundle_dir, http_port=0)  # the default queue: 256 requests
    yield srv
    srv.close()


def _post(srv: ServerThread, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{srv.server.http_port}{path}", json=body, timeout=60)


def _engine_tokens(srv: ServerThread) -> int:
    return wait_idle(srv).prompt_tokens_total


def test_17_prompts_times_n16_is_400_naming_n_with_no_engine_work(http_server: ServerThread) -> None:
    before = _engine_tokens(http_server)
    body = {"prompt": [f"def f{i}(x):\n    return x" for i in range(17)], "n": 16, "max_tokens": 4}
    r = _post(http_server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and err["code"] == "INVALID_ARGUMENT"
    assert "272 sequences" in err["message"] and "256" in err["message"]
    assert _engine_tokens(http_server) == before  # not one prompt reached the engine
    ok = _post(http_server, {"prompt": ["a = 1", "b = 2"], "n": 2, "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
    assert _engine_tokens(http_server) > before


def test_a_prompt_list_longer_than_the_queue_is_400_naming_prompt(http_server: ServerThread) -> None:
    before = _engine_tokens(http_server)
    r = _post(http_server, {"prompt": [[5, 6, 7]] * 257, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert _engine_tokens(http_server) == before


def test_a_bad_token_id_in_a_later_prompt_refuses_the_whole_request_unrun(http_server: ServerThread) -> None:
    before = _engine_tokens(http_server)
    vocab = http_server.server.engine.engine.model_config.vocab_size  # type: ignore[union-attr]
    body = {"prompt": [[5, 6, 7] * 30, [8, 9] * 40, [1, vocab]], "n": 2, "max_tokens": 4}
    r = _post(http_server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and str(vocab) in r.json()["error"]["message"]
    assert _engine_tokens(http_server) == before  # the first two prompts were never prefilled
    # a sampling parameter the engine refuses (max_tokens above its limit) is also refused before any prefill
    limit = http_server.server.engine.engine.config.max_new_tokens_limit  # type: ignore[union-attr]
    r = _post(http_server, {"prompt": ["a", "b"], "max_tokens": limit + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert _engine_tokens(http_server) == before


def test_429_only_for_what_an_emptier_queue_would_take(bundle_dir: Path) -> None:
    srv = make_server(bundle_dir, http_port=0, admission=AdmissionLimits(max_queued_requests=8))
    release, entered = threading.Event(), threading.Event()

    def park() -> None:
        entered.set()
        release.wait(30)

    try:
        engine = srv.server.engine
        assert engine is not None
        before = _engine_tokens(srv)
        # never fits: 3 prompts x n=4 = 12 > 8, on an idle server: 400 naming n, not "queue full; retry later"
        r = _post(srv, {"prompt": ["a", "b", "c"], "n": 4, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        with srv.client(timeout=30, retry=NO_RETRY) as c, pytest.raises(grpc.RpcError) as info:
            c.generate("x = 1", max_new_tokens=2, n=9)  # gRPC: n=9 > 8 can never be queued
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("n: ")
        assert _engine_tokens(srv) == before
        # fits an empty queue: 2 x 4 = 8; with one request already waiting it gets 429, and nothing of it is kept
        srv.submit(engine.run_in_engine(park))
        assert entered.wait(10)
        first = srv.submit(_post_async(srv, {"prompt": "x", "max_tokens": 2}))
        deadline = time.monotonic() + 30
        while engine.num_in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = _post(srv, {"prompt": ["a", "b"], "n": 4, "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "RESOURCE_EXHAUSTED", r.text
        assert engine.num_in_flight == 1  # the refused request left nothing behind
        release.set()
        assert first.result(30) == 200
        r = _post(srv, {"prompt": ["a", "b"], "n": 4, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 8
    finally:
        release.set()
        srv.close()


async def _post_async(srv: ServerThread, body: dict) -> int:
    async with httpx.AsyncClient(timeout=30) as c:
        return (await c.post(f"http://127.0.0.1:{srv.server.http_port}/v1/completions", json=body)).status_code


def test_a_flood_of_commands_is_applied_in_bounded_batches_between_steps(bundle_dir: Path) -> None:
    """With N commands queued while a stream runs, the engine thread steps after at most MAX_COMMANDS_PER_STEP of
    them (the old loop drained the whole inbox first: its first step saw an empty inbox)."""
    n = 300
    srv = make_server(bundle_dir, admission=AdmissionLimits(max_queued_requests=n + 8))
    engine = srv.server.engine
    assert engine is not None
    inbox_at_step: list[int] = []
    step = engine.engine.step

    def recorded_step():  # the real step; the inbox's length when it starts is noted
        inbox_at_step.append(engine.thread.inbox.qsize())
        return step()

    engine.engine.step = recorded_step
    release, entered = threading.Event(), threading.Event()

    def park() -> None:
        entered.set()
        release.wait(30)

    async def flood() -> tuple[int, list[int]]:
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        running = engine.generate([5, 6, 7], params, request_id="bystander")
        await anext(running)  # the bystander is decoding
        parked = asyncio.ensure_future(engine.run_in_engine(park))
        assert await asyncio.to_thread(entered.wait, 10)
        gens = [engine.generate([5, 6, 7], SamplingParams(max_new_tokens=1), request_id=f"f{i}") for i in range(n)]
        firsts = [asyncio.ensure_future(anext(g)) for g in gens]
        for _ in range(1000):  # bounded: every flood request has queued its add
            if engine.thread.inbox.qsize() >= n:
                break
            await asyncio.sleep(0.005)
        queued = engine.thread.inbox.qsize()
        inbox_at_step.clear()
        release.set()
        await parked
        await asyncio.gather(*firsts)
        for g in gens:
            async for _ in g:
                pass
        async for _ in running:
            pass
        return queued, list(inbox_at_step)

    try:
        queued, seen = srv.call(flood(), timeout=120)
        assert queued >= n
        assert seen, "no step ran"
        assert seen[0] >= queued - MAX_COMMANDS_PER_STEP, f"the first step came after {queued - seen[0]} commands"
        assert engine.largest_command_batch <= MAX_COMMANDS_PER_STEP
        wait_idle(srv)
    finally:
        release.set()
        engine.engine.step = step
        srv.close()
