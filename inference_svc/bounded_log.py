"""Failure logging whose size does not grow with the request: a request that fails in a deep recursion, or whose
error message quotes its input, writes a bounded entry.

Contract:
- `log_failure(logger, what, exc)` logs one ERROR record: `what`, the exception's type and message cut to
  `MAX_MESSAGE_CHARS`, and its traceback (chained causes included) with at most `MAX_FRAMES` frames per exception,
  the innermost ones (where it failed), the whole text cut to `MAX_TRACEBACK_CHARS`. So one request's failure
  writes at most about `MAX_MESSAGE_CHARS + MAX_TRACEBACK_CHARS` characters.
"""

from __future__ import annotations

import logging
import traceback

MAX_MESSAGE_CHARS = 500
MAX_FRAMES = 20
MAX_TRACEBACK_CHARS = 8000


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} more characters]"


def log_failure(logger: logging.Logger, what: str, exc: BaseException) -> None:
    """One bounded ERROR record for `exc` (see the module docstring)."""
    message = _cut(f"{type(exc).__name__}: {exc}", MAX_MESSAGE_CHARS)
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-MAX_FRAMES))
    logger.error("%s: %s\n%s", _cut(what, MAX_MESSAGE_CHARS), message, _cut(trace, MAX_TRACEBACK_CHARS).rstrip())
