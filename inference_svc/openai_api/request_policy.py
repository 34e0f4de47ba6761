"""Which request fields the OpenAI-compatible API implements, accepts and ignores, or refuses, beyond the ones its
pydantic models (`protocol.py`) declare; and the log line an ignored unknown field gets.

Contract:
- `IGNORED`: fields OpenAI's or vLLM's completions/chat APIs define that change nothing Tandem returns (billing,
  storage, routing and reasoning hints); accepted with any value and dropped before validation, never logged. Each
  has the reason docs/api.md gives.
- `DEFAULT_ONLY`: vLLM fields whose default is what Tandem does; accepted at that value (or null), refused with a
  400 naming the field at any other value, since ignoring them would change the output silently.
- Unknown fields (neither declared by the model nor listed here), at the top level or inside a declared object
  (`stream_options.x`): `RequestPolicy(strict=False)` (the default, as vLLM) drops them and names each one in a
  WARNING of the `tandem.request_policy` logger the first time it is seen and then at most once per
  `interval` seconds per name (with the count of requests that sent it meanwhile), so a client that sends one every
  request writes one line, not one per request. At most `MAX_TRACKED_NAMES` names are remembered (the names are the
  client's); beyond that, one line per interval says how many requests carried names not tracked. Names are cut to
  `MAX_NAME_CHARS` in the log. `strict=True` (`--strict-request-fields`) answers an unknown field 400 naming it.
- One `RequestPolicy` per HTTP app (its log state belongs to it); thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from inference_svc.errors import InvalidRequestError

log = logging.getLogger("tandem.request_policy")

IGNORED: dict[str, str] = {
    "store": "Tandem keeps no completions (OpenAI's stored completions / evals)",
    "metadata": "tags for OpenAI's stored completions; nothing is stored",
    "service_tier": "one tier: every request is scheduled alike",
    "user": "an end-user tag for abuse monitoring; not recorded",
    "safety_identifier": "an end-user tag for abuse monitoring; not recorded",
    "prompt_cache_key": "prefix caching is automatic (--prefix-caching) and keyed by the tokens",
    "prompt_cache_retention": "prefix caching is automatic and bounded by the KV cache",
    "reasoning_effort": "a hint for OpenAI's reasoning models; use chat_template_kwargs (e.g. enable_thinking)",
    "verbosity": "a hint for OpenAI's reasoning models",
    "priority": "vLLM's priority scheduling; Tandem schedules first come, first served",
}
"""Field → why it is accepted and ignored."""

DEFAULT_ONLY: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "continue_final_message": False,
    "return_tokens_as_token_ids": False,
    "truncate_prompt_tokens": None,
    "prompt_embeds": None,
    "echo": False,
    "add_special_tokens": False,
    "chat_template": None,
    "documents": None,
    "bad_words": None,
    "allowed_token_ids": None,
    "logits_processors": None,
    "cache_salt": None,
    "return_token_ids": False,
    "modalities": ["text"],  # OpenAI's: text is the only output; audio is refused
}
"""vLLM field → the only value served (Tandem's behaviour); for a None, an empty list or object is the same."""

MAX_TRACKED_NAMES = 256
MAX_NAME_CHARS = 80
LOG_INTERVAL = 600.0
"""Seconds between two warnings about the same unknown field name."""


class RequestPolicy:
    """What happens to fields a request model does not declare (see the module docstring)."""

    def __init__(
        self, strict: bool = False, *, interval: float = LOG_INTERVAL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.strict = strict
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}
        """Unknown field name → (when it was last logged, requests that sent it since)."""
        self._untracked: tuple[float, int] = (float("-inf"), 0)

    def prepare(self, declared: Collection[str], body: Any) -> Any:
        """`body` without the `IGNORED` and `DEFAULT_ONLY` fields the request model does not itself `declare`; a
        `DEFAULT_ONLY` field at another value is an `InvalidRequestError` naming it. A body that is not an object is
        returned as it is (`parse` refuses it)."""
        if not isinstance(body, dict):
            return body
        drop = [name for name in body if (name in IGNORED or name in DEFAULT_ONLY) and name not in declared]
        if not drop:
            return body
        for name in drop:
            served = DEFAULT_ONLY.get(name, ...)
            if served is ...:
                continue
            value = body.get(name)
            if served is None and value in ([], {}):
                continue
            same = value == served and (type(value) is type(served) or (type(served) is float and type(value) is int))
            if value is not None and not same:
                raise InvalidRequestError(name, f"only {name}={_json(served)} is served (got {_json(value)})")
        return {k: v for k, v in body.items() if k not in drop}

    def unknown(self, names: list[str]) -> None:
        """The request carried these unknown fields (dotted paths): refused when strict, else logged (bounded)."""
        if self.strict:
            raise InvalidRequestError(names[0], f"unknown parameter '{names[0]}'")
        now = self._clock()
        lines: list[str] = []
        with self._lock:
            untracked = False
            for name in dict.fromkeys(names):
                entry = self._seen.get(name)
                if entry is None and len(self._seen) >= MAX_TRACKED_NAMES:
                    untracked = True
                    continue
                last, count = entry if entry is not None else (float("-inf"), 0)
                if now - last >= self.interval:
                    lines.append(_cut(name) + ("" if entry is None else f" (sent by {count + 1} requests since)"))
                    self._seen[name] = (now, 0)
                else:
                    self._seen[name] = (last, count + 1)
            if untracked:
                last, count = self._untracked
                if now - last >= self.interval:
                    lines.append(f"and fields of {count + 1} requests beyond the {MAX_TRACKED_NAMES} names tracked")
                    self._untracked = (now, 0)
                else:
                    self._untracked = (last, count + 1)
        if lines:
            log.warning("ignored request fields this server does not know: %s", "; ".join(lines))


def _cut(name: str) -> str:
    return repr(name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "...")


def _json(value: Any) -> str:
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= MAX_NAME_CHARS else text[:MAX_NAME_CHARS] + "..."
