"""tandem bench against a real `tandem serve` subprocess on free loopback ports: the sweep, the files it writes,
and the cross-check of the server's Prometheus figures (TTFT, tokens out) against the client's. Also the compose
healthcheck CLI (`python -m inference_svc.healthcheck`)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inference_svc.bench.cli import main as bench_main
from inference_svc.client import TandemClient
from inference_svc.healthcheck import main as healthcheck_main
from shared_model.bundle import save_bundle
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer
from tests.conftest import free_port, tiny_config


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, small_tokenizer: Tokenizer) -> Iterator[tuple[str, str]]:
    """(grpc target, metrics url) of a tiny bundle served by `tandem serve` in its own process."""
    model = build_model(tiny_config(), seed=0)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(3))
    bundle = save_bundle(tmp_path_factory.mktemp("bench-model") / "bundle", tiny_config(), model, small_tokenizer)
    port, metrics = free_port(), free_port()
    cmd = [sys.executable, "-m", "shared_model.cli", "serve", "--model", str(bundle), "--port", str(port)]
    cmd += [
        "--metrics-port",
        str(metrics),
        "--http-port",
        "0",
        "--device",
        "cpu",
        "--attention-backend",
        "torch",
        "--shutdown-grace",
        "5",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    target = f"127.0.0.1:{port}"
    try:
        with TandemClient(target) as c:
            c.wait_until_serving(120)
        yield target, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


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
    # TTFT: the server's Prometheus mean is the client's minus the trip from client to engine and back.
    solo = report["levels"][0]["server_check"]
    assert solo["ttft_agrees"], solo
    assert -1.0 <= solo["ttft_overhead_ms"] <= solo["ttft_tolerance_ms"]
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
    argv = ["--target", target, "--no-server-metrics", "--concurrency", "1", "--num-requests", "1000"]
    argv += ["--duration", "1.5", "--drain-timeout", "5", "--warmup", "0", "--input-len", "16", "--output-len", "8"]
    argv += ["--no-plots", "--no-progress", "--out", str(tmp_path)]
    assert bench_main(argv) == 0
    s = json.loads((tmp_path / "results.json").read_text())["levels"][0]["summary"]
    assert 1 <= s["requests"] < 1000 and s["duration_s"] < 1.5 + 5


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
