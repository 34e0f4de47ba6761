"""A dependency-free progress bar for the benchmark (stderr).

Contract: `Progress(total, label)` draws `label [#####.....] done/total ok/err  X.X req/s  T s` and redraws in place
on a terminal (carriage return, at most 10 times a second); elsewhere (docker logs, CI) it prints one line per
10 % of progress instead, so logs stay short. `update(ok)` counts one finished request; `close()` prints the final
line. `enabled=False` makes every call a no-op.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = self.errors = 0
        self.t0 = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1

    def _line(self) -> str:
        width = 30
        filled = min(width, int(width * self.done / self.total))
        elapsed = time.perf_counter() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return (
            f"{self.label:<14} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"ok {self.done - self.errors} err {self.errors}  {rate:5.2f} req/s  {elapsed:5.1f} s"
        )

    def update(self, ok: bool = True) -> None:
        if not self.enabled:
            return
        self.done += 1
        self.errors += 0 if ok else 1
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw >= 0.1:
                self.stream.write("\r" + self._line())
                self.stream.flush()
                self._last_draw = now
        else:
            decile = 10 * self.done // self.total
            if decile != self._last_decile and decile < 10:
                self._last_decile = decile
                self.stream.write(self._line() + "\n")
                self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self.stream.write(("\r" if self.tty else "") + self._line() + "\n")
        self.stream.flush()
