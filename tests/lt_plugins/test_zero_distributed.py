"""ZeroStrategy on CPU with 2 processes over gloo: loss parity with plain Lightning for stages 0-3, per-rank state
bytes, stage-3 export parity (shared_model and transformers), exact resume after a kill, corrupt checkpoints."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lt_plugins.errors import CheckpointError
from lt_plugins.export.bundle import export_bundle

sys.path.insert(0, str(Path(__file__).parent))
from zero_launch import launch
from zero_worker import DATA, MICRO, OPTIM, micro_blocks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    out = tmp_path_factory.mktemp("zero")
    launch("stages", out)
    r0 = json.loads((out / "stages-rank0.json").read_text())
    r1 = json.loads((out / "stages-rank1.json").read_text())
    return out, r0, r1


@pytest.fixture(scope="module")
def plain_lightning_losses() -> list[float]:
    return _plain_lightning_losses(20)


def _plain_lightning_losses(steps: int) -> list[float]:
    """The same run in one process with plain Lightning: batch 2·B covers both ranks' batches."""
    from dataclasses import replace

    from lt_plugins.data import CorpusDataModule
    from lt_plugins.lit_module import LitCausalLM

    losses: list[float] = []

    class Rec(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx):  # type: ignore[no-untyped-def]
            losses.append(float(outputs["loss"]))

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=[Rec()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    data = replace(DATA, batch_size=DATA.batch_size * 2)
    trainer.fit(LitCausalLM(MICRO, OPTIM, seed=0), datamodule=CorpusDataModule(data, micro_blocks()))
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_matches_plain_lightning(
    stages: tuple[Path, dict, dict], plain_lightning_losses: list[float], stage: int
) -> None:
    _, r0, r1 = stages
    reference = plain_lightning_losses
    ours = r0[f"stage{stage}"]["losses"]
    assert len(ours) == 20
    assert ours == r1[f"stage{stage}"]["losses"]  # reduced across ranks: identical
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(reference), rtol=2e-4, atol=2e-4)
    assert ours[-1] < ours[0] - 0.1  # it learns


def test_state_bytes_fall_where_the_stage_promises(stages: tuple[Path, dict, dict]) -> None:
    _, r0, r1 = stages
    for rank_result in (r0, r1):
        full = rank_result["stage0"]["bytes"]
        params = full["params"]
        assert full["grads"] == params and full["optimizer"] >= 2 * params  # DDP-like: everything whole
        for stage in (1, 2, 3):
            b = rank_result[f"stage{stage}"]["bytes"]
            assert b["optimizer"] == pytest.approx(full["optimizer"] / 2, rel=0.02), stage
            assert b["master"] == pytest.approx(params / 2, rel=0.02), stage
            if stage >= 2:
                assert b["grads"] == pytest.approx(params / 2, rel=0.02), stage
            if stage == 3:
                assert b["params"] == pytest.approx(params / 2, rel=0.02)
            else:
                assert b["params"] == params, stage


def test_bf16_mixed_runs_on_cpu(stages: tuple[Path, dict, dict]) -> None:
    _, r0, _ = stages
    fp32 = r0["straight10"][:3]
    torch.testing.assert_close(torch.tensor(r0["bf16"]), torch.tensor(fp32), rtol=0.02, atol=0.05)


def test_stage3_export_matches_in_shared_model_and_transformers(stages: tuple[Path, dict, dict]) -> None:
    out, _, _ = stages
    from shared_model.bundle import load_bundle

    transformers = pytest.importorskip("transformers")
    ids = micro_blocks().train[:2, :16]
    ours = load_bundle(out / "bundle-s3", dtype=torch.float32).model(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "bundle-s3", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(ours.detach(), theirs, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours, torch.zeros_like(ours))


def test_corrupt_or_partial_checkpoint_is_refused(stages: tuple[Path, dict, dict], tmp_path: Path) -> None:
    out, _, _ = stages
    src = next((out / "ckpt-s3").iterdir())
    cases = {"truncated": tmp_path / "truncated", "missing": tmp_path / "missing", "unfinished": tmp_path / "nom"}
    for dst in cases.values():
        shutil.copytree(src, dst)
    shard = sorted((cases["truncated"] / "checkpoint").glob("*optim_states.pt"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    sorted((cases["missing"] / "checkpoint").glob("*optim_states.pt"))[1].unlink()
    (cases["unfinished"] / "tandem_manifest.json").unlink()
    expected = {"truncated": "corrupt", "missing": "partial", "unfinished": "did not finish"}
    for name, dst in cases.items():
        with pytest.raises(CheckpointError, match=expected[name]):
            export_bundle(dst, tmp_path / f"bundle-{name}", meta_dir=out / "model_meta")
        assert not (tmp_path / f"bundle-{name}").exists()


def test_resume_after_kill_continues_exactly(stages: tuple[Path, dict, dict]) -> None:
    out, r0, _ = stages
    launch("part_a", out)  # killed right after the step-5 checkpoint
    assert (out / "ckpt-resume" / "step-000005" / "tandem_manifest.json").is_file()
    assert not (out / "ckpt-resume" / "step-000010").exists()
    launch("part_b", out)
    resumed = json.loads((out / "part_b-rank0.json").read_text())["resumed"]
    straight = r0["straight10"]
    assert len(resumed) == 5
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight[5:]), rtol=1e-5, atol=1e-5)
