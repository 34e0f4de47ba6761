"""Cancellation, disconnects and deadlines free KV blocks; the load test with faults (64 concurrent streams, 20%
cancelled at random points, 10% given short deadlines) keeps every other request exactly greedy."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from inference_svc.client import NO_RETRY, AsyncTandemClient
from inference_svc.proto_gen import inference_pb2 as pb
from tests.inference_svc.server.conftest import ServerThread, engine_config, make_server, wait_idle

PROMPT = "class Reader:\n    def read(self, size=-1):\n        "


def test_cancel_frees_blocks_at_next_step(client, server: ServerThread, slow_steps) -> None:
    stream = client.generate_stream(PROMPT, request_id="slow-cancel", max_new_tokens=60, ignore_eos=True)
    got = [next(stream), next(stream)]
    assert server.stats().kv_blocks_used > 0
    stream.close()  # client-side cancel
    st = wait_idle(server)
    assert st.kv_blocks_used == 0
    assert sum(len(m.token_ids) for m in got) >= 2


def test_disconnect_frees_blocks(server: ServerThread) -> None:
    channel = grpc.insecure_channel(server.target)
    from inference_svc.proto_gen import inference_pb2_grpc as pb_grpc

    req = pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_new_tokens=60, ignore_eos=True))
    it = pb_grpc.InferenceStub(channel).GenerateStream(req, timeout=30)
    next(it)
    channel.close()  # the whole connection goes away
    wait_idle(server)


def test_deadline_mid_decode(client, server: ServerThread, slow_steps) -> None:
    """The engine is held at the stream's second increment (the first one delivered) until the client has seen its
    deadline expire, so the deadline falls mid-decode on a machine of any speed (the timeout only has to cover the
    first token)."""
    engine = server.server.engine
    assert engine is not None
    expired, seen = threading.Event(), []

    def hold_after_first(out) -> None:
        if out.request_id == "slow-1":
            seen.append(out)
            if len(seen) == 2:
                expired.wait(60)

    slow, engine.fault_hook = engine.fault_hook, hold_after_first
    received = []
    try:
        with pytest.raises(grpc.RpcError) as info:
            for msg in client.generate_stream(PROMPT, request_id="slow-1", max_new_tokens=60, ignore_eos=True,
                                              timeout=5):  # fmt: skip
                received.append(msg)
    finally:
        expired.set()
        engine.fault_hook = slow
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert received, "the deadline should have hit mid-decode, after some tokens"
    assert sum(len(m.token_ids) for m in received) < 60
    wait_idle(server)
    with pytest.raises(grpc.RpcError) as info:
        client.generate(PROMPT, request_id="slow-2", max_new_tokens=60, ignore_eos=True, timeout=0.4)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(server)


def test_deadline_while_queued(server: ServerThread) -> None:
    """The engine is parked, so the request never leaves the queue before its deadline."""
    release, entered = threading.Event(), threading.Event()

    def park() -> None:
        entered.set()
        release.wait(30)

    before = server.stats().generation_tokens_total  # (stats go through the engine thread: read them before parking it)
    assert server.server.engine is not None
    server.submit(server.server.engine.run_in_engine(park))
    assert entered.wait(10)
    with server.client(retry=NO_RETRY) as c, pytest.raises(grpc.RpcError) as info:
        c.generate(PROMPT, max_new_tokens=10, timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    release.set()
    st = wait_idle(server)
    # it reached the engine only after its deadline: dropped from the queue before any token was generated
    assert st.generation_tokens_total == before
    with server.client() as c:
        assert c.health() == "SERVING"


def test_engine_enforces_deadline_itself(server: ServerThread, slow_steps) -> None:
    """The async engine aborts on its own deadline (even if no gRPC cancellation arrives) → DeadlineExceededError."""
    from inference_svc.engine.types import SamplingParams
    from inference_svc.errors import DeadlineExceededError

    engine = server.server.engine
    assert engine is not None

    async def run() -> int:
        n = 0
        with pytest.raises(DeadlineExceededError):
            async for out in engine.generate(
                PROMPT,
                SamplingParams(max_new_tokens=60, ignore_eos=True),
                request_id="slow-3",
                deadline=time.monotonic() + 0.3,
            ):
                n += len(out.new_token_ids)
        return n

    assert server.call(run()) < 60
    wait_idle(server)


# ------------------------------------------------------------------------------ load with faults
PROMPTS = [
    "import os\nimport sys\n\ndef main(argv):\n    ",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = ",
    "for i in range(10):\n    print(",
    '"""Utilities for parsing command lines."""\n\nfrom __future__ import annotations\n',
    "def _read(self, n):\n    data = self.sock.recv(n)\n    if not data:\n        raise",
    "try:\n    import json\nexcept ImportError:\n    json = None\n",
    "x = {'a': 1, 'b': 2}\nfor key, value in x.items():\n    ",
    "# Copyright 2001 Python Software Foundation\n",
]


@pytest.fixture(
    params=[
        pytest.param(False, id="no-prefix-cache"),
        pytest.param(True, id="prefix-cache"),
    ]
)
def load_server(bundle_dir, request) -> Iterator[ServerThread]:
    srv = make_server(bundle_dir, engine=engine_config(kv_cache_memory="4MiB", enable_prefix_caching=request.param))
    yield srv
    srv.close()


def test_load_with_faults(load_server: ServerThread) -> None:
    srv = load_server
    rng = random.Random(1234)
    max_new = {i: 10 + 2 * i for i in range(len(PROMPTS))}
    with srv.client() as c:  # each prompt's greedy output when it runs alone
        alone = {i: list(c.generate(p, max_new_tokens=max_new[i]).token_ids) for i, p in enumerate(PROMPTS)}
    n = 64
    kinds = ["cancel"] * 13 + ["deadline"] * 6 + ["normal"] * (n - 19)
    rng.shuffle(kinds)
    plan = [(k, rng.randrange(len(PROMPTS)), rng.randint(0, 6), rng.uniform(0.02, 0.4)) for k in kinds]

    async def one(c: AsyncTandemClient, kind: str, p: int, cancel_after: int, deadline: float) -> tuple[str, object]:
        tokens: list[int] = []
        timeout = deadline if kind == "deadline" else 120.0
        try:
            async for msg in c.generate_stream(PROMPTS[p], max_new_tokens=max_new[p], timeout=timeout):
                tokens += msg.token_ids
                if kind == "cancel" and len(tokens) >= cancel_after:
                    return "cancelled", tokens  # leaving the loop cancels the RPC
                if msg.finish_reason is not None:
                    return "done", tokens
        except grpc.aio.AioRpcError as exc:
            return "error", exc.code()
        return "done", tokens

    async def main() -> list[tuple[str, object]]:
        async with AsyncTandemClient(srv.target, timeout=120) as c:
            return await asyncio.gather(*(one(c, *args) for args in plan))

    t0 = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    completed = 0
    for (kind, p, _, _), (outcome, value) in zip(plan, results, strict=True):
        if kind == "normal":
            assert outcome == "done", (kind, outcome, value)
            assert value == alone[p], f"prompt {p}: {value} != alone {alone[p]}"
            completed += 1
        elif kind == "deadline":
            assert outcome == "done" or value == grpc.StatusCode.DEADLINE_EXCEEDED, (outcome, value)
            if outcome == "done":
                assert value == alone[p]
        else:
            assert outcome in ("cancelled", "done"), (outcome, value)
            assert value == alone[p][: len(value)]  # cancelled streams were exact up to where they stopped
    assert completed == kinds.count("normal")
    st = wait_idle(srv)
    assert st.kv_blocks_used == 0  # only evictable cached-prefix blocks may remain
    with srv.client() as c:
        assert c.health() == "SERVING"
    print(f"load: {n} streams in {elapsed:.1f} s, prefix hit rate {st.prefix_cache_hit_rate:.2f}, {st}")
