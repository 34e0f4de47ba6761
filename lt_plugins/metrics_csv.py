"""A run's CSV metrics across attempts: one file per attempt, nothing an earlier attempt wrote is deleted.

Contract:
- `AttemptCSVLogger(run_dir)` is Lightning's `CSVLogger` writing into `<run_dir>/logs/`. The first attempt of a run
  writes `metrics.csv`; each later attempt (a resume after a crash or kill, a rerun) writes the first free
  `metrics.attempt-N.csv`, N = 2, 3, ... The file is claimed (created exclusively) when the attempt's logger starts
  on global rank 0, so an attempt killed before its first row still leaves its (empty) file and the numbers count
  attempts. Lightning's own CSVLogger deletes `metrics.csv` whenever the folder exists: every resume lost the
  history before it.
- Why one file per attempt and not one appended file with an `attempt` column: a resumed attempt logs again the
  steps between its checkpoint and the point the previous attempt was killed, and attempts may log different
  columns (a metric added, validation switched on); separate files keep each attempt's rows and header exactly as
  that attempt logged them, and an attempt never rewrites a row an earlier one wrote (Lightning rewrites a whole
  metrics file when a new column appears). TensorBoard does the same: one event file per attempt.
  `read_metrics(run_dir)` gives the rows of all attempts in order, each with its `attempt` number.
- Rows reach the file as they are logged (every `trainer.log_every_n_steps` steps, not every 100 as Lightning's
  default), so a killed attempt keeps every row it logged. A new column rewrites the attempt's file through a
  temporary file and a rename: a kill during the rewrite loses nothing.
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

LOGS_DIR = "logs"
FIRST_FILE = "metrics.csv"
_LATER = re.compile(r"metrics\.attempt-(\d+)\.csv")


def attempt_file(logs_dir: Path, attempt: int) -> Path:
    """`metrics.csv` for attempt 1, `metrics.attempt-N.csv` for attempt N > 1."""
    return logs_dir / (FIRST_FILE if attempt == 1 else f"metrics.attempt-{attempt}.csv")


def attempt_files(logs_dir: str | Path) -> list[tuple[int, Path]]:
    """(attempt number, file) of every attempt's metrics file in `logs_dir`, in attempt order."""
    logs_dir = Path(logs_dir)
    if not logs_dir.is_dir():
        return []
    found = [(1, logs_dir / FIRST_FILE)] if (logs_dir / FIRST_FILE).is_file() else []
    for path in logs_dir.iterdir():
        match = _LATER.fullmatch(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _claim_next(logs_dir: Path) -> Path:
    """Create (exclusively) the first free attempt file and return it."""
    logs_dir.mkdir(parents=True, exist_ok=True)
    attempt = 1
    while True:
        path = attempt_file(logs_dir, attempt)
        try:
            with open(path, "x"):
                return path
        except FileExistsError:
            attempt += 1


class _AttemptWriter(ExperimentWriter):
    """Lightning's CSV experiment writer, on a file of its own, deleting nothing, rewriting atomically."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)  # _check_log_dir_exists (below) no longer deletes metrics.csv
        self.metrics_file_path = str(_claim_next(Path(log_dir)))

    def _check_log_dir_exists(self) -> None:
        """Lightning deletes an existing metrics.csv here (with a warning); earlier attempts' files stay."""

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        """Also how the claimed (empty) file gets its header: the first save always brings new columns."""
        path = Path(self.metrics_file_path)
        with open(path, newline="") as file:
            rows = list(csv.DictReader(file))
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)


class AttemptCSVLogger(CSVLogger):
    """`CSVLogger(run_dir, name="logs", version="")` keeping every attempt's rows (see the module contract)."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__(run_dir, name=LOGS_DIR, version="", flush_logs_every_n_steps=1)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AttemptWriter(log_dir=self.log_dir)
        return self._experiment

    @property
    def metrics_file(self) -> Path | None:
        """This attempt's file (None before rank 0's logger started, and on other ranks)."""
        return Path(self._experiment.metrics_file_path) if self._experiment is not None else None


def _value(text: str) -> float | int | str | None:
    """A CSV cell as logged: "" → None (not logged in that row), else an int, a float, or the text itself."""
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every row of every attempt's metrics file under `<run_dir>/logs/`, attempt by attempt in logged order; each
    row is {column: number (or text) or None (not logged in that row)} plus `attempt` (1-based)."""
    out: list[dict[str, Any]] = []
    for attempt, path in attempt_files(Path(run_dir) / LOGS_DIR):
        with open(path, newline="") as file:
            for row in csv.DictReader(file):
                out.append({**{k: _value(v) for k, v in row.items()}, "attempt": attempt})
    return out
