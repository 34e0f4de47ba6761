"""The HTTP listener of the OpenAI-compatible API: uvicorn, in the event loop the gRPC server runs in.

Contract:
- `HttpServer(app, host, port).start()` binds the address itself (IPv4 or IPv6, port 0 picks a free one; a busy
  or foreign address raises `ServerStartError` naming `HTTP: HOST:PORT`) and returns the bound port once uvicorn
  accepts connections. uvicorn installs no signal handlers: the CLI's SIGTERM handler drains gRPC and HTTP alike.
- Connection limits (`ConnectionGuard`, inference_svc.openai_api.connection_guard): a connection must send a
  complete request head within `head_timeout` seconds of its accept (or of its previous response), at most
  `max_connections` are open at once and `max_per_client` from one IP address, a new connection displaces the
  oldest one still waiting for a head, a head above 64 KiB gets 431; idle keep-alive connections are also closed
  after `keep_alive` seconds. Every answer given below the app has the OpenAI error shape.
- TLS: with `tls_cert` and `tls_key` (the gRPC server's pair), HTTPS only.
- `close(grace)` stops accepting, lets responses in progress finish for `grace` seconds, then cancels them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from inference_svc.errors import ServerStartError
from inference_svc.openai_api.connection_guard import ConnectionGuard
from inference_svc.settings import bare_host, host_port

log = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling (the process's handler owns SIGTERM/SIGINT)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        max_connections: int = 1024,
        max_per_client: int = 512,
        head_timeout: float = 5.0,
        keep_alive: float = 5.0,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        self.app = app
        self.tls_cert, self.tls_key = tls_cert, tls_key
        self.host = host
        self.port = port
        self.guard = ConnectionGuard(max_connections, max_per_client, head_timeout)
        self.keep_alive = keep_alive
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        sock = _bind(self.host, self.port)
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            http=self.guard.protocol_class(),
            timeout_keep_alive=int(max(1, self.keep_alive)),
            limit_concurrency=None,  # the guard limits connections (uvicorn's limit counts idle ones, in plain text)
            timeout_graceful_shutdown=1,
            ssl_certfile=self.tls_cert,
            ssl_keyfile=self.tls_key,
        )
        self._server = _Uvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:  # bounded: serve() either starts or ends with an error
            if self._task.done():
                self._task.result()
                raise ServerStartError(f"HTTP: cannot listen on {host_port(self.host, self.port)}")
            await asyncio.sleep(0.01)
        self.port = sock.getsockname()[1]
        return self.port

    async def close(self, grace: float = 1.0) -> None:
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = max(0, int(grace))
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=grace + 5.0)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


def _bind(host: str, port: int) -> socket.socket:
    bare = bare_host(host)
    try:
        infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServerStartError(f"HTTP: cannot listen on {host_port(host, port)}: {exc.strerror}") from None
    family, kind, proto, _canon, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        reason = "address in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise ServerStartError(f"HTTP: cannot listen on {host_port(host, port)}: {reason}") from None
    sock.setblocking(False)
    return sock
