"""The cells CI trains from the ZeRO compatibility matrix (benchmarks/zero_matrix.py), run once per test session in
one 2-process group: test_zero_matrix.py's slice and test_planner_choices.py's planner recommendations share it
(one process start-up and one pair of DDP references for both)."""

from __future__ import annotations

import functools
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

CI_CELLS = (
    "z3-ops-none-32-true-persistent",  # ZeRO-3 + ops + sanity check with every parameter whole (3eb6afb)
    "z3-ops-none-32-true",  # ZeRO-3 + ops: the in-place bias of DeepSpeed's linear added twice in the recompute
    "z1-attention-optimizer-32-true",  # attention mode; offload with the module's own torch optimizer
    "z3-attention-params-bf16-mixed",  # parameter offload alone
    "z3-none-optimizer-32-true-cpu_adam",  # offload with DeepSpeed's CPU Adam
    "z3-none-none-32-true-init_from",  # fine-tune from an fp32 model folder, each rank reading its partition
    "z3-none-none-bf16-mixed-init_from",  # the same in bf16: the reader took zero.Init's bf16 for the file's dtype
)
"""With the planner's choices (below, `planner_choices`), every stage, checkpointing mode, offload and precision,
and each combination that had a defect."""

REFUSED = {
    "z0-none-optimizer-32-true": r"offload_optimizer=true with strategy\.stage=0.*use strategy\.stage >= 1",
    "z2-ops-params-32-true": r"offload_params=true with strategy\.stage=2.*use strategy\.stage=3",
}
"""Cells refused at setup, and what their one-line error must say."""

PLAN_SCENARIOS = (
    # (preset, GPUs, GPU memory in bytes, micro-batch, sequence length): chosen so that the recommendations span
    # every stage, every offload and every checkpointing mode the planner weighs, in both precisions.
    ("tiny", 1, 4e9, 1, 512),
    ("small", 1, 4e9, 4, 2048),
    ("qwen3-0.6b", 1, 4e9, 1, 512),
    ("small", 8, 4e9, 4, 2048),
    ("qwen3-0.6b", 8, 4e9, 1, 512),
    ("qwen3-8b", 1, 8e9, 1, 512),
    ("qwen3-0.6b", 4, 8e9, 4, 2048),
    ("llama-3.2-1b", 8, 8e9, 1, 512),
    ("llama-3.2-1b", 2, 16e9, 4, 2048),
)


def matrix() -> Any:
    """benchmarks/zero_matrix.py as a module."""
    if "zero_matrix" not in sys.modules:
        spec = importlib.util.spec_from_file_location("zero_matrix", ROOT / "benchmarks" / "zero_matrix.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["zero_matrix"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["zero_matrix"]


def planner_choices() -> dict[str, tuple]:
    """Cell name → the first scenario whose recommendation (per precision) it is."""
    from lt_plugins.memory_model import PRECISIONS, Hardware
    from lt_plugins.planner import PlanRequest, plan
    from shared_model.config import get_preset

    zm = matrix()
    out: dict[str, tuple] = {}
    for preset, gpus, memory, micro, seq in PLAN_SCENARIOS:
        for precision in PRECISIONS:
            request = PlanRequest(gpus=gpus, micro_batch=micro, seq_len=seq, hardware=Hardware(gpu_memory=memory),
                                  precisions=(precision,))  # fmt: skip
            c = plan(get_preset(preset), request, model_name=preset, scaling_gpus=()).recommended
            if c is not None:
                cell = zm.Cell(c.stage, c.checkpointing, c.offload, c.precision)
                out.setdefault(cell.name, (preset, gpus, memory, micro, seq, precision))
    return out


@functools.cache
def ci_rows() -> dict[str, dict]:
    """name → judged row, for CI_CELLS, REFUSED and the planner's choices, trained in one process group."""
    zm = matrix()
    names = dict.fromkeys([*CI_CELLS, *REFUSED, *planner_choices()])
    cells = [zm.Cell.parse(n) for n in names]
    out = Path(tempfile.mkdtemp(prefix="zero-matrix-ci-"))
    return {r["name"]: r for r in zm.run(cells, out, batch=len(cells), timeout_s=900)}
