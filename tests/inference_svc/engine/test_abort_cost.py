"""Aborts cost O(1) each (issue 34): a request id is looked up, never searched for, when it is aborted, and a step
applies any number of pending aborts in one pass over the scheduler's queues.

Proved by counting comparisons, not by timing: request ids are a `str` subclass whose `__eq__` counts its calls.
A list of pending aborts (the old `request_id in self._pending_aborts`) compares each new id with every pending
one, about n²/2 calls for n aborts; a dict compares it with at most the few ids that share its hash."""

from __future__ import annotations

import pytest

from inference_svc.engine import Engine, FinishReason, SamplingParams


class CountingId(str):
    """A request id that counts how often it is compared for equality."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        CountingId.comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


@pytest.fixture
def engine(qwen3_dir, make_engine) -> Engine:
    return make_engine(qwen3_dir, kv_cache_memory="256KiB", max_num_seqs=4)


def test_aborting_many_requests_costs_o1_each_and_one_step(engine: Engine) -> None:
    n = 400
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    ids = [CountingId(f"req-{i}") for i in range(n)]
    for rid in ids:
        engine.add_request(rid, [1, 2, 3, 4], params)
    engine.step()  # some run (max_num_seqs), the rest wait
    assert engine.stats().num_running == 4 and engine.stats().num_waiting == n - 4
    CountingId.comparisons = 0
    # equal ids, other objects (as a client's abort names its request): no identity shortcut anywhere
    assert all(engine.abort_request(CountingId(str(rid))) for rid in ids)
    assert not any(engine.abort_request(CountingId(str(rid))) for rid in ids[:50])  # already pending: refused
    assert CountingId.comparisons <= 4 * (n + 50), f"{CountingId.comparisons} comparisons for {n + 50} aborts"
    outputs = engine.step()  # one step finishes every one of them
    assert sorted(o.request_id for o in outputs) == sorted(ids)
    assert all(o.finished and o.finish_reason is FinishReason.CANCELLED for o in outputs)
    st = engine.stats()
    assert st.num_running == 0 and st.num_waiting == 0 and st.kv_blocks_used == 0
    assert not engine.has_unfinished_requests()


def test_abort_all_keeps_the_others_in_order(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for i in range(10):
        engine.add_request(f"r{i}", [5, 6, 7], params)
    engine.step()
    for i in (1, 5, 6, 9):
        assert engine.abort_request(f"r{i}")
    cancelled = [o.request_id for o in engine.step() if o.finish_reason is FinishReason.CANCELLED]
    assert cancelled == ["r1", "r5", "r6", "r9"]  # in the order asked
    left = [s.request_id for s in engine.scheduler.running + engine.scheduler.waiting]
    assert sorted(left) == sorted(f"r{i}" for i in (0, 2, 3, 4, 7, 8))
    assert [s.seq_index for s in engine.scheduler.waiting] == sorted(s.seq_index for s in engine.scheduler.waiting)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().kv_blocks_used == 0
