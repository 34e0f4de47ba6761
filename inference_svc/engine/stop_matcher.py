"""Incremental stop-string matching (an Aho–Corasick automaton): bounded work per character of output, however
many or however long the stop strings are.

Contract:
- `StopAutomaton.for_strings(stops)` compiles the stop strings once; the automaton is immutable and shared (an LRU
  cache of 16 keyed by the tuple of strings), so requests with the same stops pay for it once.
- `StopMatcher(automaton)` is one request's cursor over the text committed so far. `feed(text)` consumes the newly
  committed characters and returns a `StopMatch` for the first stop string completed, or None. "First" means the
  one that ends earliest in the text; among those ending on the same character, the longest. So the result does
  not depend on how the text was split into tokens.
- After a feed without a match, `held_back` is the length of the longest suffix of the text that is a proper prefix
  of some stop string: the text a stream must not show yet. It is the depth of the automaton's state.
- `steps` counts the automaton transitions taken (goto and failure links). Each character fed costs one goto plus
  failure-link steps that, summed over the whole text, never exceed the number of characters: at most 2 steps per
  character amortized, independent of the stop strings. (The naive check rescans every stop string per token.)
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    start: int
    """Index in the whole fed text where the matched stop string begins."""
    index: int
    """Which stop string matched (its position in the tuple given)."""


class StopAutomaton:
    """The trie of the stop strings with failure links and, per state, the longest stop string ending there."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.children: list[dict[str, int]] = [{}]
        self.depth: list[int] = [0]
        own: list[int] = [-1]  # index of the stop string that ends exactly at this state, -1 if none
        for i, s in enumerate(stops):
            node = 0
            for ch in s:
                nxt = self.children[node].get(ch)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[node][ch] = nxt
                    self.children.append({})
                    self.depth.append(self.depth[node] + 1)
                    own.append(-1)
                node = nxt
            if own[node] < 0:  # a duplicate keeps the first index
                own[node] = i
        self.fail = [0] * len(self.children)
        self.match = list(own)  # the longest stop string that is a suffix of this state's string (-1: none)
        order = deque(self.children[0].values())
        while order:
            node = order.popleft()
            for ch, child in self.children[node].items():
                f = self.fail[node]
                while f and ch not in self.children[f]:
                    f = self.fail[f]
                self.fail[child] = self.children[f].get(ch, 0)
                if self.match[child] < 0:
                    self.match[child] = self.match[self.fail[child]]
                order.append(child)

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def for_strings(stops: tuple[str, ...]) -> StopAutomaton:
        return StopAutomaton(stops)


class StopMatcher:
    """One request's position in a `StopAutomaton` (see the module docstring)."""

    def __init__(self, automaton: StopAutomaton) -> None:
        self._a = automaton
        self._state = 0
        self._pos = 0  # characters fed so far
        self.steps = 0

    @property
    def stops(self) -> tuple[str, ...]:
        return self._a.stops

    @property
    def held_back(self) -> int:
        return self._a.depth[self._state]

    def feed(self, text: str) -> StopMatch | None:
        a, state, pos, steps = self._a, self._state, self._pos, self.steps
        children, fail, match = a.children, a.fail, a.match
        found: StopMatch | None = None
        for ch in text:
            while True:
                steps += 1
                nxt = children[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            pos += 1
            hit = match[state]
            if hit >= 0:
                found = StopMatch(start=pos - len(a.stops[hit]), index=hit)
                break
        self._state, self._pos, self.steps = state, pos, steps
        return found
