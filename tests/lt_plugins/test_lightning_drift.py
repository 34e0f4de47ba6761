"""ZeroStrategy overrides four private DeepSpeedStrategy methods with copies that change a line or two (the CPU
accelerator check, the device-index validation, `device_rank` on CPU). When Lightning changes its versions, the
copies silently keep the old behaviour: this test pins a SHA-256 of each upstream method's source and fails with
what to do when it changes. pyproject.toml pins Lightning below its next minor release for the same reason."""

from __future__ import annotations

import hashlib
import inspect
import re
from pathlib import Path

import lightning
import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy

from lt_plugins.strategy import ZeroStrategy

PINNED_VERSION = "2.6.6"
"""The Lightning release whose DeepSpeedStrategy the copies in lt_plugins/strategy.py were diffed against."""

UPSTREAM_SHA256 = {
    "_setup_model_and_optimizer": "6a7d1e7daa636a60b2b617bd9b344776cf14597232c75136ed7ff15f50c645f9",
    "_initialize_deepspeed_inference": "dc47d956a17bc6acdce01afe9c45dbb6f47743d277bd57b8069ef21c4a7acbec",
    "setup_distributed": "78cee79c7c131102d8a08e3259a2543a74211833be44d1ab5048657c149b9c93",
    "setup_environment": "de7e179a7fc99ab5367054ae285c2698a1f689ae8845ee5014f177e945bc3a3e",
}


def _sha(method: object) -> str:
    return hashlib.sha256(inspect.getsource(method).encode()).hexdigest()  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(UPSTREAM_SHA256))
def test_upstream_method_is_the_one_the_copy_was_made_from(name: str) -> None:
    upstream = getattr(DeepSpeedStrategy, name)
    assert getattr(ZeroStrategy, name) is not upstream, f"ZeroStrategy no longer overrides {name}: drop its pin"
    assert _sha(upstream) == UPSTREAM_SHA256[name], (
        f"Lightning {lightning.__version__} changed DeepSpeedStrategy.{name} (the copy in lt_plugins/strategy.py was "
        f'made from Lightning {PINNED_VERSION}). Re-diff it: `python -c "import inspect; from lightning.pytorch.'
        f'strategies import DeepSpeedStrategy as D; print(inspect.getsource(D.{name}))"` against '
        f"ZeroStrategy.{name}, carry the upstream change into the copy, then update UPSTREAM_SHA256['{name}'] and "
        f"PINNED_VERSION in {Path(__file__).name} and the Lightning bound in pyproject.toml."
    )


def test_pyproject_pins_lightning_below_the_next_minor_release() -> None:
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    match = re.search(r'"lightning>=[\d.]+,<(\d+)\.(\d+)"', text)
    assert match, "pyproject.toml must pin lightning with an upper bound (<MAJOR.MINOR) while ZeroStrategy copies it"
    major, minor = (int(x) for x in PINNED_VERSION.split(".")[:2])
    assert (int(match[1]), int(match[2])) == (major, minor + 1), (
        f"pyproject.toml's Lightning bound <{match[1]}.{match[2]} is not the release after {PINNED_VERSION}, the one "
        "the copies were checked against"
    )
