"""`make demo` as a newcomer sees it: the Python check on the served completion, the demo config, the order of the
steps, and the training output without Lightning's tip or a "Epoch 0/-2" progress bar. (The demo itself takes
minutes; these checks take about a second.)"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def demo():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("tandem_demo_script", REPO / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


PYTHON_LIKE = '''
    """Return the list of a file."""
    if not isinstance(self._check_dir, str):
        return self.path.join(data, c)
    for name in names:
        raise ValueError("class file")  # is not in the list
'''


def test_python_check_counts_code_not_strings_or_comments(demo) -> None:  # type: ignore[no-untyped-def]
    check = demo.check_python(PYTHON_LIKE)
    assert check.ok
    assert check.keywords == ["if", "not", "return", "for", "in", "raise"]  # not the docstring's, string's or comment's
    assert {"isinstance", "self", "_check_dir", "path", "join", "ValueError"} <= set(check.identifiers)
    assert check.indented_lines == 4  # the docstring line is not code
    assert "6 distinct Python keywords (need 4)" in check.summary()


@pytest.mark.parametrize(
    "completion",
    [
        ",,,,,,,,,,,,,,,,",  # what the 24-step bf16 demo used to print
        '\n    """if the list is not in the file, return it for the class"""\n',  # English in a docstring
        "if x: return y\nfor z in w: pass\n",  # keywords, but no indented line
    ],
)
def test_python_check_refuses_what_does_not_read_as_python(demo, completion: str) -> None:  # type: ignore[no-untyped-def]
    assert not demo.check_python(completion).ok


def test_an_unclosed_docstring_ends_with_its_line(demo) -> None:  # type: ignore[no-untyped-def]
    check = demo.check_python('\n    """Return if the list.\n\n    def _get(self):\n        return self.x\n')
    assert check.keywords == ["def", "return"] and check.identifiers == ["_get", "self", "x"]
    assert check.indented_lines == 2


def test_demo_config_trains_fp32_state_on_one_process() -> None:
    from lt_plugins.config import load_config

    cfg = load_config(REPO / "configs" / "demo.yaml")
    assert cfg.trainer.precision == "32-true" and cfg.export.dtype == "float32"
    assert cfg.trainer.autocast == "auto"  # bf16 matmuls only where the CPU has native bf16 (docs/training.md)
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 1 and cfg.strategy.name == "zero"
    assert cfg.trainer.max_steps * cfg.data.batch_size * cfg.data.block_size >= 500_000  # enough tokens to learn


def test_comparison_is_the_last_step(demo, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    calls: list[str] = []
    bundle = Path("/nonexistent/bundle")
    monkeypatch.setattr(demo, "train", lambda: calls.append("train") or bundle)
    for name in ("check_bundle", "ledger"):
        monkeypatch.setattr(demo, name, lambda b, name=name: calls.append(name))
    check = demo.check_python(PYTHON_LIKE)
    monkeypatch.setattr(demo, "serve", lambda b: calls.append("serve") or check)
    real_compare = demo.compare_configurations
    monkeypatch.setattr(demo, "compare_configurations", lambda b: (calls.append("compare"), real_compare(b)))
    assert demo.main() == 0
    assert calls == ["train", "check_bundle", "ledger", "serve", "compare"]
    out = capsys.readouterr().out
    assert "tandem bench --compare" in out and "the completion reads as Python" in out


def test_progress_bar_of_a_max_steps_run_has_no_negative_epoch() -> None:
    from lt_plugins.cli import _progress_bar

    bar = _progress_bar()
    bar._trainer = SimpleNamespace(max_epochs=-1)  # what Lightning sets for a max_steps run
    assert bar._get_train_description(0).strip() == "Epoch 0"
    bar._trainer = SimpleNamespace(max_epochs=3)
    assert bar._get_train_description(0).strip() == "Epoch 0/2"


def test_lightning_tips_are_filtered_out() -> None:
    from lightning_utilities.core import rank_zero

    from lt_plugins.cli import _no_lightning_tips, _quiet

    _quiet()
    assert _no_lightning_tips in rank_zero.log.filters
    tip = logging.LogRecord("x", logging.INFO, __file__, 1, "💡 Tip: try installing litlogger", None, None)
    other = logging.LogRecord("x", logging.INFO, __file__, 1, "GPU available: False, used: False", None, None)
    assert not _no_lightning_tips(tip) and _no_lightning_tips(other)


def test_every_demo_server_runs_its_step_eagerly(demo, monkeypatch, tmp_path: Path) -> None:
    """The demo's servers live for seconds: a compile (about 50 s each on 2 cores) would be most of the demo."""
    seen: list[list[str]] = []

    class Started(Exception):
        pass

    class Serve:
        def __init__(self, model: Path, flags: list[str], **kwargs: object) -> None:
            seen.append(list(flags))
            raise Started

    monkeypatch.setattr("inference_svc.serve_process.ServeProcess", Serve)
    with pytest.raises(Started):
        demo.serve(tmp_path)
    monkeypatch.setattr(demo.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or SimpleNamespace(returncode=0))
    demo.compare_configurations(tmp_path / "bundle")
    serve_flags, bench_cmd = seen
    assert serve_flags[serve_flags.index("--compile") + 1] == "off"
    passed_on = bench_cmd[bench_cmd.index("--") + 1 :]  # `tandem bench --compare ... -- SERVE FLAGS`
    assert passed_on[passed_on.index("--compile") + 1] == "off"
