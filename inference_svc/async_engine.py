"""The bridge between asyncio (the gRPC server) and the single-threaded `Engine`.

Contract:
- One dedicated thread, the *engine thread* (an `EngineThread`: the caller's, else its own), is the only
  caller of `Engine` once `start()` has run. A server loads the engine and runs `warmup` on that same thread before
  `start()`, so that all of the model's torch work runs on one thread (why: `inference_svc.engine_thread`). The
  event loop talks to it through that thread's one queue (`EngineThread.inbox`: add, abort, stop, and calls such
  as `run_in_engine`'s); the engine loop applies at most `MAX_COMMANDS_PER_STEP` of them between two steps (a
  flood of commands cannot starve running streams) and answers through `loop.call_soon_threadsafe`, once per step
  with every increment of that step.
- State has one owner each: the admission counters and the per-request streams belong to the event loop; the
  per-request deadlines, abort causes and inter-token clocks belong to the engine thread.
- Text is refused before it is tokenized when it has more characters than the context could ever hold
  (`max_prompt_chars`), and tokenized through a `TokenizeGate`: one text at a time in a tokenizer process (started
  with the engine thread), metered in characters, so a flood of large prompts gets RESOURCE_EXHAUSTED instead of
  unbounded threads, memory and GIL time.
- Admission control (`AdmissionLimits`): a request is admitted only if the requests still waiting for their first
  token, and their prompt tokens, stay within the limits after adding it; otherwise `CapacityError` is raised and
  nothing about the request exists anywhere (nothing half-admitted). The reservation is released when the request
  produces its first increment or ends, whichever comes first.
- `generate(..., n=k)` runs k completions of one prompt (tokenized once, admitted together or refused together)
  and `generate_many(prompts, ..., n=k)` k completions of each of several prompts, admitted whole or refused whole
  before the engine sees any of it: every prompt is tokenized and checked (`Engine.check_request`: token ids,
  length, sampling parameters) first, and a request larger than the whole queue (`len(prompts) × k` above
  `max_queued_requests`, or its prompt tokens above `max_queued_tokens`) is `InvalidRequestError` naming `n` or
  `prompt` (no retry could help), while one that fits an emptier queue is `CapacityError`. `generate` is an
  async iterator of `RequestOutput` whose `index` names the completion. Leaving it early (client
  cancel, disconnect, the server's own deadline cancellation) sends an abort: the engine drops the sequence at
  its next step and frees its blocks.
  A deadline (monotonic seconds) is also enforced by the engine thread, for queued and running requests alike;
  the iterator then raises `DeadlineExceededError` after the blocks are freed.
- A request with a structured output (`SamplingParams.structured`) has its grammar compiled in a worker thread
  before admission (`Engine.grammar_compiler`, cached by its text); one it cannot compile is refused whole with
  `InvalidRequestError` naming the request parameter.
- Failures: a validation error from the engine is re-raised as is (`InvalidRequestError`). An exception from the
  *fault hook* (below) or anything unexpected while handling one request's output fails that request alone with
  `RequestFailedError`; the engine aborts it and goes on. If `Engine.step()` itself raises, every request in that
  step fails with `RequestFailedError`; after `MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row the engine is
  declared broken (`healthy` turns False, new requests get `EngineStoppedError`).
- Fault hook (test-only, explicit): `fault_hook(output)` is called in the engine thread with every `RequestOutput`
  before it is delivered. Whatever it raises is treated exactly like a real failure while serving that request.
  It exists so the tests can prove the one-request-fails-alone path without mocking the model; production leaves
  it None.
- Whether new work is taken is the `Lifecycle`'s to say (the server's, shared; or this engine's own when it runs
  standalone, SERVING from `start()`): requests are refused with `EngineStoppedError` unless it is SERVING, and
  the engine thread reports a broken engine to it (`State.BROKEN`) instead of anyone polling a flag.
- `drain(grace)`: new requests get `EngineStoppedError`; in-flight ones may finish for `grace` seconds; the rest
  are aborted and their iterators raise `EngineStoppedError`. `stop()` ends the engine thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inference_svc import tokenizer_jobs
from inference_svc.engine.types import MAX_N, EngineInfo, FinishReason, RequestOutput, SamplingParams
from inference_svc.engine.validation import check_encoded, check_text_prompt
from inference_svc.engine_thread import Call, EngineThread
from inference_svc.errors import (
    CapacityError,
    DeadlineExceededError,
    EngineStoppedError,
    InferenceError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestFailedError,
)
from inference_svc.lifecycle import Lifecycle, State
from inference_svc.metrics import ServiceMetrics
from inference_svc.settings import BURST_WINDOW_SPAN, AdmissionLimits
from inference_svc.tokenize_gate import TokenizeGate

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 128
MAX_CONSECUTIVE_STEP_FAILURES = 3
MAX_COMMANDS_PER_STEP = 64
"""Inbox commands (add, abort, call) the engine loop applies between two steps: a flood of them delays the
running streams by at most this many commands' work per step."""
_IDLE_POLL_S = 0.05

FaultHook = Callable[[RequestOutput], None]


# ---------------------------------------------------------------------------------------- commands
@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: float
    deadline: float | None


@dataclass
class _Abort:
    request_id: str
    cause: BaseException | None
    """Raised to the request's reader once the engine confirms the abort (None: a plain cancel)."""


_STOP = object()


# ---------------------------------------------------------------------------------------- per-request state
@dataclass
class _Stream:
    """Event-loop side of one engine request."""

    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    """(engine request id, increment or exception): shared by the `n` completions of one request."""
    reserved_tokens: int = 0
    reserved: bool = True


@dataclass
class _Live:
    """Engine-thread side of one request."""

    deadline: float | None
    cause: BaseException | None = None
    last_emit: float | None = None


class AsyncEngine:
    """Async, bounded, cancellable front of one `Engine` (see the module docstring)."""

    def __init__(
        self,
        engine: Any,
        limits: AdmissionLimits | None = None,
        metrics: ServiceMetrics | None = None,
        fault_hook: FaultHook | None = None,
        lifecycle: Lifecycle | None = None,
        thread: EngineThread | None = None,
    ) -> None:
        self.engine = engine
        self.thread = thread
        """Where the engine loop runs (in a server, the thread that loaded the engine and ran `warmup`); without one
        given, `start()` starts one. It is this object's from then on: `stop()` ends it."""
        self._owns_lifecycle = lifecycle is None
        self.lifecycle = lifecycle or Lifecycle()
        """Whether new work is taken: the server's (`TandemServer.lifecycle`), or this engine's own when standalone."""
        self.limits = limits or AdmissionLimits()
        self.metrics = metrics
        self.fault_hook = fault_hook
        self._tokenizer_gate = TokenizeGate(
            engine.tokenizer,
            self.limits.max_tokenizing_chars,
            on_meter=None if metrics is None else metrics.observe_tokenizer,
        )
        self.max_prompt_chars = engine.max_model_len * engine.tokenizer.max_chars_per_token
        """A text prompt longer than this cannot fit the context, whatever it encodes to: refused unread."""
        # event-loop state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}
        self._queued_requests = 0
        self._queued_tokens = 0
        self._idle = asyncio.Event()
        # engine-thread state
        self._live: dict[str, _Live] = {}
        self._step_failures = 0
        self.max_commands_per_step = MAX_COMMANDS_PER_STEP
        """Most inbox commands the engine thread applies between two steps."""
        self.largest_command_batch = 0
        """The most commands it has applied between two steps so far (written by the engine thread: a gauge for
        tests and benchmarks)."""
        # shared, written once
        self._running: concurrent.futures.Future | None = None
        """The engine loop's future on `thread` (None: not started, or stopped)."""
        self._broken = False  # written once by the engine thread; the lifecycle hears of it in the loop

    # ------------------------------------------------------------------ lifecycle
    def warmup(self, prompt_ids: list[int] | None = None) -> None:
        """Run one tiny greedy request to completion (before `start()`; blocking)."""
        if self._running is not None:
            raise RuntimeError("warmup() must run before start()")
        ids = prompt_ids or [int(self.engine.model_config.bos_token_id or 0)]
        self.engine.generate([ids], SamplingParams(max_new_tokens=2, ignore_eos=True))

    @property
    def healthy(self) -> bool:
        """False once the engine thread declared the engine broken (read from any thread)."""
        return not self._broken

    def _mark_broken(self) -> None:
        self._broken = True
        self.lifecycle.to_threadsafe(State.BROKEN)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.lifecycle.bind(self._loop)
        if self._owns_lifecycle:
            self.lifecycle.to(State.SERVING)
        self._idle.set()
        if self.thread is None:
            self.thread = EngineThread()
        self._running = self.thread.submit(self._run)
        self._tokenizer_gate.start()  # its tokenizer process, in the background

    async def stop(self) -> None:
        """End the engine thread (after `drain`, or abruptly)."""
        if self._running is None:
            return
        self._put(_STOP)
        await asyncio.to_thread(concurrent.futures.wait, [self._running], 30.0)
        self._running = None
        if self.thread is not None:
            self.thread.close()
            self.thread = None
        await asyncio.to_thread(self._tokenizer_gate.close)

    async def drain(self, grace: float) -> int:
        """Refuse new work, let in-flight requests finish for `grace` s, abort the rest; return how many were cut."""
        self.lifecycle.to(State.DRAINING)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout=grace)
        cut = list(self._streams)
        for rid in cut:
            self._put(_Abort(rid, EngineStoppedError("the server shut down before this request finished")))
        if cut:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout=10.0)
        return len(cut)

    @property
    def info(self) -> EngineInfo:
        """The engine's `EngineInfo`, read now: every field is fixed at load except `peak_workspace_bytes`, a plain
        int the engine thread only raises (reading it from the event loop is safe)."""
        return self.engine.info()

    @property
    def draining(self) -> bool:
        return self.lifecycle.draining

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def run_in_engine(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` in the engine thread between steps (e.g. `engine.stats`) and return its result."""
        if self._running is None or self.thread is None:
            return fn()
        return await self.thread.run(fn)  # a `Call` in the thread's one queue: the engine loop runs it between steps

    async def stats(self) -> Any:
        return await self.run_in_engine(self.engine.stats)

    async def embed(self, prompts: list[list[int]], pooling: Any) -> Any:
        """`Engine.embed` on the engine thread, between two steps: [N, H] float32 pooled hidden states."""
        if self.engine is None or not self.lifecycle.accepting:
            raise EngineStoppedError(self.lifecycle.refusal() or "the engine is not running")
        return await self.run_in_engine(lambda: self.engine.embed(prompts, pooling))

    # ------------------------------------------------------------------ requests (event loop)
    async def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingParams,
        request_id: str = "",
        deadline: float | None = None,
        n: int = 1,
    ) -> AsyncIterator[RequestOutput]:
        """Admit one request and iterate its increments; the last of each of its `n` completions has
        `finished=True` (`RequestOutput.index` says which). Completions after the first run as engine requests
        `REQUEST_ID.i` with seed `seed + i` when a seed is set, so they differ and stay reproducible; they are
        admitted together or not at all, and leaving the iterator aborts every one still running."""
        outputs = self.generate_many([prompt], sampling, request_id=request_id, deadline=deadline, n=n)
        try:
            async for _, out in outputs:
                yield out
        finally:
            await outputs.aclose()

    async def generate_many(
        self,
        prompts: Sequence[str | list[int]],
        sampling: SamplingParams,
        request_id: str = "",
        deadline: float | None = None,
        n: int = 1,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`generate` for several prompts at once (OpenAI's prompt list): (prompt index, increment) as they come,
        each increment's `index` its completion's among the prompt's `n`. The request is one unit: every prompt is
        tokenized and checked (token ids, length, sampling parameters) and the `len(prompts) × n` sequences are
        admitted together, or the request is refused whole, before the engine sees any of it. A request that no
        emptier queue could take gets `InvalidRequestError` naming `n` or `prompt`, not `CapacityError`. With one
        prompt the engine requests are named as `generate`'s; with several, prompt p's are `REQUEST_ID-p` (and
        `REQUEST_ID-p.i`)."""
        if not self.lifecycle.accepting or self._broken or self._running is None:
            raise EngineStoppedError(self.lifecycle.refusal() or "the engine is not running")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise InvalidRequestError("n", f"must be an integer in [1, {MAX_N}], got {n!r}")
        if not prompts:
            raise InvalidRequestError("prompt", "the request has no prompt")
        rid = request_id or uuid.uuid4().hex
        if len(rid) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(rid)}")
        self.check_fits(len(prompts), n)  # before any tokenizing: the count alone may refuse it
        bases = [rid] if len(prompts) == 1 else [f"{rid}-{p}" for p in range(len(prompts))]
        groups = [[base] if n == 1 else [f"{base}.{i}" for i in range(n)] for base in bases]
        if rid in self._streams or any(c in self._streams for group in groups for c in group):
            raise InvalidRequestError("request_id", f"a request with id {rid!r} is already in flight")
        if sampling.structured is not None and sampling.structured.compiled is None:
            # compiled (or refused, naming its field) before admission, off the engine thread; cached by its text
            compiled = await asyncio.to_thread(self.engine.grammar_compiler.compile, sampling.structured)
            sampling = dataclasses.replace(sampling, structured=compiled)
        all_ids = [await self.prompt_ids(p) for p in prompts]
        for ids in all_ids:
            self.engine.check_request(ids, sampling)  # every prompt before any reaches the engine
        self.check_fits(len(prompts), n, [len(ids) for ids in all_ids])
        items: asyncio.Queue = asyncio.Queue()
        streams = self._admit(groups, [len(ids) for ids in all_ids], items)  # all or none
        arrival = time.monotonic()
        where: dict[str, tuple[int, int]] = {}
        for p, (group, ids) in enumerate(zip(groups, all_ids, strict=True)):
            for i, child in enumerate(group):
                params = sampling
                if i and sampling.seed is not None:
                    params = dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**64)
                where[child] = (p, i)
                self._put(_Add(child, ids, params, arrival, deadline))
        running = set(where)
        try:
            while running:
                child, item = await items.get()
                if isinstance(item, BaseException):
                    running.discard(child)
                    raise item
                self._release(streams[child])
                if item.finished:
                    running.discard(child)
                p, i = where[child]
                yield p, item if n == 1 else dataclasses.replace(item, request_id=bases[p], index=i)
        finally:
            for child in where:
                self._release(streams[child])
                self._streams.pop(child, None)
                if child in running:
                    self._put(_Abort(child, None))
            if not self._streams:
                self._idle.set()

    def check_fits(self, num_prompts: int, n: int, prompt_tokens: Sequence[int] | None = None) -> None:
        """`InvalidRequestError` when `num_prompts` prompts × `n` completions (of `prompt_tokens` tokens each, when
        known) could not be admitted even by an empty queue: such a request must not be told to retry."""
        lim = self.limits
        k = num_prompts * n
        if k > lim.max_queued_requests:
            what = f"{num_prompts} prompts × n={n}" if num_prompts > 1 else f"n={n}"
            raise InvalidRequestError(
                "n" if n > 1 else "prompt",
                f"{what} make {k} sequences; this server queues at most {lim.max_queued_requests} (--max-queue), "
                "so the request can never be admitted",
            )
        if prompt_tokens is not None and sum(prompt_tokens) * n > lim.max_queued_tokens:
            raise InvalidRequestError(
                "prompt",
                f"{sum(prompt_tokens)} prompt tokens × {n} completions exceed the server's queue limit of "
                f"{lim.max_queued_tokens} tokens (--max-queue-tokens), so the request can never be admitted",
            )

    async def tokenizer_work(self, chars: int, job: Callable[..., Any], *args: Any, field: str = "text") -> Any:
        """`job(tokenizer, *args)` (an `inference_svc.tokenizer_jobs` function, e.g. the Tokenize RPC's response)
        metered as `chars` characters by the `TokenizeGate`: in its tokenizer process when long."""
        return await self._tokenizer_gate.run(chars, job, *args, field=field)

    async def tokenize_with(self, chars: int, job: Callable[..., Any], *args: Any, field: str = "messages") -> Any:
        """`tokenizer_work` for a prompt (e.g. a chat's rendering and encoding): refused unread like a text prompt
        when `chars` cannot fit the context."""
        self._refuse_unread_if_too_long(chars, field)
        return await self.tokenizer_work(chars, job, *args, field=field)

    @property
    def prescreen_bytes(self) -> int:
        """A text field of at most this many bytes is never refused by `refuse_unparsed`, so a request no longer
        than this need not be scanned before it is parsed."""
        return 4 * min(self.max_prompt_chars, self._tokenizer_gate.inline_chars)

    def refuse_unparsed(self, utf8_bytes: int, field: str, context: bool = True) -> InferenceError | None:
        """The error for a text field of `utf8_bytes` bytes that is refused whatever it holds, for a request refused
        from its wire bytes before it is parsed (the servicer's prescreens). UTF-8 spends at most 4 bytes on a
        character, so the field has at least a quarter as many characters: when that many cannot fit the context
        (`context`: a prompt) or cannot pass the `TokenizeGate` now, so would the text. Else None, and also while
        the engine takes no new work (the parsed request is refused as UNAVAILABLE). The other checks of a parsed
        request (its other fields) come after this one: a request wrong in two ways may hear of this one first."""
        if not self.lifecycle.accepting:  # parsed, it gets UNAVAILABLE first: so does it here
            return None
        least_chars = -(-utf8_bytes // 4)
        if context and least_chars > self.max_prompt_chars:
            self._tokenizer_gate.trim_soon()
            return InvalidRequestError(
                field,
                f"{utf8_bytes} bytes of UTF-8 (at least {least_chars} characters) cannot fit this engine's context "
                f"of {self.engine.max_model_len} tokens (at most {self.max_prompt_chars} characters with this "
                "tokenizer); refused before parsing",
            )
        return self._tokenizer_gate.refusal(least_chars, field, at_least=True)

    def _refuse_unread_if_too_long(self, chars: int, field: str) -> None:
        """InvalidRequestError naming `field` when `chars` characters cannot fit the context, whatever they encode
        to (nothing is tokenized)."""
        if chars > self.max_prompt_chars:
            self._tokenizer_gate.trim_soon()  # the refused request's buffers are freed when its RPC ends
            raise InvalidRequestError(
                field,
                f"{chars} characters cannot fit this engine's context of {self.engine.max_model_len} tokens "
                f"(at most {self.max_prompt_chars} characters with this tokenizer); refused before tokenizing",
            )

    async def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The token ids `generate` would run for `prompt`: text refused unread when it cannot fit, else
        tokenized through the gate; token ids as given (the engine checks them)."""
        if not isinstance(prompt, str):
            return list(prompt)
        check_text_prompt(prompt)
        self._refuse_unread_if_too_long(len(prompt), "prompt")
        ids = await self._tokenizer_gate.run(len(prompt), tokenizer_jobs.encode_prompt, prompt, field="prompt")
        check_encoded(ids)
        self.engine.check_prompt_length(len(ids))  # refused while still one compact array
        return ids.tolist()

    def _admit(self, groups: list[list[str]], num_tokens: list[int], items: asyncio.Queue) -> dict[str, _Stream]:
        """Reserve queue room for every engine request of `groups` (group p's of `num_tokens[p]` prompt tokens
        each), all or none (`check_fits` has refused what could never fit)."""
        lim = self.limits
        k = sum(len(g) for g in groups)
        tokens = sum(len(g) * t for g, t in zip(groups, num_tokens, strict=True))
        if self._queued_requests + k > lim.max_queued_requests:
            raise CapacityError(
                f"the request queue is full ({self._queued_requests} of {lim.max_queued_requests} requests waiting, "
                f"this request needs {k}); retry later"
            )
        if self._queued_tokens + tokens > lim.max_queued_tokens:
            raise CapacityError(
                f"the request queue is full ({self._queued_tokens} of {lim.max_queued_tokens} prompt tokens "
                f"waiting, this request has {tokens}); retry later"
            )
        self._queued_requests += k
        self._queued_tokens += tokens
        streams = {
            rid: _Stream(items=items, reserved_tokens=t) for g, t in zip(groups, num_tokens, strict=True) for rid in g
        }
        self._streams.update(streams)
        self._idle.clear()
        self._report_admission()
        return streams

    def _release(self, stream: _Stream) -> None:
        if stream.reserved:
            stream.reserved = False
            self._queued_requests -= 1
            self._queued_tokens -= stream.reserved_tokens
            self._report_admission()

    def _report_admission(self) -> None:
        if self.metrics is not None:
            self.metrics.observe_admission(self._queued_requests, self._queued_tokens)

    def _deliver(self, batch: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Event loop: hand each increment to its request's reader (gone readers are skipped)."""
        for rid, item in batch:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.items.put_nowait((rid, item))

    # ------------------------------------------------------------------ the engine thread
    def _post(self, batch: list[tuple[str, RequestOutput | BaseException]]) -> None:
        if batch and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
                self._loop.call_soon_threadsafe(self._deliver, batch)

    def _run(self) -> None:
        try:
            while self._handle_commands():
                self._expire_deadlines()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self.engine.poll_threads()  # the thread count is right when the next request comes
        except BaseException:  # pragma: no cover - a bug in this bridge (or a SystemExit): fail loudly, stop serving
            log.exception("engine thread crashed")
            self._mark_broken()
            self._post([(rid, RequestFailedError("the engine thread crashed")) for rid in list(self._live)])

    def _put(self, command: object) -> None:
        """Queue a command for the engine loop (dropped once the engine thread is gone: a late abort)."""
        thread = self.thread
        if thread is not None:
            thread.put(command)

    def _handle_commands(self) -> bool:
        """Apply at most `max_commands_per_step` queued commands (the rest wait for the next round, after a step),
        so a flood of commands cannot starve the running streams; block briefly when idle, and after an idle
        spell's first command take those that follow within `AdmissionLimits.burst_window_ms` of each other. False
        once asked to stop."""
        assert self.thread is not None
        inbox = self.thread.inbox
        block = not self.engine.has_unfinished_requests()
        window = self.limits.burst_window_ms / 1000.0
        burst_end: float | None = None  # an idle engine's first command came: what follows within the window joins
        errors: list[tuple[str, RequestOutput | BaseException]] = []
        handled = 0
        while handled < self.max_commands_per_step:
            try:
                if block:
                    cmd = inbox.get(timeout=_IDLE_POLL_S)
                elif burst_end is not None and (left := burst_end - time.monotonic()) > 0:
                    cmd = inbox.get(timeout=min(window, left))
                else:
                    cmd = inbox.get_nowait()
            except queue.Empty:
                break
            if block and window > 0:
                burst_end = time.monotonic() + BURST_WINDOW_SPAN * window
            block = False
            handled += 1
            if cmd is _STOP:
                self._post(errors)
                return False
            if isinstance(cmd, _Add):
                self._add(cmd, errors)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id, cmd.cause, errors)
            elif isinstance(cmd, Call):
                cmd.run()
        self.largest_command_batch = max(self.largest_command_batch, handled)
        self._post(errors)
        return True

    def _add(self, cmd: _Add, errors: list) -> None:
        try:
            self.engine.add_request(
                cmd.request_id, cmd.prompt_ids, cmd.sampling, arrival_time=cmd.arrival, checked=True
            )  # checked by `generate_many` (Engine.check_request) before it was queued
        except (InvalidRequestError, ModelNotFoundError) as exc:  # ModelNotFound: its LoRA adapter was unloaded
            errors.append((cmd.request_id, exc))
            return
        except Exception as exc:
            log.exception("add_request failed for %s", cmd.request_id)
            errors.append((cmd.request_id, RequestFailedError(f"could not add the request: {type(exc).__name__}")))
            return
        self._live[cmd.request_id] = _Live(deadline=cmd.deadline)

    def _abort(self, rid: str, cause: BaseException | None, errors: list) -> None:
        live = self._live.get(rid)
        if live is None:
            return
        if live.cause is None:
            live.cause = cause
        if not self.engine.abort_request(rid) and live.cause is not None:
            # already finished inside the engine: nothing to wait for, tell the reader now
            errors.append((rid, live.cause))
            self._live.pop(rid, None)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        expired = [rid for rid, live in self._live.items() if live.deadline is not None and live.deadline <= now]
        errors: list[tuple[str, RequestOutput | BaseException]] = []
        for rid in expired:
            if self._live[rid].cause is None:
                self._abort(rid, DeadlineExceededError("the request's deadline passed"), errors)
        self._post(errors)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._step_failed(exc)
            return
        self._step_failures = 0
        now = time.monotonic()
        batch: list[tuple[str, RequestOutput | BaseException]] = []
        for out in outputs:
            item = self._postprocess(out, now)
            if item is not None:
                batch.append((out.request_id, item))
        if self.metrics is not None:  # before the outputs go out: a client that saw them sees them counted
            self.metrics.observe_stats(self.engine.stats())
        self._post(batch)

    def _postprocess(self, out: RequestOutput, now: float) -> RequestOutput | BaseException | None:
        """One increment of one request: what its reader gets (None: nothing yet)."""
        rid = out.request_id
        live = self._live.get(rid)
        if live is None:
            return None
        try:
            if self.fault_hook is not None and live.cause is None:
                self.fault_hook(out)
            if out.new_token_ids and live.cause is None:  # the last increment's gap too: n tokens, n - 1 gaps
                if live.last_emit is not None and self.metrics is not None:
                    self.metrics.observe_inter_token(now - live.last_emit)
                live.last_emit = now
            if out.finished:
                self._live.pop(rid, None)
                if out.finish_reason is FinishReason.ERROR:  # the engine logged it; the reader gets INTERNAL
                    return RequestFailedError(out.error or "the engine failed this request", logged=True)
                if self.metrics is not None and out.finish_reason is not None:
                    self.metrics.observe_finished(out.finish_reason.value, out.timing)
                return out if live.cause is None else live.cause
            if live.cause is not None:
                return None  # aborting: wait for the engine's final increment, then raise the cause
            return out
        except Exception as exc:
            log.exception("request %s failed while handling its output", rid)
            failure = RequestFailedError(f"internal error while serving this request ({type(exc).__name__})")
            if out.finished:
                self._live.pop(rid, None)
                return failure
            live.cause = failure
            if not self.engine.abort_request(rid):
                self._live.pop(rid, None)
                return failure
            return None

    def _step_failed(self, exc: Exception) -> None:
        log.error("engine step failed; failing its %d requests", len(self._live), exc_info=exc)
        self._step_failures += 1
        failure = RequestFailedError(f"internal engine error ({type(exc).__name__})")
        batch: list[tuple[str, RequestOutput | BaseException]] = []
        for rid in list(self._live):
            with contextlib.suppress(Exception):
                self.engine.abort_request(rid)
            batch.append((rid, failure))
        self._live.clear()
        self._post(batch)
        if self._step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            log.critical("engine failed %d steps in a row: marking it broken", self._step_failures)
            self._mark_broken()
            self._step_failures = 0
            if self.engine.has_unfinished_requests():
                time.sleep(_IDLE_POLL_S)  # do not spin on a broken engine
