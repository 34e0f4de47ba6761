"""benchmarks/serving_peers.py, llama_cpp.py and vllm_cpu.py without building or installing a peer: the OpenAI-API
client against a real in-process Tandem HTTP server, the statistics and ratios, the pinned busy loop, the llama.cpp
build cache's choice with and without llama-server, and vLLM's venv cache and start environment."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from shared_model.bundle import save_bundle
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer
from tests.conftest import load_benchmark, tiny_config
from tests.inference_svc.server.conftest import engine_config, make_server


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory, small_tokenizer: Tokenizer):
    config = tiny_config()
    bundle = save_bundle(
        tmp_path_factory.mktemp("peers") / "bundle", config, build_model(config, seed=0), small_tokenizer
    )
    srv = make_server(bundle, http_port=0, served_model_name="peer", engine=engine_config(kv_cache_memory="4MiB"))
    yield srv
    srv.close()


def test_run_load_counts_every_streamed_token_of_a_real_server(http_server) -> None:
    sp = load_benchmark("serving_peers")
    base = f"http://127.0.0.1:{http_server.server.http_port}"
    plist = sp.prompts(5, 6, 512, seed=1)
    assert plist == sp.prompts(5, 6, 512, seed=1) and len({tuple(p) for p in plist}) == 5  # same for every server
    outcomes, wall = asyncio.run(sp.run_load(base, plist, 2, 7, 60.0))
    assert [o.error for o in outcomes] == [""] * 5
    assert all(o.ok and o.tokens == 7 and 0 < o.ttft <= o.e2e and o.tpot > 0 for o in outcomes)
    s = sp.summarize(outcomes, wall)
    assert (s["requests"], s["ok"], s["errors"], s["output_tokens"]) == (5, 5, 0, 35)
    assert s["tok_s"] == pytest.approx(35 / wall)
    assert s["ttft_p50_ms"] <= s["ttft_p90_ms"]


def test_interleaved_cell_gives_every_server_the_same_rounds_in_turn(http_server, monkeypatch) -> None:
    import argparse
    import types

    sp = load_benchmark("serving_peers")
    monkeypatch.setattr(sp, "SETTLE_S", 0.0)
    base = f"http://127.0.0.1:{http_server.server.http_port}"
    sent: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
    run_load = sp.run_load

    async def recording(url, plist, conc, n_tokens, timeout):  # the real load, with who got which prompts
        sent.append((url, tuple(map(tuple, plist))))
        return await run_load(url, plist, conc, n_tokens, timeout)

    monkeypatch.setattr(sp, "run_load", recording)
    # two "peers" on one real server, told apart by the URL each is reached at
    servers = {"tandem": types.SimpleNamespace(base_url=base), "vllm": types.SimpleNamespace(base_url=base + "/")}
    args = argparse.Namespace(request_timeout=60.0, prompt_tokens=5, seed=3, warmup_tokens=2, tokens=6, rounds=3,
                              min_requests=4)  # fmt: skip
    out = sp.measure_cell(servers, 2, 0, args, 512)
    measured = sent[2:]  # after one warm-up burst each
    assert [u for u, _ in measured] == [base, base + "/", base + "/", base, base, base + "/"]  # turns, reversed
    assert [p for _, p in measured[0::2]] == [p for _, p in measured[1::2]]  # each round: the same prompts for both
    assert len({p for _, p in measured[0::2]}) == 3  # fresh prompts every round
    for res in out.values():
        assert (res["requests"], res["ok"], res["output_tokens"]) == (6, 6, 36)
        assert len(res["round_tok_s"]) == len(res["round_ttft_p50_ms"]) == 3 and all(res["round_tok_s"])
    cells = [{"peer": p, "precision": "bf16", "concurrency": 2, "result": r} for p, r in out.items()]
    results = {"workload": {"interleave": True}, "busy": [], "cells": cells}
    sp.add_ratios(results)
    ratio = results["cells"][1]["ratio"]
    t, v = out["tandem"], out["vllm"]
    assert ratio["tok_s_rounds"] == [a / b for a, b in zip(t["round_tok_s"], v["round_tok_s"], strict=True)]
    assert ratio["tok_s_round_median"] == sorted(ratio["tok_s_rounds"])[1]


def test_a_refused_request_is_an_error_of_the_cell_not_a_crash(http_server) -> None:
    sp = load_benchmark("serving_peers")
    base = f"http://127.0.0.1:{http_server.server.http_port}"
    # the test server's ceiling is 64 new tokens: asking 100 is refused with a 400, the other request is served
    outcomes, wall = asyncio.run(sp.run_load(base, sp.prompts(2, 4, 512, seed=2), 2, 100, 60.0))
    assert all(not o.ok and o.error.startswith("INVALID_ARGUMENT: ") and "max_tokens" in o.error for o in outcomes)
    s = sp.summarize(outcomes, wall)
    assert (s["ok"], s["errors"], s["tok_s"]) == (0, 2, 0.0) and s["first_error"] == outcomes[0].error


def test_a_response_short_of_its_tokens_is_an_error() -> None:
    from inference_svc.bench.loadgen import RequestRecord
    from inference_svc.bench.workload import RequestSpec

    sp = load_benchmark("serving_peers")
    rec = RequestRecord.starting(RequestSpec(0, (5, 6), 4))
    rec.first_token, rec.token_times, rec.end = rec.start + 1.0, [rec.start + t for t in (1.0, 1.5, 2.0)], rec.start + 2
    rec.output_tokens = 3  # a server that stopped at EOS although ignore_eos was asked
    short = sp.outcome(rec, 4)
    assert not short.ok and short.error == "3 tokens (3 token events), not 4"
    rec.output_tokens, rec.token_times = 4, [*rec.token_times, rec.start + 2.0]
    full = sp.outcome(rec, 4)
    # TPOT is (e2e - ttft) / (tokens - 1), whatever the spacing of the events (they may come in bursts)
    assert full.ok and (full.ttft, full.tpot, full.e2e) == pytest.approx((1.0, 1.0 / 3, 2.0))


def test_percentiles_and_ratio_of_ratios() -> None:
    sp = load_benchmark("serving_peers")
    assert sp.pct([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert sp.pct([1.0, 2.0, float("nan")], 0.9) == pytest.approx(1.9)
    assert sp.pct([], 0.5) is None

    def cell(peer: str, tok_s: float, ttft: float) -> dict:
        return {"peer": peer, "precision": "bf16", "concurrency": 16, "result": {"tok_s": tok_s, "ttft_p50_ms": ttft}}

    results = {
        "cells": [cell("tandem", 300.0, 100.0), cell("vllm", 600.0, 50.0), cell("llama-server", 150.0, 400.0)],
        "busy": [
            {"peer": "tandem", "precision": "bf16", "slowdown": 3.0},
            {"peer": "llama-server", "precision": "bf16", "slowdown": 1.5},
        ],
    }
    sp.add_ratios(results)
    vllm, llama = results["cells"][1]["ratio"], results["cells"][2]["ratio"]
    assert (vllm["tok_s"], vllm["ttft_p50"], llama["tok_s"], llama["ttft_p50"]) == (0.5, 2.0, 2.0, 0.25)
    assert "ratio" not in results["cells"][0]
    assert results["busy"][1]["ratio_of_ratios"] == 2.0  # Tandem slows down twice as much as llama-server


def test_busy_loop_runs_pinned_to_its_core_and_ends() -> None:
    sp = load_benchmark("serving_peers")
    core = sorted(os.sched_getaffinity(0))[-1]
    loop = sp.BusyLoop(core)
    try:
        assert os.sched_getaffinity(loop.proc.pid) == {core}
        assert loop.proc.poll() is None
    finally:
        loop.stop()
    assert loop.proc.returncode is not None


def test_parse_args_picks_the_last_core_and_refuses_bad_choices(capsys) -> None:
    sp = load_benchmark("serving_peers")
    args = sp.parse_args(["--busy-core", "--concurrency", "16,1,16", "--tokens", "40", "--prompt-tokens", "8"])
    assert args.busy_core == sorted(os.sched_getaffinity(0))[-1]
    assert args.concurrencies == [1, 16] and args.llama_ctx_per_slot == 256
    assert sp.parse_args([]).busy_core is None
    for bad in (["--peers", "tgi"], ["--precisions", "fp8"], ["--busy-core", "4096"], ["--concurrency", "0"]):
        with pytest.raises(SystemExit):
            sp.parse_args(bad)
    assert "--busy-core 4096 is not one of the usable cores" in capsys.readouterr().err


def test_fp32_is_asked_for_by_name_and_runs_dense_against_the_f32_gguf() -> None:
    """fp32 is no default precision; asked for, Tandem serves float32 unquantized and llama-server reads the F32
    GGUF (the bf16 cells keep --llama-dense-type)."""
    sp = load_benchmark("serving_peers")
    assert sp.parse_args([]).precision_list == ["bf16", "int8", "int4"]
    args = sp.parse_args(["--precisions", "fp32,int4"])
    assert args.precision_list == ["fp32", "int4"]
    assert sp.label("llama-server", "fp32", args) == "llama-server F32"
    assert sp.label("llama-server", "bf16", args) == "llama-server BF16"
    assert sp.tandem_precision("fp32", "bfloat16") == ("float32", "none")
    assert sp.tandem_precision("bf16", "float32") == ("bfloat16", "none")
    assert sp.tandem_precision("int4", "bfloat16") == ("bfloat16", "int4")


def _fake_build(vdir: Path, name: str, flags: list[str], targets: list[str]) -> None:
    src = vdir / "src" / "vendor" / "llama.cpp"
    src.mkdir(parents=True, exist_ok=True)
    (src / "CMakeLists.txt").write_text("")
    bins = vdir / name / "bin"
    bins.mkdir(parents=True)
    for t in targets:
        (bins / t).write_text("")
    info = {"cmake_flags": flags, "targets": targets, "build_s": 12.0}
    (vdir / name / "tandem_build.json").write_text(json.dumps(info))


def test_llama_tools_reuse_a_build_with_or_without_the_server(tmp_path: Path, monkeypatch) -> None:
    lc = load_benchmark("llama_cpp")
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    vdir = lc.cache_root() / "9.9.9"
    assert "-DLLAMA_BUILD_SERVER=ON" in lc.cmake_flags(False, server=True)
    assert "-DLLAMA_BUILD_SERVER=OFF" in lc.cmake_flags(False)
    # a build made before llama-server was offered serves the tools as it is
    _fake_build(vdir, "build", lc.cmake_flags(False), lc.TARGETS)
    tools = lc.ensure_tools("9.9.9")
    assert tools.cached and tools.server is None and tools.bench == vdir / "build" / "bin" / "llama-bench"
    # a server build holds all three, for the tools and for the server
    (vdir / "build" / "tandem_build.json").unlink()
    _fake_build(vdir, "build-amx", lc.cmake_flags(True, server=True), [*lc.TARGETS, lc.SERVER_TARGET])
    tools = lc.ensure_tools("9.9.9", amx=True, server=True)
    assert tools.cached and tools.server == vdir / "build-amx" / "bin" / "llama-server"
    assert lc.ensure_tools("9.9.9", amx=True).cached


def test_vllm_venv_is_reused_only_when_complete_and_started_with_its_preloads(tmp_path: Path, monkeypatch) -> None:
    vc = load_benchmark("vllm_cpu")
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    venv = vc.venv_dir("9.9.9")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_text("")
    info = {"torch": vc.TORCH, "vllm": "9.9.9", "install_s": 400.0}
    (venv / "tandem_install.json").write_text(json.dumps(info))
    found = vc.ensure_venv("9.9.9")
    assert found.cached and found.python == venv / "bin" / "python" and found.info["install_s"] == 400.0

    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    monkeypatch.setattr(vc, "TCMALLOC_CANDIDATES", (str(tcmalloc),))
    with pytest.raises(vc.PeerError, match="apt-get install -y libtcmalloc-minimal4"):
        vc.server_env(venv)
    tcmalloc.write_text("")
    monkeypatch.setenv("LD_PRELOAD", "/x/mine.so")
    env = vc.server_env(venv, kv_cache_gib=2, threads=2)
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{venv / 'lib' / 'libiomp5.so'}:/x/mine.so"
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("2", "0-1")
    assert "PYTHONPATH" not in env
    cmd = vc.server_command(venv, tmp_path / "model", 1234)
    assert cmd[:3] == [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
