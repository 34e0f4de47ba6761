"""Python clients of the Tandem inference service: `TandemClient` (blocking) and `AsyncTandemClient` (asyncio).

Contract:
- Both speak `tandem.inference.v1` over one channel, optionally with TLS (`tls=True`, optional `root_certificates`
  PEM bytes for a private CA or self-signed cert) and an API key (sent as `authorization: Bearer KEY`).
- `timeout` is a deadline for the whole call, retries included. A call fails with the server's status as a
  `grpc.RpcError` (sync) / `grpc.aio.AioRpcError` (async); `code()` and `details()` say why.
- Retries (`RetryPolicy`): UNAVAILABLE and RESOURCE_EXHAUSTED are retried with exponential backoff and jitter, while
  the deadline allows. A stream is retried only if it failed before its first message, so a caller never sees
  tokens twice. Every other code is returned at once (INVALID_ARGUMENT will not get better by retrying).
- Results are typed (`client_results`): `generate` returns a `GenerateResult`, `generate_stream` yields
  `StreamChunk`s, with `FinishReason` members rather than protobuf integers and `raw` holding the message.
  `text` deltas concatenate to the full text; a completion's last chunk has `finish_reason`, `usage` and
  `timing`. Stopping the iteration (or `close()`) cancels the RPC; the
  server frees the request's KV blocks at its next engine step.
- `build_request` turns keyword arguments into a `GenerateRequest`; unset sampling fields take server defaults.
- `embed(inputs, dimensions=0)` returns the `Embed` RPC's vectors as lists of floats, one per input, in order.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_svc.client_results import GenerateResult, StreamChunk
from inference_svc.proto_gen import inference_pb2 as pb
from inference_svc.proto_gen import inference_pb2_grpc as pb_grpc

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for UNAVAILABLE / RESOURCE_EXHAUSTED."""

    max_attempts: int = 4
    """Attempts in all (1 = no retry)."""
    initial_backoff: float = 0.1
    """Seconds before the first retry."""
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2
    """Each wait is scaled by a random factor in [1 - jitter, 1 + jitter]."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts: must be >= 1, got {self.max_attempts}")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.multiplier < 1 or not 0 <= self.jitter < 1:
            raise ValueError("RetryPolicy: backoffs must be >= 0, multiplier >= 1 and jitter in [0, 1)")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)


NO_RETRY = RetryPolicy(max_attempts=1)

_SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)


def build_request(
    prompt: str | Sequence[int], request_id: str = "", lora_name: str = "", **sampling: Any
) -> pb.GenerateRequest:
    """A GenerateRequest from a text or token-id prompt and sampling keywords (None values are left unset);
    `lora_name` picks a LoRA adapter ("" : the base model)."""
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling fields {sorted(unknown)}; valid: {sorted(_SAMPLING_FIELDS)}")
    params = pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None and k != "logit_bias"})
    if sampling.get("logit_bias"):
        params.logit_bias.update({int(k): float(v) for k, v in sampling["logit_bias"].items()})
    if isinstance(prompt, str):
        return pb.GenerateRequest(request_id=request_id, prompt=prompt, sampling=params, lora_name=lora_name)
    ids = pb.TokenIds(ids=list(prompt))
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=ids, sampling=params, lora_name=lora_name)


def embed_request(inputs: Sequence[str | Sequence[int]], dimensions: int = 0) -> pb.EmbedRequest:
    """An `EmbedRequest` for texts and token-id lists."""
    items = [
        pb.EmbedInput(text=x) if isinstance(x, str) else pb.EmbedInput(token_ids=pb.TokenIds(ids=list(x)))
        for x in inputs
    ]
    return pb.EmbedRequest(inputs=items, dimensions=dimensions)


def _credentials(
    tls: bool, root_certificates: bytes | None
) -> grpc.ChannelCredentials | None:  # None: plaintext channel
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def _channel_options(tls_server_name: str | None, max_message_bytes: int) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return options


class _Base:
    def __init__(
        self,
        target: str,
        *,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        tls_server_name: str | None = None,
        timeout: float | None = 60.0,
        retry: RetryPolicy = RetryPolicy(),
        max_message_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._creds = _credentials(tls, root_certificates)
        self._options = _channel_options(tls_server_name, max_message_bytes)

    def _deadline(self, timeout: float | None) -> float | None:
        t = self.timeout if timeout is None else timeout
        return None if t is None else time.monotonic() + t

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _wait_before_retry(self, err: grpc.RpcError, attempt: int, deadline: float | None) -> float | None:
        """Seconds to sleep before retrying, or None to give up and raise `err`."""
        if err.code() not in RETRYABLE or attempt >= self.retry.max_attempts:
            return None
        wait = self.retry.backoff(attempt)
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait


class TandemClient(_Base):
    """Blocking client. Use as a context manager or call `close()`."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        if self._creds is None:
            self.channel = grpc.insecure_channel(target, options=self._options)
        else:
            self.channel = grpc.secure_channel(target, self._creds, options=self._options)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(request, timeout=self._remaining(deadline), metadata=self._metadata)
            except grpc.RpcError as err:
                wait = self._wait_before_retry(err, attempt, deadline)
                if wait is None:
                    raise
                time.sleep(wait)

    def generate(
        self, prompt: str | Sequence[int], *, request_id: str = "", timeout: float | None = None, **sampling: Any
    ) -> GenerateResult:
        return GenerateResult.from_proto(
            self._unary(self.stub.Generate, build_request(prompt, request_id, **sampling), timeout)
        )

    def generate_stream(
        self, prompt: str | Sequence[int], *, request_id: str = "", timeout: float | None = None, **sampling: Any
    ) -> Iterator[StreamChunk]:
        """Yield stream messages; retries only before the first one arrives."""
        request = build_request(prompt, request_id, **sampling)
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            call = self.stub.GenerateStream(request, timeout=self._remaining(deadline), metadata=self._metadata)
            received = False
            try:
                for msg in call:
                    received = True
                    yield StreamChunk.from_proto(msg)
                return
            except grpc.RpcError as err:
                wait = None if received else self._wait_before_retry(err, attempt, deadline)
                if wait is None:
                    raise
                time.sleep(wait)
            finally:
                call.cancel()  # no-op when finished; frees the server's blocks when the caller stops early

    def tokenize(self, text: str, *, add_bos: bool = False, timeout: float | None = None) -> pb.TokenizeResponse:
        return self._unary(self.stub.Tokenize, pb.TokenizeRequest(text=text, add_bos=add_bos), timeout)

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    def embed(
        self, inputs: Sequence[str | Sequence[int]], *, dimensions: int = 0, timeout: float | None = None
    ) -> list[list[float]]:
        """One vector per input (a text, or token ids), in order; `dimensions` > 0 keeps that many components."""
        response = self._unary(self.stub.Embed, embed_request(inputs, dimensions), timeout)
        return [list(e.values) for e in response.embeddings]

    def health(self, service: str = "", *, timeout: float = 5.0) -> str:
        """'SERVING', 'NOT_SERVING', ... (health is never behind the API key)."""
        resp = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_until_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health(timeout=max(0.1, min(2.0, deadline - time.monotonic()))) == "SERVING":
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.target} did not report SERVING within {timeout} s")
            time.sleep(0.1)


class AsyncTandemClient(_Base):
    """asyncio client (grpc.aio). Create it inside a running event loop; `await close()`."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        if self._creds is None:
            self.channel = grpc.aio.insecure_channel(target, options=self._options)
        else:
            self.channel = grpc.aio.secure_channel(target, self._creds, options=self._options)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await method(request, timeout=self._remaining(deadline), metadata=self._metadata)
            except grpc.aio.AioRpcError as err:
                wait = self._wait_before_retry(err, attempt, deadline)
                if wait is None:
                    raise
                await asyncio.sleep(wait)

    async def generate(
        self, prompt: str | Sequence[int], *, request_id: str = "", timeout: float | None = None, **sampling: Any
    ) -> GenerateResult:
        return GenerateResult.from_proto(
            await self._unary(self.stub.Generate, build_request(prompt, request_id, **sampling), timeout)
        )

    async def generate_stream(
        self, prompt: str | Sequence[int], *, request_id: str = "", timeout: float | None = None, **sampling: Any
    ) -> AsyncIterator[StreamChunk]:
        request = build_request(prompt, request_id, **sampling)
        deadline = self._deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            call = self.stub.GenerateStream(request, timeout=self._remaining(deadline), metadata=self._metadata)
            received = False
            try:
                async for msg in call:
                    received = True
                    yield StreamChunk.from_proto(msg)
                return
            except grpc.aio.AioRpcError as err:
                wait = None if received else self._wait_before_retry(err, attempt, deadline)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
            finally:
                call.cancel()

    async def tokenize(self, text: str, *, add_bos: bool = False, timeout: float | None = None) -> pb.TokenizeResponse:
        return await self._unary(self.stub.Tokenize, pb.TokenizeRequest(text=text, add_bos=add_bos), timeout)

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return await self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    async def embed(
        self, inputs: Sequence[str | Sequence[int]], *, dimensions: int = 0, timeout: float | None = None
    ) -> list[list[float]]:
        """One vector per input (a text, or token ids), in order; `dimensions` > 0 keeps that many components."""
        response = await self._unary(self.stub.Embed, embed_request(inputs, dimensions), timeout)
        return [list(e.values) for e in response.embeddings]

    async def health(self, service: str = "", *, timeout: float = 5.0) -> str:
        resp = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
