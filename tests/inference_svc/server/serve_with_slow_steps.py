"""`tandem serve` in a subprocess with the engine's test-only fault hook installed: every increment of a request
whose id starts with 'slow-' costs at least `SLOW_STEP_S`, so such a request outlives any grace period by
construction (2,000 tokens take at least 40 s however fast the machine is). Everything else is the real CLI.

Usage: python -m tests.inference_svc.server.serve_with_slow_steps [tandem serve flags...]
"""

from __future__ import annotations

import sys
import time

from inference_svc.cli import serve_main
from inference_svc.engine.types import RequestOutput

SLOW_STEP_S = 0.02


def slow_steps(out: RequestOutput) -> None:
    if out.request_id.startswith("slow-"):
        time.sleep(SLOW_STEP_S)


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:], fault_hook=slow_steps))
