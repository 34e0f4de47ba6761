"""The lt_plugins exception hierarchy.

Every error raised on purpose by the training plugins derives from `TrainingError`, so the CLI catches one type and
prints its message. Messages name the offending config key, Trainer argument, file or tensor.
"""

from __future__ import annotations


def one_line(exc: BaseException) -> str:
    """An error message on one line (multi-line messages from libraries are joined)."""
    return " ".join(str(exc).split()) or type(exc).__name__


class TrainingError(Exception):
    """Base class of every deliberate lt_plugins error."""


class TrainingConfigError(TrainingError, ValueError):
    """A training config value is unknown, mistyped, or conflicts with another setting; the message names both."""


class StrategyError(TrainingError, RuntimeError):
    """The ZeRO strategy cannot run with this accelerator, precision or Trainer setting."""


class PrecisionError(StrategyError):
    """The requested precision is not available on this accelerator (e.g. `16-mixed` on CPU)."""


class CheckpointError(TrainingError):
    """A checkpoint is missing, partial or corrupt, or cannot be consolidated into a bundle."""
