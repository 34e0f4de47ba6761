"""The `tandem` dispatcher: help, unknown commands, and plain messages for what cannot run here."""

from __future__ import annotations

import subprocess
import sys

from shared_model import cli


def test_help_lists_every_subcommand(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "export", "serve", "generate", "ledger", "plan", "bench"):
        assert f"  {name}" in out


def test_unknown_command(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_missing_module_says_the_installation_lacks_it(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "x", cli.Subcommand("inference_svc.does_not_exist:main", "x", "serve"))
    assert cli.main(["x"]) == 3
    err = capsys.readouterr().err
    assert "tandem x: this installation lacks inference_svc.does_not_exist: reinstall from a complete checkout" in err


def test_missing_dependency_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "y", cli.Subcommand("no_such_dependency_pkg:main", "y", "train"))
    assert cli.main(["y"]) == 3
    assert "pip install 'tandem[train]'" in capsys.readouterr().err


def test_ledger_does_not_import_training_or_serving_stacks():
    code = (
        "import sys; from shared_model.cli import main; main(['ledger', '--model', 'tiny']); "
        "heavy = [m for m in ('lightning', 'deepspeed', 'grpc', 'omegaconf', 'triton') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
