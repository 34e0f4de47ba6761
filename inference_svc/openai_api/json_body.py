"""Request bodies of the OpenAI-compatible API decoded from JSON, refusing what JSON allows but a request cannot hold.

Contract:
- `load(raw)` returns the decoded body, or raises `InvalidRequestError` whose `field` names where in the body the
  problem is (`prompt`, `messages[0].content`, `body` when nothing narrower is known):
  - bytes that are not UTF-8, or not JSON;
  - nesting deeper than `MAX_DEPTH` arrays/objects (no request field needs more; Python's JSON decoder would
    otherwise raise RecursionError at about 1,000 levels, and the template, pickling and validation code below
    it would recurse as deep);
  - an integer literal of more digits than Python converts (`sys.get_int_max_str_digits()`, 4,300 by default);
  - a string (value or key) holding a lone UTF-16 surrogate written as a `\\ud800` escape: it is not text, so no
    tokenizer, template or JSON encoder can take it;
  - an object with the same key twice (JSON decoders keep one of them silently; `field` is the object, the
    message names the key).
- Cost: a body that has no `\\u` surrogate escape and fewer brackets than `MAX_DEPTH` is only `json.loads`ed;
  others are walked once, iteratively, in Python. The error paths re-parse or scan the text once more.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from inference_svc.errors import InvalidRequestError

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have."""
_PATH_PARTS = 4
"""An error names at most this many steps of the path (`messages[0].extra[0]`), not the whole of a deep one."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"(\s*:)?|[\[\]{}]', re.S)


class _DuplicateKeys(dict):
    """An object that had a key twice (kept so that the walk can name where it is)."""

    key: str


def _objects() -> tuple[Any, list[bool]]:
    """A JSON object hook that marks objects with a repeated key, and the list it appends to when it does."""
    found: list[bool] = []

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) == len(pairs):
            return obj
        seen: set[str] = set()
        marked = _DuplicateKeys(obj)
        marked.key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        found.append(True)
        return marked

    return hook, found


class _LongInt:
    """Stands for an integer literal too long to convert, so that its place in the body can be found."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def load(raw: bytes) -> Any:
    """The body decoded, or InvalidRequestError naming the field (see the module docstring)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError("body", f"the body is not valid UTF-8 (byte {exc.start})") from None
    hook, duplicates = _objects()
    try:
        body = json.loads(text, object_pairs_hook=hook)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError("body", f"the body is not valid JSON ({exc})") from None
    except RecursionError:
        raise InvalidRequestError(_deep_field(text), f"JSON nested more than {MAX_DEPTH} levels deep") from None
    except ValueError:  # an integer literal over the conversion limit: find where it is
        body = json.loads(text, parse_int=_int_or_marker, object_pairs_hook=hook)
        _check(body)
        raise InvalidRequestError("body", "an integer is too long") from None  # pragma: no cover (found above)
    if _SURROGATE_ESCAPE.search(raw) or raw.count(b"[") + raw.count(b"{") > MAX_DEPTH or duplicates:
        _check(body)
    return body


def _int_or_marker(digits: str) -> int | _LongInt:
    try:
        return int(digits)
    except ValueError:
        return _LongInt(len(digits.lstrip("-")))


def _check(body: Any) -> None:
    """Walk the decoded body (iteratively) for the depth, surrogate and integer rules."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                raise InvalidRequestError(
                    _name(path),
                    "holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape not in a pair), which is not text",
                )
        elif isinstance(value, _LongInt):
            raise InvalidRequestError(
                _name(path), f"an integer of {value.digits} digits; at most {sys.get_int_max_str_digits()} are accepted"
            )
        elif isinstance(value, dict | list):
            if len(path) >= MAX_DEPTH:
                raise InvalidRequestError(_name(path), f"JSON nested more than {MAX_DEPTH} levels deep")
            if isinstance(value, _DuplicateKeys):
                raise InvalidRequestError(_name(path), f"the key {value.key!r} appears more than once")
            if isinstance(value, dict):
                for key, item in value.items():
                    if not _is_text(key):
                        raise InvalidRequestError(_name(path), "a key holds a lone UTF-16 surrogate, which is not text")
                    stack.append((item, (*path, key)))
            elif not all(type(item) is int for item in value):  # a token-id list needs no walk
                stack.extend((item, (*path, i)) for i, item in enumerate(value))


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _name(path: tuple[Any, ...]) -> str:
    """('messages', 0, 'content') → 'messages[0].content', cut after `_PATH_PARTS` steps."""
    out = ""
    for part in path[:_PATH_PARTS]:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out or "body"


def _deep_field(text: str) -> str:
    """The top-level key under which `text` nests deeper than MAX_DEPTH ('body' when it is not under one)."""
    depth, key = 0, "body"
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return key
        elif token in "]}":
            depth -= 1
        elif match.group(1) and depth == 1:
            try:
                key = json.loads(token[: token.rindex('"') + 1])
            except ValueError:
                key = "body"
    return key if _is_text(key) else "body"
