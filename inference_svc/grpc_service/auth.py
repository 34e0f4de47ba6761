"""API keys: every RPC and HTTP route but health needs `authorization: Bearer KEY` with a configured key.

Contract:
- `ApiKeys.denial(values)` takes the `authorization` header values of one request (gRPC metadata or HTTP headers)
  and returns the client-facing reason it is refused, or None when it carries a configured key. More than one
  value is ambiguous and refused saying so. Keys are compared in constant time (SHA-256 digests through
  `hmac.compare_digest`, so not even the length leaks, and every key is compared: no early exit) and never logged.
- `ApiKeyInterceptor` applies it to every gRPC call but `grpc.health.v1.Health/*`, before the request body is
  parsed: an unauthenticated client gets UNAUTHENTICATED whatever bytes it sends (its body is never parsed), and
  `on_denied` hears of each refusal (the process ends the request's record there).
- The process (`inference_svc.server`) builds one `ApiKeys` and hands it to both the gRPC interceptor and the
  OpenAI HTTP API, which are peers.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from typing import Any

import grpc

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"

DENIED = "missing or invalid API key (authorization: Bearer KEY)"
"""The client-facing reason for a missing or wrong key."""


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeys:
    """The configured keys, as digests; `denial` checks one request's `authorization` values against them."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self._digests = tuple(_digest(k) for k in keys)

    def denial(self, values: Sequence[Any]) -> str | None:
        """Why these `authorization` values are refused (the client-facing message), or None if they carry a
        configured key."""
        if len(values) > 1:
            return "ambiguous authorization: send exactly one 'authorization: Bearer KEY' header, not several"
        value = values[0] if values else ""
        value = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        scheme, _, presented = value.partition(" ")
        digest = _digest(presented.strip().encode())
        ok = False
        for d in self._digests:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(digest, d)
        if ok and scheme.lower() == "bearer":
            return None
        return DENIED


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every RPC but health unless `authorization: Bearer KEY` carries a configured key."""

    def __init__(self, keys: ApiKeys | Sequence[bytes], on_denied: Callable[[str], None] | None = None) -> None:
        self.keys = keys if isinstance(keys, ApiKeys) else ApiKeys(keys)
        self._on_denied = on_denied

    def denial(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """Why this metadata is refused (the client-facing message), or None if it carries a configured key."""
        return self.keys.denial([v for key, v in metadata or () if key.lower() == "authorization"])

    def authorized(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        return self.denial(metadata) is None

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        if handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return await continuation(handler_call_details)
        reason = self.denial(handler_call_details.invocation_metadata)
        if reason is None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if self._on_denied is not None:
            self._on_denied(handler_call_details.method)
        return _denying_handler(handler, reason)


def _ignore_body(raw: bytes) -> None:
    """The denying handler's deserializer: an unauthenticated request's bytes are never parsed."""
    return None


def _denying_handler(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    async def deny(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    kwargs = {"request_deserializer": _ignore_body, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
