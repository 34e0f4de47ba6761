"""benchmarks/decode_runner_ab.py: the two sides take turns, the order reversed every round; a burst of streams is
decoded together on a real tiny engine; bad flags refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_svc.engine import Engine, EngineConfig
from shared_model.bundle import save_bundle
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer
from tests.conftest import load_benchmark, tiny_config


def test_rounds_alternate_the_order_and_measure_each_side_once() -> None:
    ab = load_benchmark("decode_runner_ab")
    calls: list[str] = []

    def side(mode: str):
        def rate(tag: str) -> float:
            calls.append(tag)
            return 100.0 if mode == "auto" else 80.0

        return rate

    rounds = ab.interleave({"auto": side("auto"), "off": side("off")}, 3)
    assert calls == ["auto-0", "off-0", "off-1", "auto-1", "auto-2", "off-2"]
    assert rounds == [{"auto": 100.0, "off": 80.0}] * 3


def test_a_burst_decodes_its_streams_together_and_leaves_the_engine_empty(
    tmp_path: Path, small_tokenizer: Tokenizer
) -> None:
    ab = load_benchmark("decode_runner_ab")
    config = tiny_config()
    bundle = save_bundle(tmp_path / "bundle", config, build_model(config, seed=0), tokenizer=small_tokenizer)
    engine = Engine.from_bundle(bundle, EngineConfig(compile="off", device="cpu", threads=1))
    steps = 0
    step = engine.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted  # the real step, counted
    rate = ab.burst_rate(engine, 4, 6, "burst")
    assert rate > 0 and steps == 6  # one step for the four first tokens, then one a token for all four together
    assert not engine.has_unfinished_requests()


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture) -> None:
    ab = load_benchmark("decode_runner_ab")
    with pytest.raises(SystemExit):
        ab.main(["model", "--rounds", "0"])
    assert "--rounds, --requests and --streams must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["model", "--streams", "0"])
    assert "--streams must be at least 1" in capsys.readouterr().err
