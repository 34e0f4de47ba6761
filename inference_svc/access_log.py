"""Request outcomes, one table for both protocols: every request that reached the service ends once, counted under
its status in `tandem_request_errors_total{code}` (successes are not errors) and written as one access-log line.

Contract:
- A `RequestRecord` is made when a request arrives (HTTP: an API route's handler; gRPC: an Inference RPC's handler)
  and holds its arrival (`created`: wall-clock seconds, the OpenAI responses' `created`; `start`: monotonic), its
  request id, its tokens in and out, and its outcome: a `Status` of `inference_svc.status` (the table the codes
  come from), `OK` until `fail(exc)` sets the status of the first error. A client that leaves (a disconnect, a
  hang-up mid-body, a gRPC cancel) is `CANCELLED`; one whose deadline passed is `DEADLINE_EXCEEDED`.
- `AccessLog.finish(record)` ends it, once whatever calls it again: a non-OK outcome is counted in the metric, and
  when `enabled`, one INFO line goes to the `tandem.access` logger: protocol, method, route or RPC, status (HTTP:
  the HTTP status and the gRPC code name it maps to; gRPC: the code name), request id, peer,
  tokens in and out, seconds since arrival. Never a traceback, never a request's text, never a key; a client's
  request id is cut to 128 characters and anything not printable in it escaped, so a line is always one line.
- Nothing else logs a client's own deadline or disconnect: the access line (INFO) is the one line they get.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from inference_svc.metrics import ServiceMetrics
from inference_svc.status import OK, Status, status_of

ACCESS_LOGGER = "tandem.access"
log = logging.getLogger(ACCESS_LOGGER)


@dataclass
class RequestRecord:
    """One request, from arrival to its one end (see the module docstring)."""

    protocol: str
    """'http' or 'grpc'."""
    method: str
    """HTTP method, or the RPC's name."""
    route: str
    """The HTTP path, or the gRPC service and method."""
    peer: str = "-"
    request_id: str = "-"
    tokens_in: int = 0
    tokens_out: int = 0
    status: Status = OK
    start: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))
    """The request's arrival, in whole seconds of the wall clock (OpenAI's `created`)."""
    finished: bool = False

    def fail(self, exc: BaseException) -> Status:
        """Record `exc` as the outcome unless an error was recorded first; return the status it maps to."""
        status = status_of(exc)[0]
        if self.status is OK:
            self.status = status
        return status

    @property
    def failed(self) -> bool:
        return self.status is not OK


MAX_LOGGED_ID_CHARS = 128


def _shown_id(request_id: str) -> str:
    """A client's request id as the log line shows it: at most `MAX_LOGGED_ID_CHARS` characters, anything not
    printable escaped (a gRPC id may hold a newline: it must not forge a second line)."""
    shown = request_id[:MAX_LOGGED_ID_CHARS]
    if not shown.isprintable() or " " in shown:
        shown = shown.encode("unicode_escape").decode("ascii").replace(" ", "\\x20")
    return shown + ("..." if len(request_id) > MAX_LOGGED_ID_CHARS else "")


class AccessLog:
    """Ends request records: the count of their outcome, and their access-log line when `enabled`."""

    def __init__(self, metrics: ServiceMetrics, enabled: bool = True) -> None:
        self.metrics = metrics
        self.enabled = enabled

    def finish(self, record: RequestRecord) -> None:
        if record.finished:
            return
        record.finished = True
        code = record.status.grpc.name
        if record.failed:
            self.metrics.observe_error(code)
        if not self.enabled or not log.isEnabledFor(logging.INFO):
            return
        seconds = time.monotonic() - record.start
        shown = f"{record.status.http} {code}" if record.protocol == "http" else code
        log.info(
            "%s %s %s %s id=%s peer=%s tokens_in=%d tokens_out=%d %.3fs",
            record.protocol, record.method, record.route, shown, _shown_id(record.request_id), record.peer,
            record.tokens_in, record.tokens_out, seconds,
        )  # fmt: skip
