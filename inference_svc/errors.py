"""The inference service's exception hierarchy: one base, one subclass per outcome a caller must tell apart.

Contract: the engine and servers raise only these on purpose. `inference_svc.status` maps each class to one gRPC
status code and one HTTP status, in one table; nothing else in the package chooses status codes. Messages name
the offending field.
"""

from __future__ import annotations

from typing import Any


class InferenceError(Exception):
    """Base class of every deliberate inference_svc error. Each pickles as its class, message and attributes
    (`field`, ...), whatever its constructor takes: a tokenizer process sends them back to the server."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _restore, (type(self), self.args, dict(self.__dict__))


def _restore(cls: type[InferenceError], args: tuple[Any, ...], attributes: dict[str, Any]) -> InferenceError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(attributes)
    return error


class InvalidRequestError(InferenceError, ValueError):
    """The request itself is wrong (maps to INVALID_ARGUMENT). `field` names the offending request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class MalformedRequestError(InvalidRequestError):
    """The request bytes are not a valid protobuf message of the RPC's type (maps to INVALID_ARGUMENT).

    The message says what was wrong in the client's terms (not parseable, invalid UTF-8 in a string field), never
    the parser's internals."""

    def __init__(self, message_type: str, reason: str) -> None:
        InferenceError.__init__(self, f"malformed request: not a valid {message_type} ({reason})")
        self.field = "request"


class AuthenticationError(InferenceError):
    """No valid API key came with the request (maps to UNAUTHENTICATED / HTTP 401)."""


class ModelNotFoundError(InferenceError):
    """The request names a model this server does not serve (maps to NOT_FOUND / HTTP 404)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.field = "model"


class AdapterInUseError(InferenceError):
    """A LoRA adapter cannot be unloaded while requests use it (maps to FAILED_PRECONDITION / HTTP 409)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.field = "lora_name"


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than the server accepts (INVALID_ARGUMENT / HTTP 413)."""

    def __init__(self, message: str) -> None:
        super().__init__("body", message)


class RequestTimeoutError(InvalidRequestError):
    """The request body did not arrive in time: a slow or stalled client (HTTP 408)."""

    def __init__(self, message: str) -> None:
        super().__init__("body", message)


class CapacityError(InferenceError):
    """The service is full right now: bounded queue by requests or tokens (maps to RESOURCE_EXHAUSTED)."""


class EngineStoppedError(InferenceError):
    """The engine is draining or stopped and takes no new work (maps to UNAVAILABLE)."""


class ServerStartError(InferenceError):
    """The server could not start listening: the message names the address (`HOST:PORT`) and the cause."""


class ModelLoadError(InferenceError):
    """The model folder could not be loaded into the engine."""


class DeadlineExceededError(InferenceError):
    """The request's deadline passed while it was queued or decoding; it was aborted (maps to DEADLINE_EXCEEDED)."""


class ClientGoneError(InferenceError):
    """The client cancelled or disconnected before its answer was complete: its own deadline, a hang-up mid-body or
    mid-stream (maps to CANCELLED; HTTP 499, nginx's "client closed request", which nobody reads but the access
    log shows). Never an error of the server's: not logged beyond the access log."""


class RequestFailedError(InferenceError):
    """An unexpected failure while serving one request; only that request fails (maps to INTERNAL)."""

    def __init__(self, message: str = "", *, logged: bool = False) -> None:
        super().__init__(message)
        self.logged = logged
        """True when whoever raised it has already written its one log line (the gRPC layer writes none)."""
