"""`benchmarks/train_compare.py`: every requested training configuration is a row with every column, measured from
a real `tandem train` run (CSV log and memory ledger), and a failing configuration is a row with its error."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL = (
    "trainer.precision=32-true data.max_documents=40 data.block_size=32 data.batch_size=2 trainer.limit_val_batches=1"
)


def _module():
    spec = importlib.util.spec_from_file_location("train_compare", REPO / "benchmarks" / "train_compare.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_rows_for_every_configuration_with_every_column(tmp_path: Path) -> None:
    mod = _module()
    out = tmp_path / "compare.json"
    configs = [f"z0:{SMALL} strategy.stage=0", f"z2-full:{SMALL} strategy.stage=2 checkpointing.mode=full",
               f"broken:{SMALL} optim.lr=-1"]  # fmt: skip
    argv = ["--configs", *configs, "--steps", "3", "--devices", "1", "--work-dir", str(tmp_path / "runs")]
    assert mod.main([*argv, "--out", str(out)]) == 1  # one configuration failed
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"z0", "z2-full", "broken"}
    for name in ("z0", "z2-full"):
        r = results[name]
        assert r["error"] is None and set(mod.COLUMNS) <= set(r)
        assert math.isfinite(r["val_loss"]) and r["step_time_ms"] > 0 and r["tokens_per_s"] > 0
        assert len(r["peak_measured_mb_per_rank"]) == 1 and r["peak_measured_mb_per_rank"][0] > 0
    assert results["broken"]["error"] and results["broken"]["val_loss"] is None


def test_a_configuration_needs_a_name_and_key_value_overrides() -> None:
    mod = _module()
    with pytest.raises(SystemExit, match="NAME:key=value"):
        mod.parse_config("no-colon")
    with pytest.raises(SystemExit, match="key=value"):
        mod.parse_config("x:strategy.stage")
