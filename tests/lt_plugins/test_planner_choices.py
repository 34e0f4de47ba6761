"""Every configuration `tandem plan` can recommend is one the ZeRO compatibility matrix shows working.

- Live: the planner's recommendations for a spread of requests (tests/lt_plugins/matrix_ci.py, PLAN_SCENARIOS:
  presets from tiny to 8B, 1-8 GPUs, 4-16 GB, both precisions) are trained at tiny scale on 2 CPU processes (the
  matrix's module, in the CI matrix run's process group) and follow plain DDP within the matrix's tolerance.
- Recorded: every configuration the planner weighs (stage x offload x precision x checkpointing mode) has an `ok`
  row in the full matrix's results (benchmarks/zero_matrix.json, written by benchmarks/zero_matrix.py), so a new
  planner option without a matrix row fails here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from matrix_ci import ROOT, ci_rows, planner_choices

from lt_plugins.memory_model import CHECKPOINT_MODES, PRECISIONS
from lt_plugins.planner import OFFLOADS

CHOICES = planner_choices()


def test_the_scenarios_reach_every_stage_and_offload() -> None:
    import zero_matrix

    cells = [zero_matrix.Cell.parse(n) for n in CHOICES]
    assert {c.stage for c in cells} == {0, 1, 2, 3}
    assert {c.offload for c in cells} >= {"none", "optimizer", "opt+params"}
    assert {c.precision for c in cells} == set(PRECISIONS)
    assert len({c.ckpt for c in cells}) >= 3


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHOICES))
def test_recommendation_trains_like_ddp(name: str) -> None:
    row = ci_rows()[name]
    assert row["outcome"] == "ok", f"the planner recommends {name} for {CHOICES[name]}: {row.get('error') or row}"


def test_every_configuration_the_planner_weighs_works_in_the_recorded_matrix() -> None:
    results = json.loads((ROOT / "benchmarks" / "zero_matrix.json").read_text())["results"]
    ok = {(r["stage"], r["offload"], r["precision"], r["ckpt"]) for r in results
          if r["outcome"] == "ok" and r["optimizer"] == "adamw" and r["threshold"] == 0}  # fmt: skip
    weighed = [(stage, "opt+params" if params and opt else "params" if params else "optimizer" if opt else "none",
                precision, mode)
               for stage, offloads in OFFLOADS.items() for opt, params in offloads
               for precision in PRECISIONS for mode in CHECKPOINT_MODES]  # fmt: skip
    missing = [w for w in weighed if w not in ok]
    assert not missing, f"planner configurations without an ok row in benchmarks/zero_matrix.json: {missing}"
