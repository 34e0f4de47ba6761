"""Incremental stop-string matching: the same answers as a brute-force search on every split of the text, and
work per character that does not grow with the number or length of the stop strings (counted, not timed)."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from inference_svc.engine.detokenizer import IncrementalDetokenizer
from inference_svc.engine.stop_matcher import StopAutomaton, StopMatcher
from inference_svc.engine.types import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS


def _brute_force(text: str, stops: tuple[str, ...]) -> tuple[int, int] | None:
    """(start, index) of the stop string that ends first (longest on a tie), by checking every prefix."""
    for end in range(1, len(text) + 1):
        hits = [(len(s), i) for i, s in enumerate(stops) if text[:end].endswith(s)]
        if hits:
            length, _ = max(hits)
            index = min(i for n, i in hits if n == length)
            return end - length, index
    return None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), min_size=1, max_size=5).map(tuple),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_matches_brute_force_on_any_split(text: str, stops: tuple[str, ...], cuts: list[int]) -> None:
    matcher = StopMatcher(StopAutomaton(stops))
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    found = None
    fed = ""
    for a, b in itertools.pairwise(bounds):
        hit = matcher.feed(text[a:b])
        fed += text[a:b]
        if hit is not None:
            found = (hit.start, hit.index)
            break
        assert matcher.held_back == _held_back(fed, stops)
    expected = _brute_force(text, stops)
    assert found == expected


def test_work_per_character_is_bounded_by_two_whatever_the_stops() -> None:
    rng = random.Random(0)
    text = "".join(rng.choice("ab") for _ in range(5000))
    few = ("zz",)
    # the worst case: 16 stop strings of 256 characters that the text keeps almost matching
    many = tuple("ab" * 127 + "a" + chr(ord("c") + i) for i in range(MAX_STOP_STRINGS))
    assert all(len(s) == MAX_STOP_STRING_CHARS for s in many)
    for stops in (few, many):
        matcher = StopMatcher(StopAutomaton(stops))
        for i in range(0, len(text), 3):  # 3-character "tokens"
            assert matcher.feed(text[i : i + 3]) is None
        assert matcher.steps <= 2 * len(text), (len(stops), matcher.steps)


def test_detokenizer_reports_the_matched_stop_and_bounded_work(small_tokenizer) -> None:
    text = "alpha beta gamma delta epsilon"
    ids = small_tokenizer.encode(text)
    stops = ("delta", "gamma delta", *("x" * 256 for _ in range(14)))
    d = IncrementalDetokenizer(small_tokenizer, stop=stops)
    out = "".join(d.add(t) for t in ids) + d.flush()
    assert d.stopped and d.matched_stop == "gamma delta"  # both end on the same character: the longest wins
    assert out == "alpha beta "
    assert d.stop_check_steps <= 2 * len("alpha beta gamma delta")
