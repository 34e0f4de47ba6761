"""The CI slice of the ZeRO compatibility matrix (benchmarks/zero_matrix.py; the full table is in docs/training.md):
every stage, every checkpointing mode, both precisions, every offload, and each combination that had a defect, on a
module built from torch.nn.TransformerEncoderLayer with Lightning's validation sanity check on, all in one 2-process
group. Each cell trains with losses that follow plain DDP within the stated tolerance, or is refused at setup with a
one-line error naming the combination and what to use instead; none crashes.

Defects these cells caught:
- ZeRO-3 + `ops` checkpointing + the sanity check, small parameters kept whole (fixed in 3eb6afb: DeepSpeed's hook
  ops kept out of selective checkpoint caching);
- ZeRO-3 + `ops` on modules with a bias: DeepSpeed's ZeRO-3 linear adds the bias in place on the matmul output that
  selective checkpointing saved, so the recompute added it twice (wrong gradients, no error; fixed in
  lt_plugins/checkpointing.py, `_ZeroAwareCaching`);
- optimizer offload with the LightningModule's own optimizer: DeepSpeed raised "ZeRO-Offload with a client provided
  optimizer" (ZeroStrategy now sets `zero_force_ds_cpu_optimizer: false`); DeepSpeed's CPU Adam runs too;
- ZeRO-3 + bf16-mixed + `init_from` an fp32 folder (issue 34): inside zero.Init a bf16 config turns
  `torch.empty(dtype=float32)` into bfloat16 and the partition reader took that for the file's element size
  (scrambled weights, stopped by "holds NaN or Inf"); fixed in shared_model/bundle/read.py, `FolderTensors.copy_range`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from matrix_ci import CI_CELLS, REFUSED, ci_rows, matrix, planner_choices

SLICE = tuple(dict.fromkeys([*CI_CELLS, *planner_choices()]))

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    return ci_rows()


def test_the_slice_covers_every_stage_mode_offload_and_precision() -> None:
    zm = matrix()
    cells = [zm.Cell.parse(n) for n in SLICE]
    assert {c.stage for c in cells} == set(zm.STAGES)
    assert {c.ckpt for c in cells} == set(zm.CKPT_MODES)
    assert {c.offload for c in cells} == set(zm.OFFLOADS)
    assert {c.precision for c in cells} == set(zm.PRECISIONS)
    assert {c.model for c in cells} == set(zm.MODELS)
    assert all(zm.Cell.parse(c.name) == c for c in zm.full_matrix())  # names round-trip


@pytest.mark.parametrize("name", CI_CELLS)  # the planner's choices are test_planner_choices.py's
def test_cell_trains_like_ddp(rows: dict[str, dict], name: str) -> None:
    row = rows[name]
    assert row["outcome"] == "ok", f"{name}: {row.get('error') or row}"
    assert row["losses"][-1] < row["losses"][0]  # it learns


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_cell_is_refused_in_one_line_naming_what_to_use(rows: dict[str, dict], name: str) -> None:
    row = rows[name]
    assert row["outcome"] == "refused", row
    assert "\n" not in row["error"] and re.search(REFUSED[name], row["error"]), row["error"]


def test_bf16_fine_tune_starts_where_the_fp32_load_does(rows: dict[str, dict]) -> None:
    """ZeRO-3 + bf16-mixed loading an fp32 folder: the first loss (before any update: what was loaded) equals the
    fp32-loaded ZeRO-3 run's within the bf16 tolerance, and both equal their DDP references."""
    zm = matrix()
    bf16, fp32 = rows["z3-none-none-bf16-mixed-init_from"], rows["z3-none-none-32-true-init_from"]
    assert bf16["outcome"] == fp32["outcome"] == "ok", (bf16.get("error"), fp32.get("error"))
    rtol, atol = zm.TOLERANCE["bf16-mixed"]
    assert abs(bf16["losses"][0] - fp32["losses"][0]) <= atol + rtol * abs(fp32["losses"][0])


def test_a_wrong_gradient_is_caught(tmp_path: Path) -> None:
    """The judge is not blind: a loss curve off by more than the tolerance is a `mismatch`."""
    zm = matrix()
    reference = {"32-true": {"losses": [4.0, 3.9, 3.8], "step_ms": 1.0}}
    row = {"outcome": "trained", "losses": [4.0, 3.9, 3.805], "step_ms": 1.0}
    assert zm.judge(zm.Cell(3), row, reference)["outcome"] == "mismatch"
    assert zm.judge(zm.Cell(3), {**row, "losses": [4.0, 3.9, 3.8001]}, reference)["outcome"] == "ok"
