"""Checkpoint integrity: a manifest written after a sharded save, and the check that export and resume run first.

Contract:
- `write_manifest(ckpt_dir)` records every file under a finished DeepSpeed checkpoint directory with its size and
  SHA-256 in `tandem_manifest.json`, written last and atomically: its presence means the save completed. The
  hash is `shared_model.bundle.sha256_file`, the same helper the bundle manifest uses.
- `verify_checkpoint(ckpt_dir)` raises `CheckpointError` naming the problem: no such directory, no manifest (a save
  that never finished, or not a Tandem checkpoint), a listed file missing (partial copy), a size or hash mismatch
  (corrupt file), or no DeepSpeed `latest` tag. It returns the tag directory.
- `latest_checkpoint(folder)` is the newest checkpoint with a manifest under a run's checkpoint folder, or None.
- `PeriodicCheckpoint` runs Lightning's `ModelCheckpoint` (every N optimizer steps) writing `step-NNNNNN`
  directories, plus a save at the end of training. Before each save it checks, on every process, that the last
  training loss and every parameter are finite; if not it raises `NonFiniteError` and writes nothing, so a
  checkpoint of NaN/inf state never exists, let alone becomes the newest (`latest_checkpoint`) one that resume and
  export pick.
- Pruning (`prune_checkpoints`, after each completed save, on global rank 0) counts every `step-NNNNNN` directory in
  the folder, whichever attempt wrote it (Lightning's top-k only knew the saves of the current attempt, so the
  checkpoint a run resumed from was never deleted: each crash left one more): it keeps the newest `keep_last`
  complete ones by step, always the one just written and the last complete one (`latest_checkpoint`), and deletes
  the other complete ones and the incomplete ones (a save that crashed: no manifest, never used by resume or
  export) of an earlier step than the one just written. Other entries of the folder are never touched.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lt_plugins.errors import CheckpointError
from lt_plugins.finite import check_finite_before_save, loss_from_outputs
from shared_model.bundle import manifest_mismatch
from shared_model.bundle import sha256_file as _sha256

MANIFEST = "tandem_manifest.json"


def write_manifest(ckpt_dir: Path) -> Path:
    """Hash every file of a completed checkpoint directory; the manifest is renamed into place last."""
    files = sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(ckpt_dir)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    tmp = ckpt_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format": 1, "files": entries}, indent=1, sort_keys=True) + "\n")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, ckpt_dir / MANIFEST)
    return ckpt_dir / MANIFEST


def verify_checkpoint(ckpt_dir: str | Path, check_hashes: bool = True) -> Path:
    """Raise CheckpointError unless `ckpt_dir` is a complete, unaltered checkpoint; return its tag directory."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {ckpt_dir}")
    manifest = ckpt_dir / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(
            f"{ckpt_dir} has no {MANIFEST}: the save did not finish (partial checkpoint) or it is not a Tandem "
            "ZeRO checkpoint directory"
        )
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest} is corrupt: {exc}") from exc
    bad = manifest_mismatch(ckpt_dir, entries, check_hashes)
    if bad is not None:
        path, how = bad
        if how == "missing":
            raise CheckpointError(f"partial checkpoint: {path} is listed in {MANIFEST} but missing")
        if how == "size":
            listed = entries[str(path.relative_to(ckpt_dir))]["bytes"]
            raise CheckpointError(
                f"corrupt checkpoint: {path} has {path.stat().st_size} bytes, the manifest says {listed}"
            )
        raise CheckpointError(f"corrupt checkpoint: {path} does not match its SHA-256 in {MANIFEST}")
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        raise CheckpointError(f"{ckpt_dir} has no DeepSpeed 'latest' file naming the checkpoint tag")
    tag_dir = ckpt_dir / latest.read_text().strip()
    if not tag_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: the tag directory {tag_dir.name!r} named by 'latest' is missing")
    return tag_dir


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The most recently written checkpoint directory under `folder` that has a manifest, or None."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    done = [p for p in folder.iterdir() if p.is_dir() and (p / MANIFEST).is_file()]
    return max(done, key=lambda p: (p / MANIFEST).stat().st_mtime_ns, default=None)


STEP_DIR = re.compile(r"step-(\d+)")
"""A PeriodicCheckpoint directory name; the number is the global step."""


def prune_checkpoints(folder: str | Path, keep_last: int, written: Path) -> list[Path]:
    """Which `step-NNNNNN` directories of `folder` to delete after `written` was saved (see the module contract):
    every complete one beyond the newest `keep_last` by step (never `written` nor `latest_checkpoint(folder)`),
    and every incomplete one of an earlier step than `written`. Returns them; deleting is the caller's."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
    folder, written = Path(folder), Path(written)
    mine = STEP_DIR.fullmatch(written.name)
    written_step = int(mine.group(1)) if mine else None
    steps = []
    for path in folder.iterdir() if folder.is_dir() else ():
        match = STEP_DIR.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink():
            steps.append((int(match.group(1)), path))
    complete = sorted(((s, p) for s, p in steps if (p / MANIFEST).is_file()), reverse=True)
    keep = {p.name for _, p in complete[:keep_last]} | {written.name}
    last = latest_checkpoint(folder)
    if last is not None:
        keep.add(last.name)
    doomed = [p for _, p in complete if p.name not in keep]
    if written_step is not None:
        doomed += [p for s, p in steps if not (p / MANIFEST).is_file() and s < written_step and p.name not in keep]
    return sorted(doomed)


class _StepDirectories(ModelCheckpoint):
    """Lightning's ModelCheckpoint naming `step-NNNNNN` directories and asking its owner before each save; it keeps
    every save (save_top_k=-1): pruning is the owner's, over the whole folder."""

    FILE_EXTENSION = ""  # DeepSpeed checkpoints are directories: step-000005, not step-000005.ckpt

    def __init__(self, owner: PeriodicCheckpoint, dirpath: Path, every_n_steps: int, keep_last: int) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="step-{step:06d}",
            auto_insert_metric_name=False,
            monitor="step",
            mode="max",
            save_top_k=-1,
            every_n_train_steps=every_n_steps,
            enable_version_counter=False,
        )
        self._owner = owner

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        path = Path(filepath)
        check_finite_before_save(trainer, trainer.lightning_module, path.name, self._owner.last_loss)  # or raises
        super()._save_checkpoint(trainer, filepath)  # ZeroStrategy: its manifest written, all ranks past the save
        self._owner.saved.append(path)
        if trainer.is_global_zero:
            for old in prune_checkpoints(self._owner.dirpath, self._owner.keep_last, path):
                trainer.strategy.remove_checkpoint(old)


class PeriodicCheckpoint(Callback):
    """Sharded checkpoints `<dirpath>/step-NNNNNN` every N optimizer steps and at the end; keeps the newest K in the
    folder, counting those of earlier attempts (`prune_checkpoints`).

    The schedule and naming are Lightning's `ModelCheckpoint(every_n_train_steps=N)`, held
    inside (so this also runs under `Trainer(enable_checkpointing=False)`, which refuses a ModelCheckpoint in the
    callbacks); what it adds is what Lightning lacks: a save at the end of training and the finiteness check before
    every save. The manifest marking a save complete is written by the strategy's `save_checkpoint` (ZeroStrategy
    does), so this works with any strategy that writes one. A resumed run does not save its starting step again."""

    def __init__(self, dirpath: str | Path, every_n_steps: int, keep_last: int = 2) -> None:
        if every_n_steps <= 0 or keep_last <= 0:
            raise CheckpointError(f"every_n_steps and keep_last must be > 0, got {every_n_steps}, {keep_last}")
        self.dirpath, self.every_n_steps, self.keep_last = Path(dirpath), every_n_steps, keep_last
        self.last_loss: Any = None
        """The loss of the last training step (checked before a save)."""
        self.saved: list[Path] = []
        """The checkpoints written in this process's fits."""
        self._steps = _StepDirectories(self, self.dirpath, every_n_steps, keep_last)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        with warnings.catch_warnings():  # resuming writes into the run's own checkpoint folder: that is the design
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            self._steps.setup(trainer, pl_module, stage)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps.on_train_start(trainer, pl_module)
        self._steps._last_global_step_saved = trainer.global_step  # a resumed run: its starting step is saved

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, *args: Any) -> None:
        self.last_loss = loss_from_outputs(outputs)
        self._steps.on_train_batch_end(trainer, pl_module, outputs, *args)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps.on_train_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps.on_validation_end(trainer, pl_module)  # where ModelCheckpoint saves a step it deferred

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step != self._steps._last_global_step_saved:
            self._steps._save_topk_checkpoint(trainer, self._steps._monitor_candidates(trainer))

    def state_dict(self) -> dict[str, Any]:
        return self._steps.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._steps.load_state_dict(state_dict)
