"""Incremental detokenization with stop strings.

Contract:
- `IncrementalDetokenizer.add(token_id)` feeds one output token and returns the text newly safe to show. The deltas
  of one request concatenate exactly to `final_text()`, which equals `tokenizer.decode(ids, skip_special_tokens=True)`
  of the tokens fed (truncated before a stop string when one matched).
- A character spanning several byte-level tokens is held back until its last byte arrives (the decoded tail ends
  in U+FFFD until then). Text is committed in segments that end on a character boundary, so for byte-level BPE
  (Llama 3, Qwen) the concatenation is exact.
- Stop strings are searched in the whole committed text, so a stop string split across tokens is found. Text that
  could still be the beginning of a stop string is held back; a matched stop string is stripped.
- Knows nothing about scheduling or sampling; owned by one Sequence.
"""

from __future__ import annotations

from shared_model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Token ids in, text deltas out, for one request."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self._ids: list[int] = []
        self._start = 0  # ids[:start] are decoded into _committed; ids[start:] end mid-character
        self._committed = ""
        self._emitted = 0  # characters of the text already returned as deltas
        self._stop_at: int | None = None  # index in the text where a matched stop string begins
        self.stopped = False
        """True once a stop string matched; the caller finishes the request."""

    def add(self, token_id: int) -> str:
        """Feed one token; return the new text delta (possibly empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        tail = self._tok.decode(self._ids[self._start :], skip_special_tokens=True)
        if tail.endswith(_REPLACEMENT):
            return ""  # an unfinished multi-byte character: wait for its next byte
        search_from = max(0, len(self._committed) - self._max_stop + 1)
        self._committed += tail
        self._start = len(self._ids)
        if self._stop:
            hit = self._find_stop(search_from)
            if hit is not None:
                self._stop_at = hit
                self.stopped = True
                return self._emit(hit)
            return self._emit(len(self._committed) - self._held_back())
        return self._emit(len(self._committed))

    def flush(self) -> str:
        """The request is finishing: return everything not yet returned (including an unfinished character)."""
        if self._stop_at is None and self._start < len(self._ids):
            self._committed += self._tok.decode(self._ids[self._start :], skip_special_tokens=True)
            self._start = len(self._ids)
        return self._emit(len(self.final_text()))

    def final_text(self) -> str:
        return self._committed if self._stop_at is None else self._committed[: self._stop_at]

    # ------------------------------------------------------------------ helpers
    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self._committed[self._emitted : upto]
        self._emitted = upto
        return delta

    def _find_stop(self, search_from: int) -> int | None:
        best: int | None = None
        for s in self._stop:
            i = self._committed.find(s, search_from)
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        text, held = self._committed, 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held
