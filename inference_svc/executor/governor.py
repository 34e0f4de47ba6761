"""The thread governor: between steps, the engine gives intra-op threads up while other processes keep its CPUs busy,
and takes them back when they leave, so a step never waits for a worker the OS has descheduled.

Why: a parallel region ends at a barrier. When another process holds one of the CPUs, the worker placed there runs
only in the time slices it gets, and every region of a step waits for it: a served decode step beside one busy core
ran many times slower than alone (docs/benchmarks.md §24), the same collapse llama.cpp shows. One thread fewer is
then faster than the thread count chosen for an idle machine, which is still the fastest once the others leave.

Contract:
- `ThreadGovernor(ceiling, cpus, enabled, root)` owns the count of torch intra-op threads the engine's steps run on
  (`active`, from `ceiling`: the count `inference_svc.executor.threads.settle` chose at load, never exceeded). The
  engine calls `poll(now)` on its own thread (torch's thread count is OpenMP's per-thread setting) when
  `now >= due`: a step compares one float (the step's own `time.monotonic()`), nothing else on the hot path, and the
  server's engine loop polls while idle too, so the count is already right when a request arrives.
- A poll reads `root/proc/stat` (the lines of `cpus`, this process's affinity) and `root/proc/self/stat` (this
  process's utime + stime, all its threads) and computes `others`: CPUs' worth of time that other processes (and
  the kernel, and a hypervisor's steal) kept busy on `cpus` since the previous reading. The CPUs the ceiling leaves
  unused (a cgroup quota of 2 CPUs on a 4-CPU cpuset: 2) absorb that load first: what is left over (`excess`) is
  what competes with this process's threads. `decide` is the rule, pure: the k-th thread is given up when
  excess >= (k - 1) + `BUSY` in `HOLD` consecutive readings (this one and the one before), and comes back at the
  first reading below that; never below one thread. Polls are `interval` (`INTERVAL`) seconds apart. While a
  thread is given up, quick readings (every `recover_interval`, `RECOVER_INTERVAL`, each over the time since the
  previous reading of either kind) come between them: they can only give threads back, by the same rule over their
  shorter window, and one that does becomes the baseline with its window as the only history. So the count
  returns one or two quick readings after the others leave (a regular reading's window would still hold up to a
  second of their load), and taking a thread still needs `HOLD` regular readings. A reading `idle_gap`
  (`IDLE_GAP`) seconds or more after the previous one (an engine stepped by hand, with pauses) is a new baseline,
  not a decision: an average over a long gap says little about now, and the next regular reading decides (and
  cannot give a thread up: it has no reading before it). A reading in which no clock tick passed on these CPUs
  decides nothing either.
- Each change calls `torch.set_num_threads(active)` on the polling thread and is logged once at INFO with the load
  that caused it; `changes` counts them. Tandem's kernels (`at::parallel_for`), oneDNN's and inductor's kernels
  compiled with `dynamic_threads` (`shared_model.compiled`) read the count at each call: the next step runs on it.
- Disabled (`enabled` False: `--thread-governor off`, one thread, or not a CPU device), `due` is infinity and the
  count stays the ceiling. A /proc file that cannot be read or parsed disables it too, logged once, count restored
  to the ceiling, never an exception into the step.
- Bits: a reduction that OpenMP splits by thread (oneDNN's GEMMs, some of inductor's kernels) rounds differently at
  another count, so a step's logits can differ in their last bits between one and two threads (docs/benchmarks.md
  §30). With the governor on, the thread count, and so the bits, follow
  other processes' load; bit-for-bit repeatable serving on a shared machine is `--thread-governor off`.
- `resolve(flag, ceiling, cpu)` is the load plan's `thread_governor` choice and whether it is on: 'auto' is on
  for a CPU engine of more than one thread; 'off' keeps the count fixed.

Thresholds: beside one busy process, a step on every CPU shares one of them with it, so the other process gets about
half of that CPU while Tandem's threads run (less when the engine thread lands there too, more while the workers
sleep between requests): `BUSY` sits well below half a CPU. Once a thread is given up, such a process takes the CPU
it freed, a whole CPU's worth, far above `BUSY`: the count stays down while it runs and comes back 0.2-0.4 s after
it stops (the quick readings; until §47 at the next regular reading, up to two seconds later, so a burst of requests
arriving as the other process finished ran on one thread). A light neighbour stays below `BUSY` at either count: a
metrics scraper, or a benchmark client, whose share grows with the server's token rate and stays under it at 64
streams (docs/benchmarks.md §30, §42). A burst (a client process starting, a neighbour's job of a second) shows in
one reading, not two: `HOLD` keeps it from taking a thread away. A neighbour that hovers at `BUSY` can move the
count every few seconds (two regular readings down, one quick reading up, so a pause of a fifth of a second in its
load gives the thread back for at least two seconds); beside such a light load both counts run about as fast. (Until
§42 a thread went on one reading and came back only below 0.15 CPU, which a 64-stream load's own client exceeds: one
burst kept the server on one thread until the load ended.)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

from inference_svc.executor.plan import Choice
from inference_svc.executor.threads import cpu_ticks, others_ticks, own_ticks

INTERVAL = 1.0
"""Seconds between two readings (and so between two decisions)."""
RECOVER_INTERVAL = 0.2
"""Seconds between two readings while a thread is given up (quick readings, which only give threads back)."""
IDLE_GAP = 3.0
"""A reading this many seconds or more after the previous one starts a new baseline instead of deciding."""
BUSY = 0.3
"""CPUs' worth of other processes' load that counts against one thread (k-1 + BUSY against the k-th)."""
HOLD = 2
"""Consecutive readings at or above a threshold before the thread it counts against is given up."""
log = logging.getLogger(__name__)
_Reading = tuple[float, dict[int, tuple[int, int]], int]
"""(when, per-CPU ticks, own ticks): one reading of /proc."""


def given_up(others: float, threshold: float) -> int:
    """Threads `others` CPUs' worth of load asks for at `threshold`: 0 below it, then one more per whole CPU."""
    return 0 if others < threshold else math.floor(others - threshold + 1e-9) + 1


def decide(ceiling: int, active: int, recent: Sequence[float]) -> int:
    """The thread count for the next interval: `ceiling` the most, `active` the count now, `recent` the CPUs' worth
    of load other processes kept over the last intervals, oldest first, the last one's last (each beyond the CPUs
    the ceiling leaves unused: the module docstring's `excess`; at least one). A thread is given up only where the
    last `HOLD` readings all ask for it (fewer readings give none up), and given back at the first that does not."""
    held = ceiling - active
    latest = given_up(recent[-1], BUSY)
    sustained = given_up(min(recent[-HOLD:]), BUSY) if len(recent) >= HOLD else 0
    held = max(sustained, min(held, latest))
    return max(1, ceiling - held)


class ThreadGovernor:
    """The engine's intra-op thread count between `ceiling` and one (see the module docstring)."""

    def __init__(
        self,
        ceiling: int,
        cpus: tuple[int, ...],
        enabled: bool = True,
        root: str | Path = "/",
        interval: float = INTERVAL,
        idle_gap: float = IDLE_GAP,
        recover_interval: float = RECOVER_INTERVAL,
    ) -> None:
        self.ceiling = ceiling
        self.cpus = cpus
        self.interval, self.idle_gap, self.recover_interval = interval, idle_gap, recover_interval
        self.active = ceiling
        """The count the steps run on now (set on the polling thread)."""
        self.others: float | None = None
        """Other processes' load on `cpus` over the last reading's window, in CPUs (None: not measured yet): a
        regular reading's second, or a quick reading's fifth of a second while a thread is given up."""
        self._recent: list[float] = []
        """The last `HOLD` regular readings' excess (oldest first), since the last baseline (after a quick reading
        gave threads back: that reading's alone)."""
        self.changes = 0
        self.due = 0.0 if enabled and ceiling > 1 else math.inf
        """When the next poll is due (`time.monotonic()` seconds); infinity when disabled."""
        self._stat = Path(root) / "proc/stat"
        self._self_stat = Path(root) / "proc/self/stat"
        self._last: _Reading | None = None
        """The previous regular reading (or quick one that gave threads back)."""
        self._quick: _Reading | None = None
        """The previous reading of either kind: a quick reading's window starts there."""

    @property
    def enabled(self) -> bool:
        return self.due != math.inf

    def poll(self, now: float) -> None:
        """Read, decide and apply (the engine's thread, `now >= due`); never raises."""
        try:
            ticks, own = cpu_ticks(self._stat.read_text()), own_ticks(self._self_stat.read_text())
        except (OSError, ValueError) as exc:
            self._disable(f"cannot read {self._stat} or {self._self_stat}: {exc}")
            return
        reading = (now, ticks, own)
        quick, self._quick = self._quick, reading
        last = self._last
        if last is not None and quick is not None and self.active < self.ceiling and now < last[0] + self.interval:
            self._recover(quick, reading)
            return
        self._last = reading
        if last is None or now - last[0] >= self.idle_gap:
            self._recent = []  # a new baseline
        elif (excess := self._excess(last, reading)) is not None:  # None: no clock tick on these CPUs, no measure
            self._recent = [*self._recent, excess][-HOLD:]
            self._set(decide(self.ceiling, self.active, self._recent), now - last[0])
        self.due = now + (self.recover_interval if self.active < self.ceiling else self.interval)

    def _recover(self, since: _Reading, reading: _Reading) -> None:
        """A quick reading (a thread is given up, the next regular one not due): threads back if its window asks
        for fewer given up; then it is the baseline and its excess the only history (the regular window before it
        still holds the load that has left). Never gives a thread up."""
        assert self._last is not None
        excess = self._excess(since, reading)
        active = self.active if excess is None else decide(self.ceiling, self.active, [excess])
        if excess is not None and active > self.active:
            self._last, self._recent = reading, [excess]
            self._set(active, reading[0] - since[0])
        regular = self._last[0] + self.interval
        self.due = regular if self.active == self.ceiling else min(reading[0] + self.recover_interval, regular)

    def _excess(self, before: _Reading, after: _Reading) -> float | None:
        """Others' load beyond the CPUs the ceiling leaves unused over `before`..`after` (sets `others`); None when
        no clock tick passed on `cpus`."""
        if not any(after[1].get(c, (0, 0))[1] > before[1].get(c, (0, 0))[1] for c in self.cpus):
            return None
        self.others = others_ticks(before[1], after[1], self.cpus, after[2] - before[2])
        spare = max(0, len(self.cpus) - self.ceiling)  # CPUs this process's threads never need
        return max(0.0, self.others - spare)

    def _set(self, active: int, window: float) -> None:
        """Apply `active` if it is a change, logged with the reading (`window` seconds) that caused it."""
        if active != self.active:
            self._apply(active)
            log.info("thread governor: other processes kept %.2f CPUs busy on this process's %d over %.1f s: %d "
                     "intra-op thread%s (of %d)", self.others, len(self.cpus), window, active,
                     "" if active == 1 else "s", self.ceiling)  # fmt: skip

    def _apply(self, active: int) -> None:
        import torch

        torch.set_num_threads(active)
        self.active = active
        self.changes += 1

    def _disable(self, why: str) -> None:
        log.warning("thread governor: off (%s); %d threads from here on", why, self.ceiling)
        self.due = math.inf
        self._last, self._quick, self._recent = None, None, []
        if self.active != self.ceiling:
            self._apply(self.ceiling)


def resolve(flag: str, ceiling: int, cpu: bool) -> tuple[bool, Choice]:
    """Whether the governor runs, and the load plan's `thread_governor` choice."""
    if flag == "off":
        return False, Choice("thread_governor", "off", f"--thread-governor off: {ceiling} threads at every step")
    if not cpu:
        return False, Choice("thread_governor", "off", "--thread-governor auto: not a CPU device")
    if ceiling <= 1:
        return False, Choice("thread_governor", "off", "--thread-governor auto: one thread, nothing to give up")
    return True, Choice("thread_governor", "on", (
        f"--thread-governor auto: up to {ceiling} threads, one fewer for each CPU other processes keep busy on this "
        f"process's CPUs ({BUSY:g} CPU in {HOLD} readings in a row takes one away, one reading below gives it "
        f"back), read from /proc every {INTERVAL:g} s between steps (every {RECOVER_INTERVAL:g} s while one is given "
        f"up, readings that only give threads back)"
    ))  # fmt: skip
