"""The HTTP listener's guard against connections that hold a slot without sending a request: uvicorn's h11 protocol
with a request-head deadline, a per-client cap and eviction of the oldest idle connection.

Contract:
- `ConnectionGuard(max_connections, max_per_client, head_timeout)` owns the table of open HTTP connections (one
  per listener; only its protocols touch it, on the event loop). `protocol_class()` is the uvicorn protocol bound
  to it (uvicorn's `H11Protocol`, whose own `limit_concurrency` is left off: it counts idle sockets and answers a
  plain-text 503).
- A connection is *waiting* from its accept, and again from the end of each response it keeps alive, until a
  complete request head has arrived. A connection still waiting `head_timeout` seconds after it started waiting is
  closed: silently when it sent nothing (an idle socket, or an idle keep-alive), with a 408 when it sent part of a
  head (a trickled head is cut off whatever its pace). The same deadline the metrics port applies to its
  connections (`MetricsHTTPServer`), here to the head only: a body has `body_timeout` (the app's 408).
- Admission on accept: a client (its IP address) with `max_per_client` connections open, or a listener with
  `max_connections`, first closes its oldest waiting connection (that client's own, for the per-client cap) to
  make room; when none is waiting (every slot is serving a request) the new connection gets a 503 and is closed.
  So idle sockets, from one client or many, cannot keep a request (`/health` included) out: a new connection
  always displaces the oldest idle one.
- A request head larger than `MAX_HEAD_BYTES` (request line and header fields, counted as sent) gets 431,
  whether it arrived in pieces or in one packet. Every answer given here (400 for a malformed request, 408, 431,
  503) has the OpenAI error shape `{"error": {"message", "type", "param", "code"}}` the app uses, and closes the
  connection.
- Counters, read by tests and benchmarks: `timed_out` (closed at the head deadline), `evicted` (closed to make
  room), `refused` (503 on accept), `open` (connections open now).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEAD_BYTES = 64 * 1024
"""Largest request head (request line plus header fields) served; a larger one gets 431."""


def error_response(status: int, reason: str, message: str, kind: str, code: str, param: str | None = None) -> bytes:
    """A complete HTTP/1.1 response carrying an OpenAI-shaped error, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _HeadTooLarge(h11.RemoteProtocolError):
    pass


class _Connection(h11.Connection):
    """h11's server connection that also refuses a complete head above `MAX_HEAD_BYTES` (h11 itself bounds only
    a head still incomplete, so a large head sent in one packet would pass)."""

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            size = len(event.method) + len(event.target) + 13  # "M T HTTP/1.1\r\n"
            size += sum(len(name) + len(value) + 4 for name, value in event.headers)  # "name: value\r\n"
            if size > MAX_HEAD_BYTES:
                raise _HeadTooLarge(
                    f"the request head has {size} bytes; the limit is {MAX_HEAD_BYTES}", error_status_hint=431
                )
        return event


class ConnectionGuard:
    """Open HTTP connections by client, the waiting ones oldest first (see the module docstring)."""

    def __init__(self, max_connections: int, max_per_client: int, head_timeout: float) -> None:
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.head_timeout = head_timeout
        self._per_client: dict[str, int] = {}
        self._waiting: dict[_GuardedH11, None] = {}
        """Connections waiting for a request head, oldest first (an ordered set)."""
        self._waiting_by_client: dict[str, dict[_GuardedH11, None]] = {}
        self.open = 0
        self.timed_out = 0
        self.evicted = 0
        self.refused = 0

    def protocol_class(self) -> type[H11Protocol]:
        """uvicorn's `http` protocol class for this guard's listener."""
        return type("GuardedH11Protocol", (_GuardedH11,), {"guard": self})

    # -- called by the protocols
    def admit(self, conn: _GuardedH11) -> bool:
        """Count `conn` in, closing the oldest waiting connection first where a cap is reached; False: refused."""
        client = conn.client_key
        while self._per_client.get(client, 0) >= self.max_per_client or self.open >= self.max_connections:
            if self._per_client.get(client, 0) >= self.max_per_client:
                pool = self._waiting_by_client.get(client, {})
            else:
                pool = self._waiting
            victim = next(iter(pool), None)
            if victim is None:
                self.refused += 1
                return False
            self.evicted += 1
            victim.drop()
        self.open += 1
        self._per_client[client] = self._per_client.get(client, 0) + 1
        return True

    def waiting(self, conn: _GuardedH11) -> None:
        self._waiting[conn] = None
        self._waiting_by_client.setdefault(conn.client_key, {})[conn] = None

    def served(self, conn: _GuardedH11) -> None:
        """`conn` is no longer waiting (a head arrived, or it closed)."""
        self._waiting.pop(conn, None)
        mine = self._waiting_by_client.get(conn.client_key)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._waiting_by_client[conn.client_key]

    def closed(self, conn: _GuardedH11) -> None:
        self.served(conn)
        self.open -= 1
        left = self._per_client[conn.client_key] - 1
        if left:
            self._per_client[conn.client_key] = left
        else:
            del self._per_client[conn.client_key]


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol under a `ConnectionGuard` (the class attribute set by `protocol_class`)."""

    guard: ConnectionGuard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.client_key = ""
        self._counted = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        """Bytes received since this connection started waiting for a head."""

    # -- the guard's bookkeeping
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.client_key = self.client[0] if self.client else ""
        if not self.guard.admit(self):
            self._answer(503, "Service Unavailable", "the server has no free HTTP connection; retry later",
                         "service_unavailable", "UNAVAILABLE")  # fmt: skip
            return
        self._counted = True
        self._start_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        if self._counted:
            self._counted = False
            self.guard.closed(self)
        super().connection_lost(exc)

    def drop(self) -> None:
        """Close now to make room for a new connection (the guard stops counting it at once)."""
        self._stop_waiting()
        if self._counted:
            self._counted = False
            self.guard.closed(self)
        self.transport.abort()

    def _start_waiting(self) -> None:
        self._stop_waiting()
        self._head_bytes = 0
        self.guard.waiting(self)
        self._head_timer = self.loop.call_later(self.guard.head_timeout, self._head_timeout)

    def _stop_waiting(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
            self.guard.served(self)

    def _head_timeout(self) -> None:
        self._head_timer = None
        self.guard.served(self)
        if self.transport.is_closing():
            return
        self.guard.timed_out += 1
        if self._head_bytes:
            self._answer(408, "Request Timeout", f"the request head did not arrive within "
                         f"{self.guard.head_timeout:g} s", "invalid_request_error", "INVALID_ARGUMENT")  # fmt: skip
        else:
            self.transport.abort()

    def _answer(self, status: int, reason: str, message: str, kind: str, code: str, param: str | None = None) -> None:
        self.transport.write(error_response(status, reason, message, kind, code, param))
        self.transport.close()

    # -- uvicorn's hooks
    def data_received(self, data: bytes) -> None:
        if self._head_timer is not None:
            self._head_bytes += len(data)
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before and self._head_timer is not None:  # a request head arrived
            self._stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._head_timer is None and self.cycle.response_complete:
            self._start_waiting()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a malformed request, in the OpenAI shape (431 for a head over the limit)."""
        self._stop_waiting()
        exc = sys.exc_info()[1]  # uvicorn calls this while handling h11's RemoteProtocolError
        if getattr(exc, "error_status_hint", 400) == 431:
            message = str(exc) if isinstance(exc, _HeadTooLarge) else f"the request head is over {MAX_HEAD_BYTES} bytes"
            self._answer(431, "Request Header Fields Too Large", message, "invalid_request_error",
                         "INVALID_ARGUMENT", "headers")  # fmt: skip
        else:
            self._answer(400, "Bad Request", "the request is not valid HTTP/1.1", "invalid_request_error",
                         "INVALID_ARGUMENT")  # fmt: skip
