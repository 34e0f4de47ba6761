"""tandem bench's pure parts: length distributions, request building, summaries, Prometheus parsing, cross-check."""

from __future__ import annotations

import math
import random

import pytest

from inference_svc.bench.loadgen import Level, RequestRecord
from inference_svc.bench.server_metrics import cross_check, parse, server_delta
from inference_svc.bench.stats import distribution, summarize
from inference_svc.bench.workload import LengthSpec, WorkloadError, make_requests, token_pool


def test_length_distributions_stay_in_bounds() -> None:
    rng = random.Random(0)
    fixed = LengthSpec(10, "fixed")
    assert {fixed.draw(rng, 100) for _ in range(20)} == {10}
    uni = [LengthSpec(100, "uniform", 0.5).draw(rng, 1000) for _ in range(2000)]
    assert min(uni) >= 50 and max(uni) <= 150 and abs(sum(uni) / len(uni) - 100) < 3
    logn = sorted(LengthSpec(64, "lognormal", 0.5).draw(rng, 10_000) for _ in range(2001))
    assert 56 <= logn[1000] <= 72  # median ≈ mean parameter
    assert max(LengthSpec(500, "uniform", 0.5).draw(rng, 300) for _ in range(50)) == 300  # capped
    with pytest.raises(WorkloadError):
        LengthSpec(0)
    with pytest.raises(WorkloadError):
        LengthSpec(10, "zipf")
    with pytest.raises(WorkloadError):
        LengthSpec(10, "uniform", 1.5)


def test_requests_fit_the_context_and_are_reproducible() -> None:
    pool = list(range(1000))
    a = make_requests(pool, 50, LengthSpec(80), LengthSpec(40), max_context=100, seed=1)
    b = make_requests(pool, 50, LengthSpec(80), LengthSpec(40), max_context=100, seed=1)
    assert a == b
    for r in a:
        assert len(r.prompt_token_ids) + r.max_new_tokens <= 100
        first = r.prompt_token_ids[0]
        assert list(r.prompt_token_ids) == list(range(first, first + len(r.prompt_token_ids)))  # a window
    with pytest.raises(WorkloadError):
        make_requests(pool, 1, LengthSpec(8), LengthSpec(8), max_context=1)


def test_token_pool_tokenizes_line_aligned_chunks() -> None:
    seen: list[str] = []

    def tok(s: str) -> list[int]:
        seen.append(s)
        return [len(line) for line in s.splitlines()]

    text = "".join(f"line {i}\n" for i in range(500))
    pool = token_pool(tok, text, chunk_chars=100)
    assert "".join(seen) == text
    assert all(chunk.endswith("\n") for chunk in seen)
    assert len(pool) == 500


def test_levels() -> None:
    assert Level("concurrency", 4).label == "c=4"
    assert Level("rate", math.inf).label == "rate=inf"
    assert Level("rate", 2.5).label == "rate=2.5/s"
    with pytest.raises(ValueError):
        Level("concurrency", 1.5)
    with pytest.raises(ValueError):
        Level("rate", 0)


def _record(i: int, start: float, token_times: list[float], status: str = "OK") -> RequestRecord:
    r = RequestRecord(i, prompt_tokens=10, max_new_tokens=len(token_times), start=start, status=status)
    r.token_times = token_times
    r.first_token = token_times[0] if token_times else None
    r.end = token_times[-1] if token_times else start + 0.5
    r.output_tokens = len(token_times)
    return r


def test_summary_figures() -> None:
    records = [
        _record(0, 0.0, [0.1, 0.2, 0.3]),  # ttft 100 ms, tpot 100 ms, itl 100, 100; e2e 300
        _record(1, 1.0, [1.3, 1.4, 1.7]),  # ttft 300 ms, tpot 200 ms, itl 100, 300; e2e 700
        _record(2, 2.0, [], status="RESOURCE_EXHAUSTED"),
    ]
    s = summarize(records, wall_s=2.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(13.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["ttft_ms"]["median"] == pytest.approx(200)
    assert s["tpot_ms"]["mean"] == pytest.approx(150)
    assert s["itl_ms"]["median"] == pytest.approx(100) and s["itl_ms"]["p99"] == pytest.approx(300, rel=0.05)
    assert s["e2e_ms"]["mean"] == pytest.approx(500)
    empty = summarize([], 1.0)
    assert empty["request_throughput"] == 0.0 and empty["ttft_ms"]["mean"] is None
    assert distribution([0.001, 0.002], (50, 90))["p50"] == pytest.approx(1.5)


EXPOSITION = """\
# TYPE tandem_time_to_first_token_seconds histogram
tandem_time_to_first_token_seconds_bucket{{le="+Inf"}} {n}
tandem_time_to_first_token_seconds_count {n}
tandem_time_to_first_token_seconds_sum {s}
# TYPE tandem_generation_tokens counter
tandem_generation_tokens_total {gen}
# TYPE tandem_requests_finished counter
tandem_requests_finished_total{{finish_reason="length"}} {n}
# TYPE tandem_request_errors counter
tandem_request_errors_total{{code="CANCELLED"}} 1.0
"""


def test_prometheus_delta_and_cross_check() -> None:
    before = parse(EXPOSITION.format(n=2, s=0.2, gen=10))
    after = parse(EXPOSITION.format(n=6, s=0.6, gen=50))
    d = server_delta(before, after)
    assert d["ttft_count"] == 4 and d["ttft_mean_ms"] == pytest.approx(100)
    assert d["generation_tokens"] == 40 and d["finished"] == {"length": 4} and d["errors"] == {}
    client = {"ttft_ms": {"mean": 104.0}, "client_output_tokens_all": 40, "completed": 4, "failed": 0}
    ok = cross_check(client, d, rtt_ms=1.0)
    assert ok["agrees"] and ok["ttft_overhead_ms"] == pytest.approx(4.0)
    slow = cross_check({**client, "ttft_ms": {"mean": 150.0}}, d, rtt_ms=1.0)
    assert slow["ttft_agrees"] is False and not slow["agrees"]
    early = cross_check({**client, "ttft_ms": {"mean": 90.0}}, d, rtt_ms=1.0)  # client cannot see it sooner
    assert not early["agrees"]
    lost = cross_check({**client, "client_output_tokens_all": 39}, d, rtt_ms=1.0)
    assert not lost["tokens_agree"]


def test_server_delta_reads_a_named_models_series() -> None:
    """The server labels every series with `model_name`: the delta is the same as without it."""
    from inference_svc.engine.types import Timing
    from inference_svc.metrics import ServiceMetrics

    m = ServiceMetrics(model_name="tiny")
    before = parse(m.render().decode())
    for _ in range(2):
        m.observe_finished("length", Timing(queue_ms=1.0, ttft_ms=40.0, tpot_ms=5.0, total_ms=80.0))
    m.observe_error("CANCELLED")
    d = server_delta(before, parse(m.render().decode()))
    assert d["finished"] == {"length": 2} and d["errors"] == {"CANCELLED": 1}
    assert d["ttft_count"] == 2 and d["ttft_mean_ms"] == pytest.approx(40.0)


def test_progress_bar_off_a_terminal_prints_tenths() -> None:
    import io

    from inference_svc.bench.progress import Progress

    out = io.StringIO()
    bar = Progress(20, "c=1", stream=out)
    for i in range(20):
        bar.update(ok=i % 5 != 0)
    bar.close()
    lines = out.getvalue().splitlines()
    assert 10 <= len(lines) <= 11 and "\r" not in out.getvalue()
    assert lines[-1].startswith("c=1") and "20/20 ok 16 err 4" in lines[-1]
    quiet = io.StringIO()
    Progress(5, "x", enabled=False, stream=quiet).update()
    assert quiet.getvalue() == ""


def test_tandem_bench_is_wired_into_the_dispatcher(capsys: pytest.CaptureFixture[str]) -> None:
    from shared_model.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    assert "--request-rate" in capsys.readouterr().out
