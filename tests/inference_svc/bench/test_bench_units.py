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


# ---------------------------------------------------------------------------------------- datasets, flags, URLs
def test_dataset_reads_prompts_and_their_max_tokens(tmp_path) -> None:
    from inference_svc.bench.workload import dataset_requests, read_dataset

    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "hello world", "max_tokens": 7}\n'
        "\n"
        '{"text": "vLLM spells it text", "extra": 1}\n'
        '{"prompt": "third", "text": "ignored when prompt is there"}\n'
    )
    entries = read_dataset(path)
    assert [(e.prompt, e.max_tokens, e.line) for e in entries] == [
        ("hello world", 7, 1),
        ("vLLM spells it text", None, 3),
        ("third", None, 4),
    ]
    reqs = dataset_requests(entries, 5, LengthSpec(4, "fixed"), max_context=100)
    assert [r.prompt for r in reqs] == [
        "hello world",
        "vLLM spells it text",
        "third",
        "hello world",
        "vLLM spells it text",
    ]
    assert [r.max_new_tokens for r in reqs] == [7, 4, 4, 7, 4] and [r.index for r in reqs] == [0, 1, 2, 3, 4]
    assert all(r.prompt_token_ids == () for r in reqs)
    assert [r.max_new_tokens for r in dataset_requests(entries, 2, LengthSpec(4, "fixed"), max_context=6)] == [5, 4]


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("{not json", "not a JSON object"),
        ('["a list"]', "expected a JSON object"),
        ('{"max_tokens": 3}', "no 'prompt'"),
        ('{"prompt": ""}', "non-empty string"),
        ('{"prompt": [1, 2, 3]}', "non-empty string"),
        ('{"prompt": "x", "max_tokens": 0}', "'max_tokens' must be an integer >= 1"),
        ('{"prompt": "x", "max_tokens": true}', "'max_tokens' must be an integer >= 1"),
        ('{"prompt": "x", "max_tokens": 2.5}', "'max_tokens' must be an integer >= 1"),
    ],
)
def test_dataset_bad_line_is_named(tmp_path, line: str, why: str) -> None:
    from inference_svc.bench.workload import DatasetError, read_dataset

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(DatasetError) as exc:
        read_dataset(path)
    assert str(exc.value).startswith(f"{path}:3: ") and why in str(exc.value)


def test_bad_dataset_exits_2_with_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from inference_svc.bench.cli import main

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": 5}\n')
    assert main(["--dataset", str(path), "--out", str(tmp_path)]) == 2  # before any connection
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tandem bench: {path}:2: 'prompt' must be a non-empty string"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n \n")
    assert main(["--dataset", str(empty)]) == 2
    assert "holds no prompt" in capsys.readouterr().err
    assert main(["--dataset", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: cannot read" in capsys.readouterr().err


def test_openai_base_urls() -> None:
    from inference_svc.bench.openai_backend import base_urls

    for target in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert base_urls(target) == ("http://h:8000", "http://h:8000/v1")
    assert base_urls("https://gw.example/llm/v1") == ("https://gw.example/llm", "https://gw.example/llm/v1")
    for bad in ("127.0.0.1:8000", "ftp://h/", "http://"):
        with pytest.raises(ValueError):
            base_urls(bad)


def test_backend_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from inference_svc.bench.cli import main

    for argv in (
        ["--backend", "openai", "--target", "127.0.0.1:8000"],  # not a URL
        ["--backend", "openai", "--tls"],  # TLS over HTTP is an https:// target
        ["--model", "m"],  # grpc: the server names its model
        ["--tokenizer", "t.json"],
        ["--backend", "vllm"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
    capsys.readouterr()
    from inference_svc.bench.cli import build_parser

    assert "9090" not in build_parser().format_help()


def test_stream_error_statuses() -> None:
    from inference_svc.bench.openai_backend import _error_of, _status_of

    tandem = {
        "error": {"message": "queue full", "type": "rate_limit_error", "param": None, "code": "RESOURCE_EXHAUSTED"}
    }
    assert _status_of(_error_of(tandem), "HTTP_429") == ("RESOURCE_EXHAUSTED", "queue full")
    vllm_old = {"object": "error", "message": "too long", "type": "BadRequestError", "code": 400}
    assert _status_of(_error_of(vllm_old), "HTTP_400") == ("HTTP_400", "too long")
    assert _error_of({"choices": [], "usage": None}) is None
