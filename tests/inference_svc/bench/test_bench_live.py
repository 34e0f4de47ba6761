"""tandem bench against a real `tandem serve` subprocess on free loopback ports: the sweep, the files it writes,
and the cross-check of the server's Prometheus figures (TTFT, tokens out) against the client's — with the metrics
port given or found in GetModelInfo; the same sweep over the server's OpenAI-compatible HTTP API
(`--backend openai`), whose report has the gRPC run's columns; `--dataset` text prompts over both backends; the
API key as a bearer token. Also the compose healthcheck CLI (`python -m inference_svc.healthcheck`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inference_svc.bench.cli import main as bench_main
from inference_svc.client import TandemClient
from inference_svc.healthcheck import main as healthcheck_main
from inference_svc.serve_process import ServeProcess
from shared_model.bundle import save_bundle
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer
from tests.conftest import free_port, tiny_config

pytestmark = pytest.mark.slow  # a served subprocess and load sweeps (not in make test-fast)


@pytest.fixture(scope="module")
def bench_bundle(tmp_path_factory: pytest.TempPathFactory, small_tokenizer: Tokenizer) -> Path:
    model = build_model(tiny_config(), seed=0)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(3))
    return save_bundle(tmp_path_factory.mktemp("bench-model") / "bundle", tiny_config(), model, small_tokenizer)


@pytest.fixture(scope="module")
def served(bench_bundle: Path) -> Iterator[tuple[str, str]]:
    """(grpc target, metrics url) of a tiny bundle served by `tandem serve` in its own process (HTTP API on too)."""
    metrics = free_port()
    flags = ["--metrics-port", str(metrics), "--http-port", "0", "--device", "cpu", "--attention-backend", "torch"]
    with ServeProcess(bench_bundle, [*flags, "--shutdown-grace", "5"]) as server:
        server.wait_serving(120)
        yield server.target, f"http://127.0.0.1:{metrics}/metrics"


def test_concurrency_sweep_writes_results_and_agrees_with_the_server(served: tuple[str, str], tmp_path: Path) -> None:
    target, metrics_url = served
    out = tmp_path / "run"
    argv = ["--target", target, "--metrics-url", metrics_url, "--concurrency", "1,4", "--num-requests", "8"]
    argv += ["--warmup", "2", "--input-len", "32", "--output-len", "16", "--len-dist", "fixed", "--out", str(out)]
    argv += ["--duration", "60", "--no-progress"]
    assert bench_main(argv) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["meta"]["command"].startswith("tandem bench --target")
    assert report["meta"]["model"]["max_context"] > 0 and report["meta"]["date"]
    for level in report["levels"]:
        s = level["summary"]
        assert s["completed"] == 8 and s["errors"] == {}
        assert s["total_output_tokens"] == 8 * 16 and s["total_input_tokens"] == 8 * 32
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert s[metric]["mean"] > 0 and s[metric]["median"] > 0 and s[metric]["p99"] >= s[metric]["median"]
        assert s["ttft_ms"]["median"] < s["e2e_ms"]["median"]
        assert len(level["requests"]) == 8 and all(len(r["itl_ms"]) >= 1 for r in level["requests"])
        check = level["server_check"]
        # The server counted exactly the tokens the client received, and the requests it finished.
        assert check["tokens_agree"] and check["server_generation_tokens"] == 8 * 16, check
        assert check["server_finished"] == 8
        assert check["server"]["ttft_count"] == 8
    # TTFT: the server's Prometheus mean is the client's minus the trip from client to engine and back, so never
    # more than the client's (the upper bound of that trip is the machine's speed: the report's verdict, not a test)
    solo = report["levels"][0]["server_check"]
    assert solo["ttft_overhead_ms"] >= -1.0, solo
    assert solo["ttft_agrees"] == (solo["ttft_overhead_ms"] <= solo["ttft_tolerance_ms"]), solo
    for png in ("throughput_latency.png", "latency_cdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_poisson_rate_mode_and_default_output_folder(
    served: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, _ = served
    monkeypatch.chdir(tmp_path)
    argv = ["--target", target, "--no-server-metrics", "--request-rate", "20,inf", "--num-requests", "6"]
    argv += ["--warmup", "0", "--input-len", "16", "--output-len", "4", "--no-plots", "--no-progress"]
    assert bench_main(argv) == 0
    (result,) = tmp_path.glob("bench-results/*/results.json")  # under the current directory by default
    report = json.loads(result.read_text())
    assert [lv["label"] for lv in report["levels"]] == ["rate=20/s", "rate=inf"]
    assert all(lv["server_check"] is None and lv["summary"]["completed"] == 6 for lv in report["levels"])


def test_duration_bounds_a_level(served: tuple[str, str], tmp_path: Path) -> None:
    target, _ = served
    many = 10**5  # more than any machine finishes in the level's 1.5 s at concurrency 1 (a loopback round trip each)
    argv = ["--target", target, "--no-server-metrics", "--concurrency", "1", "--num-requests", str(many)]
    argv += ["--duration", "1.5", "--drain-timeout", "5", "--warmup", "0", "--input-len", "16", "--output-len", "8"]
    argv += ["--no-plots", "--no-progress", "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    s = json.loads((tmp_path / "results.json").read_text())["levels"][0]["summary"]
    assert 1 <= s["requests"] < many  # the level ended at its duration, long before its count


def test_unreachable_server_exits_1(tmp_path: Path) -> None:
    argv = ["--target", f"127.0.0.1:{free_port()}", "--wait", "1", "--out", str(tmp_path)]
    assert bench_main(argv) == 1


def test_bad_flags_exit_2() -> None:
    with pytest.raises(SystemExit) as exc:
        bench_main(["--concurrency", "1,x"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        bench_main(["--concurrency", "2", "--request-rate", "1"])
    assert exc.value.code == 2


def test_healthcheck_cli(served: tuple[str, str]) -> None:
    target, _ = served
    assert healthcheck_main([target]) == 0
    assert healthcheck_main([target, "--service", "tandem.inference.v1.Inference"]) == 0
    assert healthcheck_main([f"127.0.0.1:{free_port()}", "--timeout", "1"]) == 1
    assert healthcheck_main([target, "--service", "no.such.Service"]) == 1


# ---------------------------------------------------------------------- metrics port, openai, datasets
@pytest.fixture(scope="module")
def http_base(served: tuple[str, str]) -> str:
    """The served process's OpenAI-compatible API (`--http-port 0`: the port GetModelInfo reports)."""
    with TandemClient(served[0]) as c:
        port = c.model_info().http_port
    assert port > 0
    return f"http://127.0.0.1:{port}"


QUICK = ["--concurrency", "2", "--num-requests", "6", "--warmup", "1", "--input-len", "24", "--output-len", "8"]
QUICK += ["--len-dist", "fixed", "--duration", "30", "--drain-timeout", "10", "--no-plots", "--no-progress"]


def _report(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def test_grpc_backend_finds_the_metrics_port_in_model_info(served: tuple[str, str], tmp_path: Path) -> None:
    """No --metrics-url: the port comes from GetModelInfo, and the cross-check runs."""
    target, metrics_url = served
    assert bench_main(["--target", target, *QUICK, "--out", str(tmp_path)]) == 0
    report = _report(tmp_path)
    assert report["meta"]["backend"] == "grpc" and report["meta"]["metrics_url"] == metrics_url
    (level,) = report["levels"]
    check = level["server_check"]
    assert check is not None and check["tokens_agree"], check
    assert check["server_generation_tokens"] == 6 * 8 and check["server_finished"] == 6


def test_openai_backend_reports_the_grpc_runs_columns(
    served: tuple[str, str], http_base: str, bench_bundle: Path, tmp_path: Path
) -> None:
    target, metrics_url = served
    grpc_out, http_out = tmp_path / "grpc", tmp_path / "http"
    assert bench_main(["--target", target, "--metrics-url", metrics_url, *QUICK, "--out", str(grpc_out)]) == 0
    argv = ["--backend", "openai", "--target", http_base + "/v1/", "--tokenizer", str(bench_bundle)]
    argv += ["--metrics-url", metrics_url, *QUICK, "--out", str(http_out)]
    assert bench_main(argv) == 0
    g, h = _report(grpc_out), _report(http_out)
    assert h["meta"]["backend"] == "openai" and h["meta"]["model"]["model_name"] == g["meta"]["model"]["model_name"]
    assert h["meta"]["model"]["max_context"] == g["meta"]["model"]["max_context"]  # the card's max_model_len
    assert set(h["meta"]) == set(g["meta"]) and set(h["meta"]["model"]) == set(g["meta"]["model"])
    (gl,), (hl,) = g["levels"], h["levels"]
    assert set(hl) == set(gl) and set(hl["summary"]) == set(gl["summary"])
    assert [set(r) for r in hl["requests"]] == [set(r) for r in gl["requests"]]
    s = hl["summary"]
    assert s["requests"] == s["completed"] == 6 and s["errors"] == {}
    assert s["total_output_tokens"] == 6 * 8 and s["total_input_tokens"] == 6 * 24  # ignore_eos: all requested
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert s[metric]["mean"] > 0 and s[metric]["p99"] >= s[metric]["median"] > 0
    assert s["ttft_ms"]["median"] < s["e2e_ms"]["median"]
    # One SSE event per token here (one token per engine step): 7 gaps per request, as over gRPC (6 should the
    # last token's text come with no text of its own: that event is the finish, not a token).
    assert all(6 <= len(r["itl_ms"]) <= 7 and r["output_tokens"] == 8 for r in hl["requests"])
    check = hl["server_check"]
    assert check is not None and check["tokens_agree"] and check["server_generation_tokens"] == 6 * 8, check
    assert check["server_finished"] == 6


def test_dataset_text_prompts_over_both_backends(
    served: tuple[str, str], http_base: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, _ = served
    data = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "def read(self, size=-1):\n", "max_tokens": 5}, {"text": "import os\n"}, {"prompt": "x = 1"}]
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    argv = ["--dataset", str(data), "--concurrency", "2", "--num-requests", "4", "--warmup", "0"]
    argv += ["--output-len", "6", "--len-dist", "fixed", "--no-plots", "--no-progress", "--duration", "30"]
    reports = {}
    for backend, where in (("grpc", target), ("openai", http_base)):
        out = tmp_path / backend
        capsys.readouterr()
        assert bench_main(["--backend", backend, "--target", where, *argv, "--out", str(out)]) == 0
        reports[backend] = _report(out)
        err = capsys.readouterr().err
        skipped = [line for line in err.splitlines() if "skipping" in line]
        assert len(skipped) == (1 if backend == "openai" else 0), err  # openai without --metrics-url: one line
    for backend, report in reports.items():
        assert report["meta"]["workload"]["dataset"] == str(data.resolve())
        (level,) = report["levels"]
        s = level["summary"]
        assert s["completed"] == 4 and s["total_output_tokens"] == 5 + 6 + 6 + 5, (backend, s)
        assert (level["server_check"] is None) == (backend == "openai")
        assert [r["max_new_tokens"] for r in level["requests"]] == [5, 6, 6, 5]
        assert all(r["prompt_tokens"] > 0 for r in level["requests"])  # the server's count of the text
    # The same text, tokenized by the same server over both protocols.
    counts = {b: [r["prompt_tokens"] for r in rep["levels"][0]["requests"]] for b, rep in reports.items()}
    assert counts["grpc"] == counts["openai"]


def test_openai_backend_sends_the_api_key_as_bearer(bench_bundle: Path, tmp_path: Path) -> None:
    from tests.inference_svc.server.conftest import make_server

    keys = tmp_path / "keys.txt"
    keys.write_text("# bench\nsecret-key-1\n")
    srv = make_server(bench_bundle, http_port=0, api_key_file=str(keys))
    try:
        base = f"http://127.0.0.1:{srv.server.http_port}"
        argv = ["--backend", "openai", "--target", base, "--tokenizer", str(bench_bundle), "--concurrency", "1"]
        argv += ["--num-requests", "2", "--warmup", "0", "--input-len", "8", "--output-len", "3", "--no-plots"]
        argv += ["--no-progress", "--wait", "10", "--len-dist", "fixed"]
        assert bench_main([*argv, "--out", str(tmp_path / "no-key")]) == 1  # 401 on /v1/models
        assert bench_main([*argv, "--api-key-file", str(keys), "--out", str(tmp_path / "key")]) == 0
        s = _report(tmp_path / "key")["levels"][0]["summary"]
        assert s["completed"] == 2 and s["total_output_tokens"] == 6
    finally:
        srv.close()


def test_openai_backend_unreachable_exits_1(tmp_path: Path) -> None:
    argv = ["--backend", "openai", "--target", f"http://127.0.0.1:{free_port()}", "--wait", "1"]
    assert bench_main([*argv, "--out", str(tmp_path)]) == 1
