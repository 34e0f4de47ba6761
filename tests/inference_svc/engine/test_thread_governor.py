"""The thread governor (issue 33, goal 3: shared CPUs): its rule over written /proc/stat and /proc/self/stat
snapshots (the same parser as on a real machine), its record in the load plan and the metrics, and a served engine
whose steps run on the count it sets. No timing decides anything here: the governor's clock is the `now` a test
passes, or a short interval with bounded waits on what the engine thread records."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest
import torch

from inference_svc.async_engine import AsyncEngine
from inference_svc.engine import EngineConfig, EngineConfigError, SamplingParams
from inference_svc.executor import governor
from inference_svc.executor.governor import BUSY, HOLD, INTERVAL, RECOVER_INTERVAL, ThreadGovernor, decide
from inference_svc.metrics import ServiceMetrics

HZ = 100  # ticks per second in the written files (any rate: the rule is a ratio of ticks)


class Proc:
    """A fake root: /proc/stat with per-CPU counters and /proc/self/stat with this process's utime + stime, advanced
    by the test one interval at a time."""

    def __init__(self, root: Path, cpus: int) -> None:
        self.root = root
        (root / "proc/self").mkdir(parents=True)
        self.ticks = {c: [0] * 8 for c in range(cpus)}  # user nice system idle iowait irq softirq steal
        self.own = 0
        self.write()

    def advance(self, seconds: float = 1.0, busy: dict[int, float] | None = None, steal: dict[int, float] | None = None,
                own: float = 0.0) -> None:  # fmt: skip
        """`seconds` pass: CPU c is busy `busy[c]` of the time (user) and stolen `steal[c]` of it, idle otherwise;
        this process ran `own` CPUs' worth over it (counted in the CPUs' user time, as the kernel counts it)."""
        busy, steal = busy or {}, steal or {}
        own_left = own
        for c, t in self.ticks.items():
            total = round(seconds * HZ)
            mine = min(1.0 - busy.get(c, 0.0) - steal.get(c, 0.0), own_left)
            own_left -= mine
            user = round((busy.get(c, 0.0) + mine) * total)
            stolen = round(steal.get(c, 0.0) * total)
            t[0] += user
            t[7] += stolen
            t[3] += total - user - stolen
        self.own += round(own * seconds * HZ)
        self.write()

    def write(self) -> None:
        lines = ["cpu  " + " ".join(str(sum(t[i] for t in self.ticks.values())) for i in range(8)) + " 0 0"]
        lines += [f"cpu{c} " + " ".join(map(str, t)) + " 0 0" for c, t in self.ticks.items()]
        (self.root / "proc/stat").write_text("\n".join([*lines, "intr 1 2", "ctxt 3", "btime 4", ""]))
        own = f"4242 (python3 (x) y) R 1 4242 4242 0 -1 4194304 10 0 0 0 {self.own} 0 0 0 20 0 3 0 100 200 300\n"
        (self.root / "proc/self/stat").write_text(own)  # a command name with spaces and ')' in it


def test_the_rule_gives_threads_up_one_per_cpu_on_two_readings_and_back_on_one() -> None:
    assert HOLD == 2
    assert decide(4, 4, [0.0, 0.0]) == 4
    assert decide(4, 4, [BUSY - 0.01, BUSY - 0.01]) == 4
    assert decide(4, 4, [BUSY, BUSY]) == 3
    assert decide(4, 4, [1.0 + BUSY, 1.0 + BUSY]) == 2  # two CPUs' worth at once
    assert decide(4, 4, [1.0 + BUSY, BUSY]) == 3  # as much as both readings ask for
    assert decide(4, 4, [9.0, 9.0]) == 1  # never below one
    assert decide(4, 4, [9.0]) == 4  # one reading (the first after a baseline) gives nothing up
    assert decide(4, 4, [0.0, 9.0]) == 4  # a burst of one interval gives nothing up
    assert decide(4, 4, [0.0, 9.0, 9.0]) == 1  # the last HOLD readings decide, not older ones
    assert decide(4, 3, [BUSY, 1.0 + BUSY]) == 3  # a second thread only once two readings ask for it
    assert decide(4, 3, [9.0, BUSY - 0.01]) == 4  # back at the first reading below BUSY
    assert decide(4, 3, [0.0, BUSY]) == 3  # kept while a reading asks for it
    assert decide(4, 2, [1.0 + BUSY, 1.0]) == 3  # one CPU's load left: one thread back
    assert decide(2, 1, [1.0, 1.0]) == 1  # the busy process keeps the CPU it was given: stays at one
    assert decide(2, 1, [0.5, 0.2]) == 2  # a light neighbour (a benchmark client) gives it back
    assert decide(1, 1, [5.0, 5.0]) == 1


def test_a_light_neighbour_burst_neither_drops_nor_holds_a_thread(tmp_path: Path, monkeypatch) -> None:
    """The 64-stream benchmark's case: the client keeps ~0.2 CPU busy all along, with one burst above BUSY (its
    start, or a neighbour's one-second job): the count stays at the ceiling; and once a neighbour that ran for
    seconds has taken a thread, the client's 0.2 does not keep it away."""
    applied: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", applied.append)
    proc = Proc(tmp_path, 2)
    gov = ThreadGovernor(2, (0, 1), root=tmp_path)
    gov.poll(0.0)
    for t, busy in enumerate((0.2, 0.6, 0.2, 0.2), start=1):
        proc.advance(busy={1: busy}, own=2.0 - busy)
        gov.poll(float(t))
        assert gov.active == 2
    for t in (5, 6):  # a neighbour busy for two seconds: one thread given up
        proc.advance(busy={1: 0.5}, own=1.5)
        gov.poll(float(t))
    assert gov.active == 1 and applied == [1]
    proc.advance(busy={1: 0.2}, own=1.0)  # it left; the client's load remains
    gov.poll(7.0)
    assert gov.others == pytest.approx(0.2) and gov.active == 2 and applied == [1, 2]


def test_others_busy_takes_a_thread_away_and_it_comes_back_when_they_leave(tmp_path: Path, monkeypatch) -> None:
    applied: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", applied.append)  # what the governor asks torch for, recorded
    proc = Proc(tmp_path, 2)
    gov = ThreadGovernor(2, (0, 1), root=tmp_path)
    gov.poll(0.0)  # the baseline
    assert (gov.active, gov.others, gov.due) == (2, None, governor.INTERVAL)
    proc.advance(busy={1: 0.5}, own=1.5)  # a busy loop on CPU 1 sharing it with one of our two threads
    gov.poll(1.0)
    assert gov.others == pytest.approx(0.5) and gov.active == 2 and applied == []  # one reading: not yet
    proc.advance(busy={1: 0.5}, own=1.5)
    gov.poll(2.0)
    assert gov.others == pytest.approx(0.5) and gov.active == 1 and applied == [1]
    proc.advance(busy={1: 1.0}, own=1.0)  # it has its CPU now: we stay at one
    gov.poll(3.0)
    assert gov.others == pytest.approx(1.0) and gov.active == 1 and applied == [1]
    proc.advance(own=1.0)  # it left
    gov.poll(4.0)
    assert gov.others == pytest.approx(0.0) and gov.active == 2 and applied == [1, 2] and gov.changes == 2


def test_quick_readings_give_the_thread_back_soon_after_the_others_leave(tmp_path: Path, monkeypatch) -> None:
    """While a thread is given up, readings come every RECOVER_INTERVAL; the first whose window has the others gone
    gives it back and becomes the baseline, so the next regular reading covers only the time since (one over the
    window from the last regular reading would still hold their load and take the thread away again)."""
    applied: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", applied.append)
    q = RECOVER_INTERVAL
    assert q <= INTERVAL / 4  # several quick readings in a regular one's interval
    proc = Proc(tmp_path, 2)
    gov = ThreadGovernor(2, (0, 1), root=tmp_path)
    gov.poll(0.0)
    for t in (1.0, 2.0):
        proc.advance(busy={1: 1.0}, own=1.0)
        gov.poll(t)
    assert gov.active == 1 and gov.due == pytest.approx(2.0 + q)  # a quick reading next
    for k in (1, 2):  # still there at the first two quick readings
        proc.advance(q, busy={1: 1.0}, own=1.0)
        gov.poll(gov.due)
        assert gov.active == 1 and gov.others == pytest.approx(1.0) and gov.due == pytest.approx(2.0 + (k + 1) * q)
    proc.advance(q, own=1.0)  # it left
    gov.poll(gov.due)
    assert gov.active == 2 and applied == [1, 2] and gov.others == pytest.approx(0.0)
    back = 2.0 + 3 * q
    assert gov.due == pytest.approx(back + INTERVAL)  # at the ceiling: regular readings only, from there
    proc.advance(INTERVAL, own=2.0)
    gov.poll(gov.due)
    assert gov.active == 2 and gov.others == pytest.approx(0.0) and applied == [1, 2]
    for k in (2, 3):  # and the rule is as before: two regular readings to take a thread
        proc.advance(busy={1: 0.5}, own=1.5)
        gov.poll(back + k * INTERVAL)
    assert applied == [1, 2, 1]


def test_a_quick_reading_never_gives_a_thread_up(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    q = RECOVER_INTERVAL
    proc = Proc(tmp_path, 4)
    gov = ThreadGovernor(4, (0, 1, 2, 3), root=tmp_path)
    gov.poll(0.0)
    for t in (1.0, 2.0):
        proc.advance(busy={3: 0.5}, own=3.5)
        gov.poll(t)
    assert gov.active == 3
    for k in range(1, 5):  # three CPUs' worth of load, read only by quick readings
        proc.advance(q, busy={1: 1.0, 2: 1.0, 3: 1.0}, own=1.0)
        gov.poll(2.0 + k * q)
        assert gov.active == 3 and gov.others == pytest.approx(3.0)
    assert gov.due == pytest.approx(3.0)  # the next regular reading keeps its time
    proc.advance(1.0 - 4 * q, busy={1: 1.0, 2: 1.0, 3: 1.0}, own=1.0)
    gov.poll(3.0)  # regular: the window since 2.0, and the reading before asked for one thread only
    assert gov.active == 3
    proc.advance(busy={1: 1.0, 2: 1.0, 3: 1.0}, own=1.0)
    gov.poll(4.0)
    assert gov.active == 1


def test_this_process_own_time_is_never_others_load(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: pytest.fail(f"set_num_threads({n})"))
    proc = Proc(tmp_path, 2)
    gov = ThreadGovernor(2, (0, 1), root=tmp_path)
    gov.poll(0.0)
    for t in range(1, 4):
        proc.advance(own=2.0)  # both CPUs busy, all of it ours
        gov.poll(float(t))
        assert gov.others == pytest.approx(0.0) and gov.active == 2


def test_only_the_cpus_of_this_process_affinity_count(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    proc = Proc(tmp_path, 4)
    gov = ThreadGovernor(2, (0, 1), root=tmp_path)
    gov.poll(0.0)
    proc.advance(busy={2: 1.0, 3: 1.0})  # busy CPUs this process may not use: no neighbour of ours
    gov.poll(1.0)
    assert gov.others == pytest.approx(0.0) and gov.active == 2
    for t in (2.0, 3.0):
        proc.advance(busy={0: 1.0, 2: 1.0, 3: 1.0})
        gov.poll(t)
    assert gov.others == pytest.approx(1.0) and gov.active == 1


def test_cpus_the_ceiling_leaves_unused_absorb_others_load_first(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    proc = Proc(tmp_path, 4)
    gov = ThreadGovernor(2, (0, 1, 2, 3), root=tmp_path)  # a quota of 2 CPUs on a 4-CPU cpuset
    gov.poll(0.0)
    proc.advance(busy={2: 1.0, 3: 1.0}, own=2.0)  # two busy neighbours on the CPUs we do not need
    gov.poll(1.0)
    assert gov.others == pytest.approx(2.0) and gov.active == 2
    for t in (2.0, 3.0):
        proc.advance(busy={1: 0.5, 2: 1.0, 3: 1.0}, own=1.5)  # a third shares a CPU with one of our threads
        gov.poll(t)
    assert gov.others == pytest.approx(2.5) and gov.active == 1


def test_stolen_time_counts_as_others_load(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    proc = Proc(tmp_path, 2)
    gov = ThreadGovernor(2, (0, 1), root=tmp_path)
    gov.poll(0.0)
    for t in (1.0, 2.0):
        proc.advance(steal={0: 0.6})  # the hypervisor gave CPU 0's time to another guest
        gov.poll(t)
    assert gov.others == pytest.approx(0.6) and gov.active == 1


def test_a_long_idle_gap_is_a_new_baseline_not_a_decision(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    proc = Proc(tmp_path, 2)
    gov = ThreadGovernor(2, (0, 1), root=tmp_path)
    gov.poll(0.0)
    proc.advance(seconds=30.0, busy={1: 1.0})  # a busy neighbour for most of a long pause, then...
    gov.poll(30.0)
    assert gov.active == 2 and gov.others is None  # no decision on the stale average
    proc.advance(own=2.0)  # ...gone by the time steps run again
    gov.poll(31.0)
    assert gov.others == pytest.approx(0.0) and gov.active == 2
    proc.advance(busy={1: 0.5}, own=1.5)
    gov.poll(32.0)
    assert gov.active == 2  # the reading before it was a baseline, not a reading of the load
    proc.advance(busy={1: 0.5}, own=1.5)
    gov.poll(33.0)
    assert gov.active == 1


def test_a_reading_without_a_tick_decides_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    proc = Proc(tmp_path, 2)
    gov = ThreadGovernor(2, (0, 1), root=tmp_path)
    gov.poll(0.0)
    for t in (1.0, 2.0):
        proc.advance(busy={1: 1.0})
        gov.poll(t)
    assert gov.active == 1
    gov.poll(3.0)  # the files did not change: no clock tick, no information (not "the others left")
    assert gov.active == 1 and gov.others == pytest.approx(1.0)


def test_a_reading_without_a_tick_keeps_the_readings_before_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    proc = Proc(tmp_path, 2)
    gov = ThreadGovernor(2, (0, 1), root=tmp_path)
    gov.poll(0.0)
    proc.advance(busy={1: 0.5}, own=1.5)
    gov.poll(1.0)
    gov.poll(2.0)  # no tick: neither a reading of the load nor a reason to forget the one before
    assert gov.active == 2
    proc.advance(busy={1: 0.5}, own=1.5)
    gov.poll(3.0)  # the second reading in a row that asks for a thread
    assert gov.active == 1


def test_unreadable_proc_turns_it_off_at_the_ceiling(tmp_path: Path, monkeypatch) -> None:
    applied: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", applied.append)
    proc = Proc(tmp_path, 2)
    gov = ThreadGovernor(2, (0, 1), root=tmp_path)
    gov.poll(0.0)
    for t in (1.0, 2.0):
        proc.advance(busy={1: 1.0})
        gov.poll(t)
    assert gov.active == 1
    (tmp_path / "proc/self/stat").write_text("garbage")
    gov.poll(3.0)  # never raises into a step
    assert not gov.enabled and gov.due == math.inf and gov.active == 2 and applied == [1, 2]


def test_the_field_the_plan_choice_and_the_off_cases() -> None:
    assert EngineConfig().thread_governor == "auto"
    with pytest.raises(EngineConfigError, match="thread_governor: must be one of"):
        EngineConfig(thread_governor="on")
    on, choice = governor.resolve("auto", 2, cpu=True)
    assert on and choice.value == "on" and "up to 2 threads" in choice.reason
    for flag, ceiling, cpu, why in (("off", 4, True, "--thread-governor off"), ("auto", 1, True, "one thread"),
                                    ("auto", 4, False, "not a CPU device")):  # fmt: skip
        on, choice = governor.resolve(flag, ceiling, cpu)
        assert not on and choice.value == "off" and why in choice.reason
    assert not ThreadGovernor(4, (0, 1, 2, 3), enabled=False).enabled
    assert not ThreadGovernor(1, (0,)).enabled


def test_the_engine_records_the_choice_and_exports_the_count(qwen3_dir: Path, make_engine) -> None:
    before = torch.get_num_threads()
    try:
        engine = make_engine(qwen3_dir, threads=2)
        plan = engine.info().load_plan
        assert [c.lever for c in plan][:3] == ["threads", "omp_wait", "thread_governor"]
        assert plan.value("thread_governor") == "on" and engine.thread_governor.ceiling == 2
        assert make_engine(qwen3_dir, threads=2, thread_governor="off").info().load_plan.value("thread_governor") == (
            "off"
        )
        metrics = ServiceMetrics()
        metrics.observe_stats(engine.stats())
        assert "tandem_cpu_threads_active 2.0" in metrics.render().decode()
    finally:
        torch.set_num_threads(before)


def test_a_served_engine_steps_on_the_governors_count(qwen3_dir: Path, make_engine, tmp_path: Path) -> None:
    """The governor reads a root whose files this test rewrites; the count torch reports inside the model's forward
    (on the engine thread, between the governor's polls) follows them down and back up."""
    before = torch.get_num_threads()
    proc = Proc(tmp_path, 2)
    inner = make_engine(qwen3_dir, threads=2)
    inner.thread_governor = ThreadGovernor(2, (0, 1), root=tmp_path, interval=0.02)
    seen: list[int] = []
    run = inner.runner.run

    def recording_run(batch):
        seen.append(torch.get_num_threads())  # inside the step, on the engine thread
        return run(batch)

    inner.runner.run = recording_run
    gov = inner.thread_governor

    async def wait_for(active: int, others: float | None = None) -> None:
        deadline = time.monotonic() + 30.0  # a liveness bound: the idle engine loop polls every few ms
        while gov.active != active or (others is not None and gov.others != pytest.approx(others)):
            assert time.monotonic() < deadline, f"the governor stayed at {gov.active} threads ({gov.others} busy)"
            await asyncio.sleep(0.01)

    async def tokens(engine: AsyncEngine) -> list[int]:
        seen.clear()
        out: list[int] = []
        async for o in engine.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True)):
            out.extend(o.new_token_ids)
        return out

    async def main() -> None:
        engine = AsyncEngine(inner)
        await engine.start()
        try:
            quiet = await tokens(engine)
            assert seen and set(seen) == {2}
            proc.advance(busy={1: 0.5}, own=1.5)  # a neighbour on CPU 1, measured by the next poll...
            await wait_for(2, others=0.5)  # ...which alone gives nothing up
            proc.advance(busy={1: 0.5}, own=1.5)  # still there a reading later
            await wait_for(1)
            assert await tokens(engine) == quiet and set(seen) == {1}
            proc.advance(own=1.0)  # it left
            await wait_for(2)
            assert await tokens(engine) == quiet and set(seen) == {2}
            assert inner.stats().threads_active == 2 and inner.stats().others_cpu_busy == pytest.approx(0.0)
        finally:
            await engine.stop()

    try:
        asyncio.run(main())
    finally:
        torch.set_num_threads(before)
