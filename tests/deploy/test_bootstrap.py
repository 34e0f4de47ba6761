"""scripts/bootstrap.sh refuses an argument it does not know before it touches the venv, naming what was wrong.

The install itself is exercised by every run of `make test` and `make demo` (they start with it); what is checked
here is the argument contract: a typo must not silently fall back to a default set-up.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

BOOTSTRAP = Path(__file__).resolve().parents[2] / "scripts" / "bootstrap.sh"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bytecode", "some"], "--bytecode must be all or lazy, got 'some'"),
        (["--bytecode"], "--bytecode must be all or lazy, got ''"),
        (["--bytecode=eager"], "--bytecode must be all or lazy, got 'eager'"),
        (["--lazy"], "unknown argument '--lazy'"),
    ],
)
def test_a_bad_argument_is_refused_with_its_name(args: list[str], message: str) -> None:
    proc = subprocess.run(["bash", str(BOOTSTRAP), *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr
