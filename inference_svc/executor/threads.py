"""The CPU threads a served model runs on: torch's intra-op thread count, the CPUs it may use, and OpenMP's wait
policy, chosen at start from what the machine allows and recorded in the load plan.

Contract:
- `read_cpu_facts(root, load_sample)` reads this process's CPU allowance: the CPUs it may run on
  (`os.sched_getaffinity(0)`, when `root` is the real '/'; else `root/proc/self/status`'s Cpus_allowed_list), the
  CPU quota of its cgroup and of every ancestor cgroup (v2 `cpu.max`; v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`
  under the `cpu` controller's mount; the smallest quota wins), and, when `load_sample` > 0 seconds, how many of
  those CPUs other processes kept busy meanwhile (`/proc/stat` read twice, this process's own CPU time taken out).
  Every path is under `root`, so a test hands a folder of written files: parsing is the same code either way.
  Unreadable or malformed files count as "no limit" and say so in the facts' `notes`, never an exception.
- `choose_threads(threads, omp_wait, facts)` is pure (the same facts and flags give the same `ThreadPolicy`):
  - threads 'auto': min(allowed CPUs, ceil(quota)); an integer is taken as given. Never the load: the count is
    the most threads a step runs on (the compile cache's key holds it), and it must not change with what else ran
    at start; the thread governor follows the load from there (`inference_svc.executor.governor`). Affinity is
    inherited, never narrowed: the OS scheduler places the threads, so a thread is not pinned to a CPU that
    another process may later take.
  - omp_wait 'auto': 'passive' (OpenMP's idle workers sleep at once instead of spinning) where the threads can
    outnumber the CPU time the process gets: a cgroup quota below the allowed CPUs, more threads than
    min(CPUs, quota) (spinning workers then take time slices from each other, and every parallel op waits for a
    descheduled worker). Otherwise the runtime's default (libgomp spins about 3 ms, then sleeps): the fastest on
    CPUs of its own. 'bounded' spins `BOUNDED_SPINS` iterations (libgomp's `GOMP_SPINCOUNT`, about ten microseconds
    at libgomp's own estimate of 100,000 a millisecond) and then sleeps: beside busy processes a served step then
    keeps most of its speed where the default collapses (a worker whose partner was descheduled spins for
    milliseconds), but a quiet machine's step pays for waking its workers (docs/benchmarks.md §26 has both
    machines' figures), so it is a flag for machines shared for good, not the rule. Other processes' load at start
    is measured and reported, never chosen from: one 0.1 s sample is not the machine's life, and a start that
    followed a busy moment must not serve slowly for good. One thread: no worker ever waits, nothing to choose.
    'passive' / 'bounded' / 'active' as given.
- The wait policy only takes effect when it is in the environment before the OpenMP runtime starts (torch's import
  loads it): `omp_environment(policy)` is the variables to set, and `tandem serve` sets them after parsing its flags
  and before it imports torch (`inference_svc.cli`). `wait_choice(policy, environ)` records what is in effect: the
  chosen policy where the environment carries it, otherwise what the environment (or the runtime's default) gave.
- `settle(threads, omp_wait, root)` is the engine's one call at load: it reads the facts (no load sample: the wait
  policy was fixed when the runtime started), sets torch's intra-op threads, and returns the `threads` and
  `omp_wait` choices with the count and the CPUs (`Settled`). The count is the ceiling of the thread governor
  (`inference_svc.executor.governor`), which gives threads up while other processes keep these CPUs busy and takes
  them back when they leave: the start's choice never follows the load, the governor does, between steps.
- The /proc readers `cpu_ticks` (/proc/stat's per-CPU lines), `own_ticks` (/proc/<pid>/stat's utime + stime) and
  `others_ticks` (other processes' load between two readings) are shared with the governor.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from inference_svc.executor.plan import Choice

LOAD_SAMPLE_SECONDS = 0.1
"""How long `tandem serve` watches `/proc/stat` for other processes' load before choosing the wait policy."""
BOUNDED_SPINS = 1000
"""libgomp spin iterations of an idle worker under 'bounded' before it sleeps (GOMP_SPINCOUNT)."""
_ENVIRONMENTS = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"},
    "bounded": {"GOMP_SPINCOUNT": str(BOUNDED_SPINS), "KMP_BLOCKTIME": "1"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE", "KMP_BLOCKTIME": "200"},
}
"""Each policy's variables for libgomp (torch's CPU wheels) and Intel's OpenMP (KMP_BLOCKTIME in ms, its least
non-zero unit), set before the runtime starts."""


@dataclass(frozen=True)
class CpuFacts:
    """What the machine gives this process (see the module docstring)."""

    cpus: tuple[int, ...]
    """The CPUs this process may run on (its affinity)."""
    quota: float | None = None
    """CPUs' worth of time per period the cgroup allows (1.5: one and a half CPUs); None: no quota."""
    quota_source: str = ""
    """Which file set `quota`, e.g. 'cgroup v2 /sys/fs/cgroup/pod/cpu.max (150000 100000)'."""
    busy: float | None = None
    """CPUs' worth of other processes' load on `cpus` over the sample; None: not sampled."""
    notes: tuple[str, ...] = ()
    """Files that could not be read or parsed (then treated as no limit)."""


@dataclass(frozen=True)
class ThreadPolicy:
    """The chosen thread count and wait policy, and why."""

    threads: int
    wait: str
    """'passive', 'active' or 'default' (the OpenMP runtime's own)."""
    threads_reason: str
    wait_reason: str


# ---------------------------------------------------------------------------------------------------- reading
def read_cpu_facts(root: str | Path = "/", load_sample: float = 0.0) -> CpuFacts:
    """This process's CPUs, cgroup quota and (when `load_sample` > 0 seconds) other processes' load on its CPUs."""
    root = Path(root)
    notes: list[str] = []
    if root == Path("/"):
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    else:
        cpus = _cpus_from_status(root / "proc/self/status", notes)
    quota, source = cgroup_quota(root, notes)
    busy = None
    if load_sample > 0:
        busy = _sample_busy(root / "proc/stat", cpus, load_sample, notes)
    return CpuFacts(cpus, quota, source, busy, tuple(notes))


def _cpus_from_status(path: Path, notes: list[str]) -> tuple[int, ...]:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return parse_cpu_list(line.split(":", 1)[1])
    except (OSError, ValueError) as exc:
        notes.append(f"{path}: {exc}")
    return tuple(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11); ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"an empty CPU list: {text!r}")
    return tuple(sorted(cpus))


def cgroup_quota(root: Path, notes: list[str]) -> tuple[float | None, str]:
    """(CPUs' worth of quota, the file that set it) for this process's cgroup and its ancestors; (None, '') when no
    cgroup limits it. v2 is read where `root/proc/self/cgroup` has a '0::' line, v1's `cpu` controller otherwise."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError as exc:
        notes.append(f"no cgroup membership readable ({exc})")
        return None, ""
    best: tuple[float | None, str] = (None, "")
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":
            found = _walk(root / "sys/fs/cgroup", path, _read_v2, "cgroup v2", notes)
        elif "cpu" in controllers.split(","):
            found = _walk(root / "sys/fs/cgroup/cpu", path, _read_v1, "cgroup v1", notes)
            if found[0] is None and not (root / "sys/fs/cgroup/cpu").exists():
                found = _walk(root / "sys/fs/cgroup/cpu,cpuacct", path, _read_v1, "cgroup v1", notes)
        else:
            continue
        if found[0] is not None and (best[0] is None or found[0] < best[0]):
            best = found
    return best


def _walk(mount: Path, path: str, read, kind: str, notes: list[str]) -> tuple[float | None, str]:
    """The smallest quota from the cgroup at `path` under `mount` up to the mount's root."""
    best: tuple[float | None, str] = (None, "")
    parts = [p for p in path.strip().split("/") if p]
    for depth in range(len(parts), -1, -1):
        folder = mount.joinpath(*parts[:depth])
        try:
            found = read(folder)
        except FileNotFoundError:  # no limit set here (a root cgroup has no cpu.max)
            continue
        except (OSError, ValueError) as exc:
            notes.append(f"{kind} {folder}: {exc}")
            continue
        if found is not None and (best[0] is None or found[0] < best[0]):
            best = (found[0], f"{kind} {found[1]}")
    return best


def _read_v2(folder: Path) -> tuple[float, str] | None:
    path = folder / "cpu.max"
    text = path.read_text().split()
    if len(text) != 2:
        raise ValueError(f"cpu.max holds {' '.join(text)!r}, expected 'QUOTA PERIOD'")
    if text[0] == "max":
        return None
    quota, period = int(text[0]), int(text[1])
    if quota <= 0 or period <= 0:
        raise ValueError(f"cpu.max holds {' '.join(text)!r}")
    return quota / period, f"{path} ({text[0]} {text[1]})"


def _read_v1(folder: Path) -> tuple[float, str] | None:
    quota = int((folder / "cpu.cfs_quota_us").read_text())
    if quota < 0:  # -1: no quota
        return None
    period = int((folder / "cpu.cfs_period_us").read_text())
    if quota == 0 or period <= 0:
        raise ValueError(f"cpu.cfs_quota_us {quota}, cpu.cfs_period_us {period}")
    return quota / period, f"{folder}/cpu.cfs_quota_us ({quota} per {period})"


def _sample_busy(stat: Path, cpus: tuple[int, ...], seconds: float, notes: list[str]) -> float | None:
    try:
        before, own_before = stat.read_text(), _own_cpu_seconds()
        time.sleep(seconds)
        after, own_after = stat.read_text(), _own_cpu_seconds()
        return others_busy(before, after, cpus, own_after - own_before)
    except (OSError, ValueError) as exc:
        notes.append(f"load: {stat}: {exc}")
        return None


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def cpu_ticks(text: str) -> dict[int, tuple[int, int]]:
    """{cpu: (busy ticks, total ticks)} from /proc/stat's `cpuN` lines (busy: all but idle and iowait; stolen time
    counts as busy: the CPU was not ours). ValueError when the text has no per-CPU line."""
    out = {}
    for line in text.splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *fields = line.split()
            ticks = [int(f) for f in fields[:8]]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            out[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    if not out:
        raise ValueError("no per-CPU lines")
    return out


def own_ticks(text: str) -> int:
    """This process's CPU time in clock ticks (utime + stime, all its threads) from a /proc/<pid>/stat text;
    ValueError on anything else."""
    fields = text[text.rindex(")") + 1 :].split()  # after the command name, which may hold spaces and ')'
    if len(fields) < 13:
        raise ValueError(f"a /proc/<pid>/stat line of {len(fields)} fields after the name")
    return int(fields[11]) + int(fields[12])


def others_ticks(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], cpus: tuple[int, ...], own: float
) -> float:
    """CPUs' worth of load on `cpus` between two `cpu_ticks` readings, less this process's own CPU time over the same
    window (`own`, in ticks); 0.0 when no tick passed on those CPUs."""
    busy = total = seen = 0
    for cpu in cpus:
        if cpu in before and cpu in after:
            busy += after[cpu][0] - before[cpu][0]
            total += after[cpu][1] - before[cpu][1]
            seen += 1
    if total <= 0:
        return 0.0
    return max(0.0, (busy - own) / (total / seen))  # total / seen: ticks per CPU over the window


def others_busy(before: str, after: str, cpus: tuple[int, ...], own_seconds: float) -> float:
    """CPUs' worth of load on `cpus` between two /proc/stat texts, less this process's own CPU time (`own_seconds`,
    in CPU-seconds) over the same window."""
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return others_ticks(cpu_ticks(before), cpu_ticks(after), cpus, own_seconds * hz)


# ---------------------------------------------------------------------------------------------------- choosing
def choose_threads(threads: int | str, omp_wait: str, facts: CpuFacts) -> ThreadPolicy:
    """The thread count and wait policy by the rule of the module docstring."""
    n_cpus = len(facts.cpus)
    where = f"{n_cpus} CPU{'s' if n_cpus != 1 else ''} allowed ({_cpu_span(facts.cpus)}; not pinned)"
    cap = n_cpus
    if facts.quota is not None:
        cap = max(1, min(cap, math.ceil(facts.quota - 1e-9)))
        where += f", a quota of {facts.quota:g} CPUs ({facts.quota_source})"
    else:
        where += ", no cgroup CPU quota"
    if threads == "auto":
        count = cap
        threads_reason = f"--threads auto: {where} -> {count}"
    else:
        count = int(threads)
        threads_reason = f"--threads {count}; {where}"
    wait, wait_reason = _choose_wait(omp_wait, count, n_cpus, facts.quota, facts.busy)
    return ThreadPolicy(count, wait, threads_reason, wait_reason)


def _choose_wait(asked: str, threads: int, n_cpus: int, quota: float | None, busy: float | None) -> tuple[str, str]:
    if asked != "auto":
        return asked, f"--omp-wait {asked}"
    if threads == 1:
        return "default", "--omp-wait auto: one thread, no OpenMP worker waits"
    budget = n_cpus if quota is None else min(n_cpus, quota)
    if quota is not None and quota < n_cpus:
        return "passive", f"--omp-wait auto: the quota ({quota:g} CPUs) is below the {n_cpus} CPUs allowed"
    if threads > budget:
        return "passive", f"--omp-wait auto: {threads} threads for {budget:g} CPUs"
    seen = "" if busy is None else f"; other processes kept {busy:.1f} CPUs busy at start (reported, not chosen from)"
    return "default", (
        f"--omp-wait auto: {threads} threads on {n_cpus} CPUs, each its own: the runtime's default wait{seen} (a "
        "machine shared for good wants --omp-wait bounded or passive)"
    )


def _cpu_span(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# ---------------------------------------------------------------------------------------------------- applying
def omp_environment(policy: ThreadPolicy) -> dict[str, str]:
    """The variables that give the OpenMP runtimes (libgomp, Intel's) `policy.wait`, to set before torch is imported;
    {} for the runtime's default."""
    return dict(_ENVIRONMENTS.get(policy.wait, {}))


def wait_choice(policy: ThreadPolicy, environ: Mapping[str, str]) -> Choice:
    """The `omp_wait` choice as in effect: `environ` is the environment the OpenMP runtime started with."""
    wanted = {k: v for k, v in _ENVIRONMENTS.get(policy.wait, {}).items() if k != "KMP_BLOCKTIME"}
    found = {k: environ[k].strip() for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if environ.get(k, "").strip()}
    if {k: v.upper() for k, v in found.items()} == {k: v.upper() for k, v in wanted.items()}:
        return Choice("omp_wait", policy.wait, policy.wait_reason)
    if found:
        shown = " ".join(f"{k}={v}" for k, v in found.items())
        in_effect = found.get("OMP_WAIT_POLICY", "default").lower()
        if "GOMP_SPINCOUNT" in found:
            in_effect = f"spin {found['GOMP_SPINCOUNT']}" if in_effect == "default" else in_effect
        return Choice("omp_wait", in_effect, f"{policy.wait_reason}; in effect: {shown} from the environment the "
                      "OpenMP runtime started with")  # fmt: skip
    why = (
        f"{policy.wait_reason}; not in effect: the OpenMP runtime started before it could be set (`tandem serve` "
        "sets it before it imports torch), so the runtime's default holds"
    )
    return Choice("omp_wait", "default", why)


@dataclass(frozen=True)
class Settled:
    """What `settle` chose: the two choices for the load plan, the thread count set and the CPUs it was chosen for."""

    choices: tuple[Choice, Choice]
    threads: int
    cpus: tuple[int, ...]


def settle(threads: int | str, omp_wait: str, root: str | Path = "/") -> Settled:
    """The engine's call at load: read the facts, set torch's intra-op threads, return the choices."""
    import torch

    facts = read_cpu_facts(root)
    policy = choose_threads(threads, omp_wait, facts)
    torch.set_num_threads(policy.threads)
    reason = policy.threads_reason + (f" (unread: {'; '.join(facts.notes)})" if facts.notes else "")
    choices = (Choice("threads", str(policy.threads), reason), wait_choice(policy, os.environ))
    return Settled(choices, policy.threads, facts.cpus)
