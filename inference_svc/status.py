"""The one table from exceptions to what each protocol answers: a gRPC status code, an HTTP status and an OpenAI
error `type`.

Contract:
- `STATUS` maps each deliberate error class of `inference_svc.errors` to one `Status`; `status_of(exc)` walks the
  exception's MRO through it. Anything not in it is `INTERNAL_ERROR` (INTERNAL / 500) with a generic message: the
  details go to the log, never to the client.
- The gRPC servicer and the HTTP API both choose their codes here and nowhere else, so an error means the same
  thing over either protocol. This is also the table of request outcomes (`OK` for success, `CANCELLED` for a
  client that left): `inference_svc.access_log` counts and logs every request's end under its code from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from inference_svc.errors import (
    AdapterInUseError,
    AuthenticationError,
    CapacityError,
    ClientGoneError,
    DeadlineExceededError,
    EngineStoppedError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestFailedError,
    RequestTimeoutError,
    RequestTooLargeError,
)


@dataclass(frozen=True)
class Status:
    grpc: grpc.StatusCode
    http: int
    type: str
    """OpenAI's error `type`."""


STATUS: dict[type[BaseException], Status] = {
    InvalidRequestError: Status(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    RequestTooLargeError: Status(grpc.StatusCode.INVALID_ARGUMENT, 413, "invalid_request_error"),
    RequestTimeoutError: Status(grpc.StatusCode.INVALID_ARGUMENT, 408, "invalid_request_error"),
    AuthenticationError: Status(grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    ModelNotFoundError: Status(grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
    AdapterInUseError: Status(grpc.StatusCode.FAILED_PRECONDITION, 409, "conflict_error"),
    CapacityError: Status(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    EngineStoppedError: Status(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
    DeadlineExceededError: Status(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout"),
    RequestFailedError: Status(grpc.StatusCode.INTERNAL, 500, "internal_error"),
    ClientGoneError: Status(grpc.StatusCode.CANCELLED, 499, "cancelled"),
}

OK = Status(grpc.StatusCode.OK, 200, "")
"""A request answered in full."""

INTERNAL_ERROR = Status(grpc.StatusCode.INTERNAL, 500, "internal_error")
INTERNAL_MESSAGE = "internal error while serving this request"


def status_of(exc: BaseException) -> tuple[Status, str]:
    """The status and the client-facing message of an exception."""
    for cls in type(exc).__mro__:
        status = STATUS.get(cls)
        if status is not None:
            return status, str(exc)
    return INTERNAL_ERROR, INTERNAL_MESSAGE
