"""One process of the multi-node rehearsal (started by torchrun, never by pytest): the compatibility matrix's
module (benchmarks/zero_matrix.py) trained under ZeRO-3 (every parameter sharded), its per-step global losses
written to `<out>/multinode-rank<r>.json`. The Trainer's devices and num_nodes come from torchrun's environment."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import zero_matrix  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    result = zero_matrix.fit(zero_matrix.Cell(3), "32-true")
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    (out / f"multinode-rank{os.environ['RANK']}.json").write_text(json.dumps({**result, "env": env}))


if __name__ == "__main__":
    main()
