"""`tandem bench --compare`: one tiny bundle served under several configurations by the command itself (each a
`tandem serve` subprocess), the JSON holding every requested configuration with every column and sane values, a
configuration that cannot start as a row with its error, and bad configurations refused in one line (exit 2)
before any server starts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from inference_svc.bench.cli import main as bench_main
from inference_svc.bench.compare import columns, parse_configs
from shared_model.bundle import save_bundle
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer
from tests.conftest import tiny_config

pytestmark = pytest.mark.slow  # one served subprocess per configuration (not in make test-fast)

TINY_RUN = ["--num-requests", "16", "--input-len", "16", "--output-len", "8", "--eval-tokens", "256"]
TINY_RUN += ["--eval-window", "128", "--warmup", "1", "--corpus-docs", "4"]
SERVE = ["--", "--device", "cpu", "--attention-backend", "torch", "--kv-cache-memory", "4MiB", "--threads", "1"]


@pytest.fixture(scope="module")
def compare_bundle(tmp_path_factory: pytest.TempPathFactory, small_tokenizer: Tokenizer) -> Path:
    model = build_model(tiny_config(), seed=0)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(3))
    return save_bundle(tmp_path_factory.mktemp("compare-model") / "bundle", tiny_config(), model, small_tokenizer)


def test_compare_json_has_every_configuration_with_every_column(
    compare_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    argv = ["--compare", "--model", str(compare_bundle), "--configs", "fp32,int8,no-chunked", "--streams", "1,16"]
    rc = bench_main([*argv, *TINY_RUN, "--out", str(out), *SERVE])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads((out / "compare.json").read_text())
    assert (out / "compare.png").stat().st_size > 0
    cols = report["meta"]["columns"]
    assert cols == columns([1, 16])
    assert report["meta"]["configs"] == ["fp32", "int8", "no-chunked"]
    entries = {e["name"]: e for e in report["configs"]}
    assert list(entries) == ["fp32", "int8", "no-chunked"]
    for name, e in entries.items():
        assert e["error"] is None, (name, e["error"])
        missing = [c for c in cols if e.get(c) is None]
        assert not missing, (name, missing)
        assert math.isfinite(e["perplexity"]) and e["perplexity"] > 1
        assert e["bits_per_byte"] > 0
        for s in (1, 16):
            assert e[f"throughput_tok_s@{s}"] > 0
            assert e[f"ttft_p50_ms@{s}"] > 0 and e[f"tpot_p50_ms@{s}"] > 0
        assert e["ledger_peak_bytes"] == e["weight_bytes"] + e["kv_cache_bytes"] + e["workspace_bytes"]
        assert e["kv_cache_bytes"] == 4 * 2**20 and e["workspace_bytes"] > 0
        assert e["measured_peak_bytes"] == e["peak_rss_bytes"] > e["weight_bytes"]
        assert e["server_exit_code"] == 0
        assert (out / e["log"]).is_file()
        assert name in printed
    assert entries["int8"]["quantization"] == "int8" and entries["fp32"]["quantization"] == "none"
    assert entries["int8"]["weight_bytes"] < entries["fp32"]["weight_bytes"]
    assert entries["no-chunked"]["settings"]["enable_chunked_prefill"] is False
    # chunking does not change the arithmetic of a 128-token window: the same perplexity to the last bit
    assert entries["no-chunked"]["perplexity"] == entries["fp32"]["perplexity"]
    assert abs(entries["int8"]["perplexity"] / entries["fp32"]["perplexity"] - 1) < 0.05


def test_a_configuration_that_cannot_start_is_a_row_with_its_error(
    compare_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    configs = "no-kv=--kv-cache-memory 1KiB,fp32"
    argv = ["--compare", "--model", str(compare_bundle), "--configs", configs, "--streams", "1", "--no-plots"]
    rc = bench_main([*argv, *TINY_RUN, "--num-requests", "2", "--out", str(out), *SERVE])
    printed = capsys.readouterr().out
    assert rc == 1
    report = json.loads((out / "compare.json").read_text())
    broken, ok = report["configs"]
    assert broken["name"] == "no-kv" and "kv_cache_memory" in broken["error"] and "before SERVING" in broken["error"]
    assert all(c in broken and broken[c] is None for c in report["meta"]["columns"])
    assert ok["name"] == "fp32" and ok["error"] is None and ok["throughput_tok_s@1"] > 0
    assert "no-kv: FAILED" in printed


@pytest.mark.parametrize(
    ("configs", "says"),
    [
        ("fp32,fp64", "unknown configuration 'fp64'"),
        ("bf16+int3", "unknown configuration 'int3'"),
        ("fp32,fp32", "named twice"),
        ("x=--no-such-flag", "unrecognized arguments: --no-such-flag"),
        ("x=--quantization int3", "invalid choice: 'int3'"),
        ("x=--port 5", "--port is set by the comparison"),
        ("x=--api-key-file k", "--api-key-file is not supported"),
    ],
)
def test_a_bad_configuration_is_one_line_and_exit_2(
    configs: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = bench_main(["--compare", "--model", str(tmp_path), "--configs", configs, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert not (tmp_path / "o").exists()


def test_presets_combine_and_explicit_flags_pass_through() -> None:
    a, b, c = parse_configs("bf16+int8, big-kv=--kv-cache-memory 1GiB --no-prefix-caching,default")
    assert (a.name, a.flags) == ("bf16+int8", ["--dtype", "bfloat16", "--quantization", "int8"])
    assert a.settings == {"dtype": "bfloat16", "quantization": "int8"}
    assert b.name == "big-kv" and b.settings == {"kv_cache_memory": "1GiB", "enable_prefix_caching": False}
    assert (c.flags, c.settings) == ([], {})
    assert parse_configs("default", common=["--device", "cpu"])[0].settings == {"device": "cpu"}
