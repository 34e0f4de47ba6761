"""`tandem train` with bad input: exit code 2 and exactly one line on stderr naming the key, never a traceback.

The CLI cases run `tandem train`'s entry point in this process with the tiny CPU config (each fails before any
training step), and one of them also as the real command in a subprocess (what a user runs: the exit code and the
only line on stderr). Before this fix a missing `data.extra` path, an empty corpus and a missing `data.tokenizer` gave a
traceback and rc 1, `optim.lr=nan` a 55-line traceback, and `optim.lr=inf` trained on NaN. The schema cases check
every float field of the training config for the same hole (NaN and inf slip through `value <= 0` tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lt_plugins.config import load_config
from lt_plugins.errors import TrainingConfigError

REPO = Path(__file__).resolve().parents[2]
SMALL = ["data.max_documents=20", "data.block_size=32", "data.batch_size=2", "trainer.max_steps=2"]
SMALL += ["trainer.precision=32-true", "trainer.enable_progress_bar=false", "logging.tensorboard=false"]


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(REPO / "configs/tiny-cpu.yaml")]
    cmd += [*SMALL, f"run_dir={tmp_path / 'run'}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _empty_file(tmp_path: Path) -> str:
    path = tmp_path / "empty.py"
    path.write_text("")
    return str(path)


CLI_CASES = {
    "extra-missing": (lambda p: ["data.extra=[/no/such/dir/x.py]"], "data.extra: path not found: /no/such/dir/x.py"),
    "extra-is-a-directory": (lambda p: [f"data.extra=[{p}]"], "data.extra: "),
    "corpus-empty": (lambda p: ["data.include_stdlib=false"], "data: the corpus is empty"),
    # the split hashes a file's path, which holds pytest's tmp folder: fix the fraction, not the luck of the name
    "corpus-no-tokens": (
        lambda p: ["data.include_stdlib=false", f"data.extra=[{_empty_file(p)}]", "data.val_fraction=0"],
        "data: the training split holds fewer than data.block_size+1=33 tokens",
    ),
    "corpus-all-held-out": (
        lambda p: ["data.include_stdlib=false", f"data.extra=[{_empty_file(p)}]", "data.val_fraction=0.9999999"],
        "data: the corpus has no training document (1 held out by data.val_fraction",
    ),
    "tokenizer-missing": (lambda p: ["data.tokenizer=/no/such/tokenizer"], "data.tokenizer: path not found"),
    "tokenizer-unreadable": (lambda p: [f"data.tokenizer={_empty_file(p)}"], "data.tokenizer: "),
    "lr-nan": (lambda p: ["optim.lr=nan"], "optim.lr must be a finite number > 0, got nan"),
    "lr-inf": (lambda p: ["optim.lr=inf"], "optim.lr must be a finite number > 0, got inf"),
    "lr-overflows-float32": (lambda p: ["optim.lr=1e38"], "optim.lr=1e+38 is too large"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_bad_input_is_one_line_rc2(tmp_path: Path, case: str, capsys, monkeypatch) -> None:
    from lt_plugins.cli import train_main

    overrides, expected = CLI_CASES[case]
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(REPO / "configs/tiny-cpu.yaml"), *SMALL, f"run_dir={tmp_path / 'run'}"]
    rc = train_main([*args, *overrides(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2, err[-4000:]
    _check_one_line(err, expected)
    assert not (tmp_path / "run" / "checkpoints").exists()  # failed before training


def test_the_real_command_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = _train(tmp_path, "data.extra=[/no/such/dir/x.py]")
    assert proc.returncode == 2, proc.stderr[-4000:]
    _check_one_line(proc.stderr, "data.extra: path not found: /no/such/dir/x.py")


def _check_one_line(stderr: str, expected: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-4000:]
    assert lines[0].startswith("tandem train: error: "), lines[0]
    assert expected in lines[0], lines[0]


FLOAT_CASES = [
    ("optim.lr", "nan"),
    ("optim.lr", "inf"),
    ("optim.lr", "0"),
    ("optim.lr", "1e39"),
    ("optim.weight_decay", "nan"),
    ("optim.weight_decay", "inf"),
    ("optim.weight_decay", "-0.1"),
    ("optim.weight_decay", "1e30"),  # lr·weight_decay > 1: AdamW would flip and blow up the weights
    ("optim.beta1", "nan"),
    ("optim.beta1", "1.0"),
    ("optim.beta2", "inf"),
    ("optim.beta2", "-0.5"),
    ("optim.min_lr_ratio", "nan"),
    ("optim.min_lr_ratio", "1.5"),
    ("trainer.gradient_clip_val", "nan"),
    ("trainer.gradient_clip_val", "inf"),
    ("trainer.gradient_clip_val", "-1"),
    ("data.val_fraction", "nan"),
    ("data.val_fraction", "inf"),
    ("ledger.tolerance", "nan"),
]


@pytest.mark.parametrize(("key", "value"), FLOAT_CASES)
def test_float_fields_refuse_nonfinite_and_out_of_range(key: str, value: str) -> None:
    with pytest.raises(TrainingConfigError, match=key.replace(".", r"\.")) as info:
        load_config(REPO / "configs/tiny-cpu.yaml", [f"{key}={value}"])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "override",
    ["trainer.gradient_clip_val=null", "trainer.gradient_clip_val=0", "optim.weight_decay=0", "optim.beta1=0"],
)
def test_boundary_values_still_accepted(override: str) -> None:
    load_config(REPO / "configs/tiny-cpu.yaml", [override])
