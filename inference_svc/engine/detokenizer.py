"""Incremental detokenization with stop strings.

Contract:
- `IncrementalDetokenizer.add(token_id)` feeds one output token and returns the text newly safe to show. The deltas
  of one request concatenate exactly to `final_text()`, which equals `tokenizer.decode(ids, skip_special_tokens=True)`
  of the tokens fed (truncated before a stop string when one matched).
- A character spanning several byte-level tokens is held back until its last byte arrives (the decoded tail ends
  in U+FFFD until then). Text is committed in segments that end on a character boundary, so for byte-level BPE
  (Llama 3, Qwen) the concatenation is exact.
- Stop strings are matched incrementally over the committed text (`stop_matcher`), so a stop string split across
  tokens is found, and the work per token is bounded by the characters it adds, not by the number or length of
  the stop strings. Text that could still be the beginning of a stop string is held back; a matched stop string is
  stripped, and `matched_stop` says which one matched (the one that ends first; the longest among those).
  `add(token, match_stops=False)` (before a request's `min_tokens`) commits the text without matching or holding
  any back; matching then starts on the text that follows.
- Knows nothing about scheduling or sampling; owned by one Sequence.
"""

from __future__ import annotations

from inference_svc.engine.stop_matcher import StopAutomaton, StopMatcher
from shared_model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Token ids in, text deltas out, for one request."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._matcher = StopMatcher(StopAutomaton.for_strings(tuple(stop))) if stop else None
        self._ids: list[int] = []
        self._start = 0  # ids[:start] are decoded into _committed; ids[start:] end mid-character
        self._committed = ""
        self._emitted = 0  # characters of the text already returned as deltas
        self._stop_at: int | None = None  # index in the text where a matched stop string begins
        self._unmatched = 0  # characters committed while stop strings were not matched (before min_tokens)
        self.stopped = False
        """True once a stop string matched; the caller finishes the request."""
        self.matched_stop: str | None = None
        """The stop string that matched, once `stopped`."""

    def add(self, token_id: int, match_stops: bool = True) -> str:
        """Feed one token; return the new text delta (possibly empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        tail = self._tok.decode(self._ids[self._start :], skip_special_tokens=True)
        if tail.endswith(_REPLACEMENT):
            return ""  # an unfinished multi-byte character: wait for its next byte
        self._committed += tail
        self._start = len(self._ids)
        if self._matcher is not None and not match_stops and self._unmatched == len(self._committed) - len(tail):
            self._unmatched += len(tail)  # nothing fed to the matcher yet: this text is never matched
        elif self._matcher is not None:
            hit = self._matcher.feed(tail)
            if hit is not None:
                self._stop_at = self._unmatched + hit.start
                self.stopped = True
                self.matched_stop = self._matcher.stops[hit.index]
                return self._emit(self._stop_at)
            return self._emit(len(self._committed) - self._matcher.held_back)
        return self._emit(len(self._committed))

    def flush(self) -> str:
        """The request is finishing: return everything not yet returned (including an unfinished character)."""
        if self._stop_at is None and self._start < len(self._ids):
            self._committed += self._tok.decode(self._ids[self._start :], skip_special_tokens=True)
            self._start = len(self._ids)
        return self._emit(len(self.final_text()))

    @property
    def stop_check_steps(self) -> int:
        """Work spent matching stop strings so far (automaton transitions; see `stop_matcher`)."""
        return 0 if self._matcher is None else self._matcher.steps

    def final_text(self) -> str:
        return self._committed if self._stop_at is None else self._committed[: self._stop_at]

    # ------------------------------------------------------------------ helpers
    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self._committed[self._emitted : upto]
        self._emitted = upto
        return delta
