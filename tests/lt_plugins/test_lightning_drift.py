"""ZeroStrategy overrides four private DeepSpeedStrategy methods with copies that change a line or two (the CPU
accelerator check, the device-index validation, `device_rank` on CPU). When Lightning changes its versions, the
copies silently keep the old behaviour: this test pins a SHA-256 of each upstream method's source and fails with
what to do when it changes. pyproject.toml pins Lightning below its next minor release for the same reason.
The same holds for the one DeepSpeed method replaced while LitCausalLM builds its decoder under zero.Init
(`Init._zero_init_param`, without its broadcast: lt_plugins.lit_module.unfilled_construction)."""

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


DEEPSPEED_PINNED_VERSION = "0.19.8"
ZERO_INIT_PARAM_SHA256 = "2930fbd6b94e89a557d2d74994d710c905f5f06c02a16abc0436270ae9b12dc0"
"""deepspeed.runtime.zero.partition_parameters.Init._zero_init_param in DEEPSPEED_PINNED_VERSION."""


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


def test_deepspeed_zero_init_param_is_the_one_replaced_without_its_broadcast() -> None:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import Init

    assert _sha(Init._zero_init_param) == ZERO_INIT_PARAM_SHA256, (
        f"DeepSpeed {deepspeed.__version__} changed Init._zero_init_param (lt_plugins/lit_module.py replaces it, "
        f"during construction only, by its DeepSpeed {DEEPSPEED_PINNED_VERSION} body minus the broadcast: "
        '`_partition_without_broadcast`). Re-read it with `python -c "import inspect; from deepspeed.runtime.zero.'
        'partition_parameters import Init; print(inspect.getsource(Init._zero_init_param))"`, carry the change '
        f"into the replacement, then update ZERO_INIT_PARAM_SHA256 and DEEPSPEED_PINNED_VERSION in "
        f"{Path(__file__).name} and the DeepSpeed bound in pyproject.toml."
    )


def test_pyproject_pins_deepspeed_below_the_next_minor_release() -> None:
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    match = re.search(r'"deepspeed>=[\d.]+,<(\d+)\.(\d+)"', text)
    major, minor = (int(x) for x in DEEPSPEED_PINNED_VERSION.split(".")[:2])
    assert match and (int(match[1]), int(match[2])) == (major, minor + 1), (
        f"pyproject.toml must pin deepspeed below {major}.{minor + 1}, the release after {DEEPSPEED_PINNED_VERSION}"
    )
