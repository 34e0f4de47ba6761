"""Tool calls in chat output: the model family's call format, parsed out of the text, and its grammar.

Contract:
- `PARSERS` names the formats a server can parse (`--tool-call-parser`):
  - "hermes" (Qwen2.5/Qwen3, Hermes): each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
    text outside the blocks is the message's content.
  - "llama3_json" (Llama 3.1/3.2 JSON tool calling): the output is `{"name": ..., "parameters": {...}}` (optionally
    after `<|python_tag|>`), several separated by `; `; an output that is not such JSON is content.
- `parse(parser, text) -> (content, calls)`: calls as OpenAI's `tool_calls` entries (`id`, `type: "function"`,
  `function: {name, arguments}` with `arguments` a JSON string); a block that is not valid JSON or names no
  function stays in the content, as written.
- `ToolCallStream(parser)` turns text deltas into (content delta, completed calls) as they come: text that may be
  the start of a call is held back until it is known not to be one; a call is emitted whole once it closes, and
  `finish()` flushes the rest. Its pieces reassemble to `parse`'s answer on the whole text.
- `grammar_spec(parser, tools, name, parallel)`: the `StructuredOutput` that forces the output to be calls in the
  parser's format (one, or up to `MAX_PARALLEL` with `parallel`), each call's arguments valid for its function's
  JSON schema (`tool_choice: "required"`, or the named function only).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from inference_svc.engine.types import StructuredOutput

PARSERS = ("hermes", "llama3_json")
MAX_PARALLEL = 4
"""Most calls a grammar-forced answer holds with `parallel_tool_calls`."""
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _as_call(obj: Any, args_key: str) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return _call(obj["name"], args) if isinstance(args, dict) else None


def parse(parser: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content (None when only calls were written) and the tool calls of a whole output."""
    if parser == "hermes":
        return _parse_hermes(text)
    if parser == "llama3_json":
        return _parse_llama3(text)
    raise ValueError(f"unknown tool-call parser {parser!r}; one of {', '.join(PARSERS)}")


def _parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(_HERMES_OPEN, pos)
        end = -1 if start < 0 else text.find(_HERMES_CLOSE, start)
        if start < 0 or end < 0:
            content.append(text[pos:])
            break
        body = text[start + len(_HERMES_OPEN) : end]
        try:
            call = _as_call(json.loads(body), "arguments")
        except json.JSONDecodeError:
            call = None
        content.append(text[pos:start] if call is not None else text[pos : end + len(_HERMES_CLOSE)])
        if call is not None:
            calls.append(call)
        pos = end + len(_HERMES_CLOSE)
    rest = "".join(content)
    return (rest.strip() or None) if calls else rest, calls


def _parse_llama3(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        call = _as_call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return None, calls


class ToolCallStream:
    """Incremental `parse` (see the module docstring)."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; one of {', '.join(PARSERS)}")
        self.parser = parser
        self._text = ""
        self._content_sent = 0
        """Characters of the text already sent as content or consumed as calls."""
        self._mode: str | None = None
        """llama3_json: "calls" when the output opens like JSON, "content" otherwise (None: not yet known)."""

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, calls completed now)."""
        self._text += delta
        if self.parser == "llama3_json":
            return self._feed_llama3()
        return self._feed_hermes()

    def _feed_hermes(self) -> tuple[str, list[dict[str, Any]]]:
        text = self._text
        # everything up to a possible call start is content; a complete block is a call
        calls: list[dict[str, Any]] = []
        out = []
        while True:
            pending = text[self._content_sent :]
            start = pending.find(_HERMES_OPEN)
            if start < 0:
                keep = _partial_suffix(pending, _HERMES_OPEN)
                out.append(pending[: len(pending) - keep])
                self._content_sent += len(pending) - keep
                break
            out.append(pending[:start])
            end = pending.find(_HERMES_CLOSE, start)
            if end < 0:
                self._content_sent += start
                break
            block = pending[start : end + len(_HERMES_CLOSE)]
            _, found = _parse_hermes(block)
            if found:
                calls.extend(found)
            else:
                out.append(block)
            self._content_sent += end + len(_HERMES_CLOSE)
        return "".join(out), calls

    def _feed_llama3(self) -> tuple[str, list[dict[str, Any]]]:
        if self._mode is None:
            head = self._text.lstrip()
            if not head:
                return "", []
            maybe_tag = _PYTHON_TAG.startswith(head) or head.startswith(_PYTHON_TAG)
            self._mode = "calls" if head.startswith("{") or maybe_tag else "content"
        if self._mode == "calls":  # known only at the end: JSON, or content after all
            return "", []
        out = self._text[self._content_sent :]
        self._content_sent = len(self._text)
        return out, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still held back, calls found at the end)."""
        rest = self._text[self._content_sent :]
        self._content_sent = len(self._text)
        if self.parser == "llama3_json" and self._mode == "calls":
            _, calls = _parse_llama3(self._text)
            return ("", calls) if calls else (rest, [])
        return rest, []


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def grammar_spec(parser: str, tools: list[dict[str, Any]], name: str | None, parallel: bool) -> StructuredOutput:
    """The structured output that forces tool calls (see the module docstring)."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    spec = {
        "format": parser,
        "functions": [{"name": f["name"], "parameters": f.get("parameters") or {"type": "object"}} for f in functions],
        "max_calls": MAX_PARALLEL if parallel else 1,
    }
    return StructuredOutput("tool_calls", json.dumps(spec, sort_keys=True), "tool_choice")
