"""`tandem export` into an existing folder: the refusal names --overwrite and what is in the way (no training run:
the target is checked before any shard is read, so a checkpoint folder with a manifest file is enough)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lt_plugins.cli import export_main
from lt_plugins.errors import CheckpointError
from lt_plugins.export import checkpoint as export_mod
from lt_plugins.export.bundle import export_bundle
from shared_model.bundle import MANIFEST_FILE, save_bundle
from shared_model.model import build_model
from tests.conftest import tiny_config


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run folder as export sees it before reading shards: checkpoints/step-000001 (manifest) and model_meta/."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "checkpoints" / "step-000001" / "tandem_manifest.json").write_text("{}\n")
    (run / "model_meta").mkdir()
    config = tiny_config().to_hf_dict(torch_dtype="float32")
    (run / "model_meta" / "config.json").write_text(json.dumps(config))
    return run


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert export_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tandem export: error: refusing to export to"), err
    return err


def test_an_existing_bundle_names_the_flag_and_what_is_there(run: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    cfg = tiny_config()
    out = save_bundle(tmp_path / "out", cfg, build_model(cfg))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    err = _refusal([str(run), str(out)], capsys)
    assert f"refusing to export to {out}: it already exists and holds a Tandem bundle" in err
    assert "pass --overwrite to replace it" in err and "overwrite=True" not in err
    assert "model.safetensors" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_empty_folder_or_a_foreign_one_says_which(run: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _refusal([str(run), str(empty)], capsys)
    assert "it already exists and is an empty folder; pass --overwrite to replace it" in err
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("mine\n")
    err = _refusal([str(run), str(plain)], capsys)
    assert "--overwrite would not replace it either" in err and "notes.txt" in err and "overwrite=True" not in err
    assert (plain / "notes.txt").read_text() == "mine\n"


def test_a_target_that_appears_while_exporting_is_not_blamed_on_the_checkpoint(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    state = {f"model.{k}": v for k, v in build_model(tiny_config()).state_dict().items()}

    def consolidate(ckpt_dir: object) -> dict[str, torch.Tensor]:
        out.mkdir()  # another export (or the user) creates the folder while the shards are read
        (out / "notes.txt").write_text("mine\n")
        return state

    monkeypatch.setattr(export_mod, "consolidate", consolidate)
    with pytest.raises(CheckpointError) as info:
        export_bundle(run, out)
    message = str(info.value)
    assert message.startswith(f"refusing to export to {out}: it already exists"), message
    assert "does not match the model" not in message and "notes.txt" in message
    assert not (out / MANIFEST_FILE).exists()
