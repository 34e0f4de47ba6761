"""benchmarks/decode_runner_ab.py: the two sides take turns, the order reversed every round; bad flags refused."""

from __future__ import annotations

import pytest

from tests.conftest import load_benchmark


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


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture) -> None:
    ab = load_benchmark("decode_runner_ab")
    with pytest.raises(SystemExit):
        ab.main(["model", "--rounds", "0"])
    assert "--rounds, --requests and --streams must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["model", "--streams", "0"])
    assert "--streams must be at least 1" in capsys.readouterr().err
