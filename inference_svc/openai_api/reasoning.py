"""Reasoning parsers: a chat completion's `<think>…</think>` block moved out of `content` into `reasoning_content`,
for whole answers and for streams, as vLLM's `--reasoning-parser` does.

Contract:
- `REASONING_PARSERS` names the parsers (`--reasoning-parser`, off by default):
  - `qwen3`: the output holds a block when it opens with `<think>` (after optional whitespace, which is dropped);
    the text up to `</think>` is the reasoning, the rest the content. An output that does not open with `<think>`
    is all content (Qwen3 with `enable_thinking: false`, whose template writes an empty block into the prompt).
  - `deepseek_r1`: the output starts inside the block (DeepSeek-R1's template, and Qwen3's Thinking-2507
    templates, open `<think>` in the prompt): everything up to `</think>` is the reasoning; a `<think>` at the
    output's start is dropped too.
  A block never closed (the output stopped inside it) is all reasoning. Text after `</think>` is content as it is,
  further tags included.
- `ReasoningSplitter(name)` is one choice's state: `feed(text_delta) -> (reasoning, content)` returns the text of
  each kind that is now certain, holding back only what could still be the start of a tag (at most
  `len("</think>") - 1` characters, or the leading whitespace while `qwen3` has not seen whether `<think>` opens
  the output), so tags split over any token boundaries are found; `finish()` returns what was held back. The
  pieces of each kind concatenate to what `split(name, text)` returns for the whole text, however the text was cut.
- `split(name, text) -> (reasoning | None, content | None)`: None for reasoning when no block was found; None for
  content when a block was found and nothing follows it (vLLM's convention).
- Works on text, not token ids: the tags are found whether the vocabulary has them as single tokens or not.
"""

from __future__ import annotations

START = "<think>"
END = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


class ReasoningSplitter:
    """One choice's streaming split of text into reasoning and content (see the module docstring)."""

    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; one of {', '.join(REASONING_PARSERS)}")
        self.name = name
        self.state = "start"
        """start (the output's first characters not yet decided), reasoning, or content."""
        self.found = False
        """Whether a reasoning block was found (opened, explicitly or by the parser's rule)."""
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """`text` appended; the reasoning and content text now certain."""
        self._pending += text
        reasoning, content = [], []
        while True:
            pending = self._pending
            if self.state == "start":
                rest = pending.lstrip()
                if rest.startswith(START):
                    self._pending, self.state, self.found = rest[len(START) :], "reasoning", True
                    continue
                if START.startswith(rest):  # only whitespace or a prefix of the tag so far: not decided
                    break
                if self.name == "deepseek_r1":
                    self.state, self.found = "reasoning", True
                else:
                    self.state = "content"
                continue
            if self.state == "reasoning":
                at = pending.find(END)
                if at >= 0:
                    reasoning.append(pending[:at])
                    self._pending, self.state = pending[at + len(END) :], "content"
                    continue
                keep = _partial_suffix(pending, END)
                reasoning.append(pending[: len(pending) - keep])
                self._pending = pending[len(pending) - keep :]
                break
            content.append(pending)
            self._pending = ""
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The end of the output: what was held back, as the kind it belongs to."""
        pending, self._pending = self._pending, ""
        if self.state == "start" and self.name == "deepseek_r1":
            self.state, self.found = "reasoning", True
        if self.state == "reasoning":
            return pending, ""
        return "", pending


def split(name: str, text: str) -> tuple[str | None, str | None]:
    """The whole output's (reasoning, content) under parser `name` (see the module docstring)."""
    splitter = ReasoningSplitter(name)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    reasoning, content = r1 + r2, c1 + c2
    if not splitter.found:
        return None, content
    return reasoning, content or None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag` (0 when none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
