"""The load plan: every serving lever's choice, with its reason, in the order the executor made them.

Contract:
- A `Choice` is one lever (`lever`, a stable snake_case name such as `compile` or `linear.qkv_proj`), what was
  chosen (`value`, short and machine-readable, e.g. 'on', 'int4_gemv'), and why (`reason`, one sentence a user can
  act on: the flag that set it, or the rule and the facts it read). Frozen.
- A `LoadPlan` is the ordered tuple of an engine's choices, fixed when the engine is built (`Engine.info()`):
  `tandem serve`'s start-up line (`summary()`), `GetModelInfo.load_plan`, `GET /v1/models`'s `tandem_load_plan`
  and the `tandem_load_choice` metric all read this one record, so they cannot disagree.
- The same machine, model and flags give the same plan: no choice is made from a timing taken at start, nor
  from other processes' load: the thread governor follows that load between steps, under the plan's `threads`
  ceiling, and its count is a metric (`tandem_cpu_threads_active`), not a choice (`inference_svc.executor.governor`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    """One lever's choice at load (see the module docstring)."""

    lever: str
    value: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"lever": self.lever, "value": self.value, "reason": self.reason}


@dataclass(frozen=True)
class LoadPlan:
    """An engine's choices in the order they were made."""

    choices: tuple[Choice, ...] = ()

    def __iter__(self) -> Iterator[Choice]:
        return iter(self.choices)

    def __len__(self) -> int:
        return len(self.choices)

    def value(self, lever: str) -> str:
        """The value chosen for `lever`; KeyError naming it when the plan has no such lever."""
        for c in self.choices:
            if c.lever == lever:
                return c.value
        raise KeyError(f"the load plan has no lever {lever!r} (it has {', '.join(c.lever for c in self.choices)})")

    def summary(self) -> str:
        """One line: `lever=value` for every choice, in order (the start-up log line)."""
        return " ".join(f"{c.lever}={c.value}" for c in self.choices)

    def as_dicts(self) -> list[dict[str, str]]:
        return [c.as_dict() for c in self.choices]
