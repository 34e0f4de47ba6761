"""benchmarks/paired_decode.py without llama.cpp: the pairs' order and ratios around a real tiny engine (the peer a
function that records when it ran), the summary's median and quartiles, the precision pairing and the flags'
validation."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from inference_svc.engine import Engine, EngineConfig
from shared_model.bundle import save_bundle
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer
from tests.conftest import load_benchmark, tiny_config


@pytest.fixture
def engine(tmp_path: Path, small_tokenizer: Tokenizer) -> Engine:
    """A real tiny engine, eager, one thread: the Tandem side of the pairs."""
    config = tiny_config()
    bundle = save_bundle(tmp_path / "bundle", config, build_model(config, seed=0), tokenizer=small_tokenizer)
    return Engine.from_bundle(bundle, EngineConfig(compile="off", device="cpu", threads=1))


def test_pairs_alternate_and_each_ratio_is_its_own_pair(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    paired = load_benchmark("paired_decode")
    order: list[str] = []
    rates = iter([100.0, 50.0, 200.0, 25.0])

    def peer() -> float:
        assert not engine.has_unfinished_requests()  # never while a request of the engine is open
        order.append("llama")
        return next(rates)

    real_rate = paired.engine_decode.decode_rate

    def decode_rate(*args, **kwargs) -> float:
        order.append("tandem")
        return real_rate(*args, **kwargs)

    monkeypatch.setattr(paired.engine_decode, "decode_rate", decode_rate)  # the real one, its calls recorded
    pairs = paired.run_pairs(paired.tandem_side(engine, "decode", 4, 0), peer, pairs=4, reps=2)
    first, second = ["llama", "tandem", "tandem"], ["tandem", "tandem", "llama"]  # llama-bench first in even pairs
    assert order == first + second + first + second
    assert [p["tandem_first"] for p in pairs] == [False, True, False, True]
    assert [p["llama"] for p in pairs] == [100.0, 50.0, 200.0, 25.0]
    for p in pairs:
        assert p["tandem"] > 0 and p["ratio"] == pytest.approx(p["tandem"] / p["llama"])
    assert not engine.has_unfinished_requests()


def test_prefill_pairs_time_a_new_prompt_each_time(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    paired = load_benchmark("paired_decode")
    prompts: list[list[int]] = []
    real_add = engine.add_request

    def add_request(rid, prompt, sampling, *args, **kwargs):
        prompts.append(list(prompt))
        assert sampling.max_new_tokens == 1  # the prefill alone: its first token ends the request
        return real_add(rid, prompt, sampling, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_request)  # the real one, its prompts recorded
    pairs = paired.run_pairs(paired.tandem_side(engine, "prefill", 0, 24), lambda: 100.0, pairs=2, reps=2)
    assert len(prompts) == 4 and all(len(p) == 24 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 4  # no prompt twice: the prefix cache serves none of them
    assert all(p["tandem"] > 0 and p["ratio"] == pytest.approx(p["tandem"] / 100.0) for p in pairs)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="unknown phase 'both'"):
        paired.tandem_side(engine, "both", 4, 24)


def test_summary_median_quartiles_and_share_at_parity() -> None:
    paired = load_benchmark("paired_decode")
    ratios = [0.9, 1.1, 0.95, 1.05, 1.2, 0.8, 1.0, 0.97]
    s = paired.summary(ratios)
    assert s["median"] == pytest.approx(statistics.median(ratios))
    assert s["q1"] < s["median"] < s["q3"] and s["min"] == 0.8 and s["max"] == 1.2
    assert s["at_least_1"] == pytest.approx(4 / 8)
    one = paired.summary([0.93])
    assert one["median"] == one["q1"] == one["q3"] == 0.93 and one["at_least_1"] == 0.0
    with pytest.raises(ValueError, match="no pairs"):
        paired.summary([])
    pairs = [{"llama": 100.0, "tandem": 100.0 * r, "ratio": r} for r in ratios]
    results = {"date": "2026-12-06T17:38:04+00:00", "machine": paired.cpu_peer.cpu_summary(), "commit": "abc1234",
               "threads": 2, "thread_governor": "off", "decode_runner": "auto", "n_gen": 64, "phase": "decode",
               "measure": "tg64",
               "command": "python benchmarks/paired_decode.py",
               "cases": [{"precision": "fp32", "gguf": "model-F32.gguf", "pairs": pairs, **s}]}  # fmt: skip
    table = paired.markdown(results)
    assert "thread governor off, decode runner auto" in table and "Paired batch-1 decode" in table
    tandem = statistics.median(p["tandem"] for p in pairs)
    row = f"| fp32 / F32 | 8 | 100.0 | {tandem:.1f} | **{s['median']:.2f}** | {s['q1']:.2f}-{s['q3']:.2f} | 50% |"
    assert row in table


def test_precisions_pair_with_cpu_peers_ggufs_and_bad_flags_are_refused(capsys: pytest.CaptureFixture) -> None:
    paired = load_benchmark("paired_decode")
    assert paired.engine_flags("fp32") == ("float32", "none")
    assert paired.engine_flags("bf16") == ("bfloat16", "none")
    assert paired.engine_flags("int4") == ("bfloat16", "int4")
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        paired.engine_flags("fp8")
    with pytest.raises(SystemExit):
        paired.parse_args(["--precisions", "fp32,fp8"])
    assert "unknown precision 'fp8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        paired.parse_args(["--pairs", "0"])
    assert "--pairs" in capsys.readouterr().err
    assert paired.parse_args(["--precisions", "int8, int4"]).precision_list == ["int8", "int4"]
