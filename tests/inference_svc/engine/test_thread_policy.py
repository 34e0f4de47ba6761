"""The thread policy on shared and quota-limited CPUs (issue 33, goal 3): the rule `inference_svc.executor.threads`
applies to the CPUs, cgroup quota and load it reads, tested with written cgroup and /proc files (a parsed file, the
same parser as on a real machine), and the choice reported in the load plan; not its speed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from inference_svc.engine import EngineConfig, EngineConfigError
from inference_svc.executor import threads
from inference_svc.executor.threads import CpuFacts, choose_threads, omp_environment, read_cpu_facts, wait_choice


def _machine(root: Path, cpus: str, cgroup: str, files: dict[str, str]) -> Path:
    """A fake root: /proc/self/status with `cpus` allowed, /proc/self/cgroup, and the cgroup files given."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/status").write_text(f"Name:\tpython\nCpus_allowed_list:\t{cpus}\nVoluntary:\t1\n")
    (root / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        path = root / "sys/fs/cgroup" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cgroup_v2_quota_of_one_and_a_half_cpus_gives_two_passive_threads(tmp_path: Path) -> None:
    root = _machine(tmp_path, "0-3", "0::/kubepods/pod1\n", {
        "cpu.max": "max 100000\n",
        "kubepods/cpu.max": "max 100000\n",
        "kubepods/pod1/cpu.max": "150000 100000\n",
    })  # fmt: skip
    facts = read_cpu_facts(root)
    assert facts.cpus == (0, 1, 2, 3) and facts.quota == 1.5 and facts.busy is None
    assert "kubepods/pod1/cpu.max (150000 100000)" in facts.quota_source
    policy = choose_threads("auto", "auto", facts)
    assert (policy.threads, policy.wait) == (2, "passive")
    assert "quota of 1.5 CPUs" in policy.threads_reason and policy.threads_reason.endswith("-> 2")
    assert "quota (1.5 CPUs) is below the 4 CPUs" in policy.wait_reason
    assert omp_environment(policy) == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


def test_the_smallest_quota_of_the_cgroup_and_its_ancestors_wins(tmp_path: Path) -> None:
    root = _machine(tmp_path, "0-7", "0::/a/b\n", {"a/cpu.max": "100000 100000", "a/b/cpu.max": "300000 100000"})
    facts = read_cpu_facts(root)
    assert facts.quota == 1.0 and "a/cpu.max" in facts.quota_source
    assert facts.notes == ()  # the root cgroup has no cpu.max: no limit there, nothing to report
    policy = choose_threads("auto", "auto", facts)
    assert (policy.threads, policy.wait) == (1, "default")  # one thread: no worker waits
    assert omp_environment(policy) == {}


def test_cgroup_v1_quota_and_no_quota(tmp_path: Path) -> None:
    v1 = "4:memory:/x\n3:cpu,cpuacct:/job\n0::/\n"
    limited = _machine(tmp_path / "limited", "0-7", v1, {
        "cpu/job/cpu.cfs_quota_us": "250000\n", "cpu/job/cpu.cfs_period_us": "100000\n",
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
    })  # fmt: skip
    facts = read_cpu_facts(limited)
    assert facts.quota == 2.5 and "cgroup v1" in facts.quota_source
    assert choose_threads("auto", "auto", facts).threads == 3
    free = _machine(tmp_path / "free", "0,2-3", v1, {
        "cpu/job/cpu.cfs_quota_us": "-1\n", "cpu/job/cpu.cfs_period_us": "100000\n",
    })  # fmt: skip
    facts = read_cpu_facts(free)
    assert facts.quota is None and facts.cpus == (0, 2, 3)
    policy = choose_threads("auto", "auto", facts)
    assert (policy.threads, policy.wait) == (3, "default")  # each thread its own CPU: the runtime's own wait
    assert "3 CPUs allowed (0,2-3; not pinned), no cgroup CPU quota" in policy.threads_reason
    assert omp_environment(policy) == {}
    bounded = choose_threads("auto", "bounded", facts)  # the flag for a machine shared for good
    assert omp_environment(bounded) == {"GOMP_SPINCOUNT": str(threads.BOUNDED_SPINS), "KMP_BLOCKTIME": "1"}


def test_a_malformed_cgroup_file_counts_as_no_limit_and_is_noted(tmp_path: Path) -> None:
    root = _machine(tmp_path, "0-1", "0::/\n", {"cpu.max": "lots\n"})
    facts = read_cpu_facts(root)
    assert facts.quota is None and any("cpu.max" in n for n in facts.notes)
    assert choose_threads("auto", "auto", facts).threads == 2


def _stat(ticks: dict[int, tuple[int, int]]) -> str:
    """/proc/stat with per-CPU (busy user ticks, idle ticks)."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    lines += [f"cpu{c} {busy} 0 0 {idle} 0 0 0 0 0 0" for c, (busy, idle) in ticks.items()]
    return "\n".join([*lines, "intr 1", "procs_running 3"]) + "\n"


def test_cpus_busy_at_start_are_reported_not_chosen_from(tmp_path: Path) -> None:
    before = _stat({0: (1000, 5000), 1: (2000, 4000)})
    after = _stat({0: (1002, 5098), 1: (2100, 4000)})  # over 100 ticks: cpu0 2% busy, cpu1 100% busy
    busy = threads.others_busy(before, after, (0, 1), own_seconds=0.0)
    assert busy == pytest.approx(1.02)
    policy = choose_threads("auto", "auto", CpuFacts((0, 1), busy=busy))
    assert (policy.threads, policy.wait) == (2, "default")  # neither follows one sample of the load
    assert "other processes kept 1.0 CPUs busy at start (reported, not chosen from)" in policy.wait_reason
    assert "--omp-wait bounded or passive" in policy.wait_reason  # the levers, named
    # this process's own time is not another's load: the same ticks, all of them ours, are no load at all
    hz = os.sysconf("SC_CLK_TCK")
    ours = threads.others_busy(before, after, (0, 1), own_seconds=102 / hz)
    assert ours == pytest.approx(0.0)
    assert "kept 0.0 CPUs busy" in choose_threads("auto", "auto", CpuFacts((0, 1), busy=ours)).wait_reason
    # a CPU outside the affinity is not counted; one thread has no worker to wait
    assert threads.others_busy(before, after, (0,), own_seconds=0.0) == pytest.approx(0.02)
    assert choose_threads(1, "auto", CpuFacts((0, 1), busy=2.0)).wait == "default"
    # the reader: two real reads of a written /proc/stat (unchanging here: nothing busy)
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/status").write_text("Cpus_allowed_list:\t0-1\n")
    (tmp_path / "proc/stat").write_text(before)
    assert read_cpu_facts(tmp_path, load_sample=0.01).busy == pytest.approx(0.0, abs=0.5)


def test_an_explicit_count_is_kept_and_oversubscription_waits_passively() -> None:
    policy = choose_threads(3, "auto", CpuFacts((0, 1)))
    assert (policy.threads, policy.wait) == (3, "passive") and "3 threads for 2 CPUs" in policy.wait_reason
    assert choose_threads(2, "active", CpuFacts((0, 1), quota=0.5)).wait == "active"


def test_the_wait_choice_reports_what_the_runtime_started_with() -> None:
    policy = choose_threads("auto", "passive", CpuFacts((0, 1)))
    assert wait_choice(policy, {"OMP_WAIT_POLICY": "PASSIVE"}).value == "passive"
    late = wait_choice(policy, {})
    assert late.value == "default" and "not in effect" in late.reason
    user = wait_choice(choose_threads("auto", "auto", CpuFacts((0, 1))), {"OMP_WAIT_POLICY": "active"})
    assert user.value == "active" and "from the environment" in user.reason
    bounded = choose_threads("auto", "bounded", CpuFacts((0, 1)))
    assert wait_choice(bounded, omp_environment(bounded)).value == "bounded"
    spun = wait_choice(bounded, {"GOMP_SPINCOUNT": "50000"})  # the user's own spin count, reported as such
    assert spun.value == "spin 50000" and "GOMP_SPINCOUNT=50000 from the environment" in spun.reason


def test_threads_and_omp_wait_are_validated_fields() -> None:
    assert EngineConfig(threads="4").threads == 4  # the flag's text
    for bad in ("0", "many", 0, -1, True):
        with pytest.raises(EngineConfigError, match="threads: must be 'auto' or a positive integer"):
            EngineConfig(threads=bad)
    with pytest.raises(EngineConfigError, match="omp_wait: must be one of"):
        EngineConfig(omp_wait="spin")


def test_the_engine_sizes_torchs_pool_and_records_the_choice(qwen3_dir: Path, make_engine) -> None:
    before = torch.get_num_threads()
    try:
        plan = make_engine(qwen3_dir, threads=1).info().load_plan
        assert plan.value("threads") == "1" and torch.get_num_threads() == 1
        assert [c.lever for c in plan][:2] == ["threads", "omp_wait"]
        auto = make_engine(qwen3_dir).info().load_plan
        assert int(auto.value("threads")) == torch.get_num_threads() <= len(os.sched_getaffinity(0))
        assert "--threads auto" in next(c.reason for c in auto if c.lever == "threads")
    finally:
        torch.set_num_threads(before)
