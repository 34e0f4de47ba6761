"""Build locks of the ops DeepSpeed compiles at run time (`shm_comm` at its first CPU init, `cpu_adam`, ...).

Contract:
- `drop_stale_build_locks(max_age_s)` removes each op's `lock` file under torch's extension build root
  (`$TORCH_EXTENSIONS_DIR`, else torch's default, with its per-Python/device folder) that is older than `max_age_s`
  (default `STALE_LOCK_S`), logs each removal, and returns the removed paths. A missing root is no error.
- Why: torch's builder waits without a bound on that file. A process killed while DeepSpeed built an op left it
  behind, and every later `tandem train` on the machine hung in DeepSpeed's init: a test run killed
  during the `deepspeed_shm_comm` build made the next one's training time out after 300 s. A build takes a minute or
  two on 2 cores, so a lock older than `STALE_LOCK_S` has no live owner. `ZeroStrategy.setup_environment` calls it
  before DeepSpeed builds anything.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

STALE_LOCK_S = 600.0
"""A build lock older than this was left by a process that died while building."""
log = logging.getLogger(__name__)


def build_root() -> Path:
    """Where torch builds extensions (each op in a folder of its name, below a per-Python/device folder by default)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def drop_stale_build_locks(max_age_s: float = STALE_LOCK_S) -> list[Path]:
    """Remove the op build locks older than `max_age_s` seconds (see the module docstring); the removed paths."""
    root, removed, now = build_root(), [], time.time()
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        try:
            if now - lock.stat().st_mtime > max_age_s:
                lock.unlink()
                log.warning("removed a stale op build lock %s (left by a process killed while building)", lock)
                removed.append(lock)
        except FileNotFoundError:  # its builder finished meanwhile
            continue
    return removed
