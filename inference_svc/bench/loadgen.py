"""When the benchmark sends: Poisson arrivals at a fixed rate, or a fixed number of concurrent clients.

Contract:
- `run_level(backend, requests, level, ...)` sends `requests` (in order) through `backend.send(spec, timeout,
  request_id)` and returns one `RequestRecord` per request it started, plus the level's wall time. A backend is
  `GrpcBackend` (the service's own `AsyncTandemClient`, built by the caller with no retries, so refusals show up
  as errors) or `openai_backend.OpenAIBackend` (streamed `/v1/completions` of any OpenAI-compatible server); both
  record the same fields the same way, and never raise for a failed request (it is recorded in `status`).
- `Level(mode="rate", value=r)`: arrivals form a Poisson process of rate r requests/s (exponential gaps; r = inf sends
  everything at once), optionally capped by `max_concurrency`. `Level(mode="concurrency", value=c)`: c clients,
  each sending its next request when the previous one ends (closed loop).
- Bounds: at most `len(requests)` requests and no new request after `duration` seconds; a request still running at
  `duration + drain_timeout` is cut by its deadline and recorded as DEADLINE_EXCEEDED. So a level never runs
  longer than duration + drain_timeout (plus one RPC teardown).
- Times are `time.perf_counter()` seconds on the client. TTFT runs from the call to the first message that carries
  tokens (a gRPC stream message, or an SSE event); ITL is the gap between consecutive token-carrying messages; e2e
  runs to the last message. Output tokens are the ids received (gRPC) or the server's usage count (OpenAI).
  Prompt tokens are the prompt's ids, or for a text prompt the server's usage count (0 until it reports one).
- Sampling: greedy (`temperature` 0), `ignore_eos`, `max_new_tokens` of the spec.
- `on_done(record)` is called once per finished request (progress bars); it must not block.
- `probe_rtt(backend, stop)` measures the round trip of health checks every `interval` seconds until `stop` is set:
  the network-and-event-loop delay under the same load, which bounds how far client and server timings may differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from inference_svc.bench.workload import RequestSpec

MODES = ("rate", "concurrency")


@dataclass(frozen=True)
class Level:
    """One point of a sweep."""

    mode: str
    """rate | concurrency."""
    value: float
    """Requests per second (rate; inf = all at once) or concurrent clients (concurrency)."""
    max_concurrency: int | None = None
    """rate mode: most requests in flight at once (None: unbounded)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not self.value > 0:
            raise ValueError(f"{self.mode} must be > 0, got {self.value}")
        if self.mode == "concurrency" and (math.isinf(self.value) or self.value != int(self.value)):
            raise ValueError(f"concurrency must be a whole number, got {self.value}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")

    @property
    def label(self) -> str:
        if self.mode == "concurrency":
            return f"c={int(self.value)}"
        return "rate=inf" if math.isinf(self.value) else f"rate={self.value:g}/s"


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    index: int
    prompt_tokens: int
    max_new_tokens: int
    start: float
    """perf_counter() when the call was made."""
    first_token: float | None = None
    end: float | None = None
    token_times: list[float] = field(default_factory=list)
    """perf_counter() of each token-carrying message."""
    output_tokens: int = 0
    status: str = "OK"
    """'OK', or why it failed: the gRPC status code name; over HTTP the error's `code` when it is a status name
    (Tandem's are gRPC's), else `HTTP_<status>`, and UNAVAILABLE / DEADLINE_EXCEEDED / INCOMPLETE for a dropped
    connection, the level's deadline, or a stream that ended before its end."""
    detail: str = ""
    server_ttft_ms: float | None = None
    server_tpot_ms: float | None = None
    server_queue_ms: float | None = None

    @classmethod
    def starting(cls, spec: RequestSpec) -> RequestRecord:
        """The record of `spec`, started now."""
        return cls(spec.index, len(spec.prompt_token_ids), spec.max_new_tokens, start=time.perf_counter())

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None with fewer than 2 tokens)."""
        if self.first_token is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "max_new_tokens": self.max_new_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": _ms(self.ttft),
            "tpot_ms": _ms(self.tpot),
            "e2e_ms": _ms(self.e2e),
            "itl_ms": [round(x * 1000, 3) for x in self.itls],
            "server_ttft_ms": self.server_ttft_ms,
            "server_tpot_ms": self.server_tpot_ms,
            "server_queue_ms": self.server_queue_ms,
            "detail": self.detail,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


class Backend(Protocol):
    """What `run_level` and `probe_rtt` drive."""

    async def send(self, spec: RequestSpec, timeout: float, request_id: str = "") -> RequestRecord: ...

    async def health(self, timeout: float = 5.0) -> object: ...


async def send_one(client: Any, spec: RequestSpec, timeout: float, request_id: str = "") -> RequestRecord:
    """Stream one request over gRPC; never raises for an RPC failure (it is recorded in `status`)."""
    rec = RequestRecord.starting(spec)
    try:
        async for msg in client.generate_stream(
            spec.prompt,
            request_id=request_id,
            timeout=max(0.001, timeout),
            max_new_tokens=spec.max_new_tokens,
            temperature=0.0,
            ignore_eos=True,
        ):
            now = time.perf_counter()
            if msg.token_ids:
                if rec.first_token is None:
                    rec.first_token = now
                rec.token_times.append(now)
                rec.output_tokens += len(msg.token_ids)
            if msg.timing is not None:
                rec.server_ttft_ms = msg.timing.ttft_ms
                rec.server_tpot_ms = msg.timing.tpot_ms
                rec.server_queue_ms = msg.timing.queue_ms
            if msg.usage is not None and spec.prompt_text is not None:
                rec.prompt_tokens = msg.usage.prompt_tokens
        rec.end = time.perf_counter()
    except grpc.aio.AioRpcError as err:
        rec.end = time.perf_counter()
        rec.status = err.code().name
        rec.detail = (err.details() or "")[:200]
    return rec


class GrpcBackend:
    """The Tandem gRPC service through an `AsyncTandemClient` (built by the caller, with no retries)."""

    name = "grpc"

    def __init__(self, client: Any) -> None:
        self.client = client

    async def send(self, spec: RequestSpec, timeout: float, request_id: str = "") -> RequestRecord:
        return await send_one(self.client, spec, timeout, request_id)

    async def health(self, timeout: float = 5.0) -> object:
        return await self.client.health(timeout=timeout)


async def probe_rtt(backend: Backend, stop: asyncio.Event, interval: float = 0.1) -> list[float]:
    """Round trips (ms) of health checks sent every `interval` s while the level runs (failed checks are skipped)."""
    rtts: list[float] = []
    while not stop.is_set():
        t = time.perf_counter()
        try:
            await backend.health(timeout=5.0)
            rtts.append((time.perf_counter() - t) * 1000)
        except Exception:  # a probe that fails measures nothing; the level goes on
            pass
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
    return rtts


async def run_level(
    backend: Backend,
    requests: Sequence[RequestSpec],
    level: Level,
    *,
    duration: float,
    drain_timeout: float,
    seed: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Run one sweep level; return (records of every request started, wall seconds from first send to last end)."""
    t0 = time.perf_counter()
    stop_issuing = t0 + duration
    hard_stop = stop_issuing + drain_timeout
    records: list[RequestRecord] = []

    async def one(spec: RequestSpec) -> None:
        rec = await backend.send(spec, hard_stop - time.perf_counter(), request_id=f"bench-{spec.index}")
        records.append(rec)
        if on_done is not None:
            on_done(rec)

    if level.mode == "concurrency":
        queue = list(reversed(requests))

        async def worker() -> None:
            while queue and time.perf_counter() < stop_issuing:
                await one(queue.pop())

        await asyncio.gather(*(worker() for _ in range(int(level.value))))
    else:
        rng = random.Random(seed)
        limit = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None
        tasks: list[asyncio.Task] = []
        next_at = t0

        async def limited(spec: RequestSpec) -> None:
            if limit is None:
                await one(spec)
                return
            async with limit:
                if time.perf_counter() < hard_stop:
                    await one(spec)

        for spec in requests:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.perf_counter() >= stop_issuing:
                break
            tasks.append(asyncio.create_task(limited(spec)))
            if not math.isinf(level.value):
                next_at += rng.expovariate(level.value)
        await asyncio.gather(*tasks)
    if not records:
        return records, time.perf_counter() - t0
    first = min(r.start for r in records)
    last = max(r.end or r.start for r in records)
    return records, max(1e-9, last - first)
