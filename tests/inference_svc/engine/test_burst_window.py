"""An idle engine's first step waits for a burst (`AdmissionLimits.burst_window_ms`): a request that follows the
first one within the window is prefilled in the same step; with the window at 0 the first step starts with the
first request alone; the setting refuses anything but a number of milliseconds in range. The rule is checked
with events (which requests the engine holds when its first step starts), never with timings."""

from __future__ import annotations

import asyncio
import threading

import pytest

from inference_svc.async_engine import AsyncEngine
from inference_svc.engine import SamplingParams
from inference_svc.settings import MAX_BURST_WINDOW_MS, AdmissionLimits, SettingsError

SAMPLING = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)


class _Watch:
    """The engine's add_request and step, observed: `added` once a request is in, `stepped` once a step starts,
    and for each step the number of requests the engine held as it started."""

    def __init__(self, engine) -> None:
        self.added, self.stepped = threading.Event(), threading.Event()
        self.held_at_step: list[int] = []
        add, step = engine.add_request, engine.step

        def add_request(*args, **kwargs):
            out = add(*args, **kwargs)
            self.added.set()
            return out

        def observed_step(*args, **kwargs):
            stats = engine.stats()
            self.held_at_step.append(stats.num_waiting + stats.num_running)
            self.stepped.set()
            return step(*args, **kwargs)

        engine.add_request, engine.step = add_request, observed_step


async def _tokens(engine: AsyncEngine, rid: str) -> int:
    return sum([len(out.new_token_ids) async for out in engine.generate([5, 6, 7], SAMPLING, request_id=rid)])


async def _two_requests(engine: AsyncEngine, second_after: threading.Event) -> None:
    """The first request, then a second once `second_after` is set; both run to their end."""
    first = asyncio.ensure_future(_tokens(engine, "first"))
    assert await asyncio.to_thread(second_after.wait, 60)
    second = asyncio.ensure_future(_tokens(engine, "second"))
    assert await asyncio.gather(first, second) == [2, 2]


@pytest.mark.parametrize(
    ("window_ms", "second_after", "held"),
    [
        # a window far longer than the few milliseconds between the two requests' arrival (bounded: a second): the
        # second request, sent once the first is in the engine, joins the first step
        (1000.0, "added", 2),
        # no window: the second, sent once a step has started, is not in it
        (0.0, "stepped", 1),
    ],
    ids=["within-the-window-joins", "no-window-starts-alone"],
)
def test_the_first_step_after_an_idle_spell(llama_dir, make_engine, window_ms, second_after, held) -> None:
    async def main() -> None:
        engine = AsyncEngine(make_engine(llama_dir), limits=AdmissionLimits(burst_window_ms=window_ms))
        watch = _Watch(engine.engine)
        await engine.start()
        try:
            await _two_requests(engine, getattr(watch, second_after))
        finally:
            await engine.stop()
        assert watch.held_at_step[0] == held, watch.held_at_step

    asyncio.run(main())


@pytest.mark.parametrize("bad", [-1.0, MAX_BURST_WINDOW_MS + 1, "1", True, None, float("nan")])
def test_the_window_must_be_milliseconds_in_range(bad) -> None:
    with pytest.raises(SettingsError, match="burst_window_ms"):
        AdmissionLimits(burst_window_ms=bad)
    assert AdmissionLimits(burst_window_ms=0).burst_window_ms == 0
    assert AdmissionLimits().burst_window_ms == 1.0
