"""What every export reads and refuses: the checkpoint, the run's model description, the target folder.

Contract:
- `resolve_checkpoint(path)`: a checkpoint directory or Lightning `.ckpt` file, or a run directory / checkpoints
  folder -> its newest complete checkpoint (`CheckpointError` naming what is missing otherwise).
- `model_meta_or_none(ckpt)` / `find_model_meta(ckpt)`: the run's `model_meta/` (config.json and tokenizer).
- `check_export_target(out, ckpt, meta, given)`: `out` may not be, contain or lie inside what the export reads (the
  checkpoint, the checkpoints folder holding it, `model_meta/`), nor be or contain the run folder or the path given;
  paths are compared resolved. `check_bundle_out(out, overwrite)`: what an existing `out` may be. Any refusal is a
  one-line `CheckpointError` starting "refusing to ..." and nothing is written or deleted.
- `consolidate(ckpt)` verifies the checkpoint's manifest first (a partial or corrupt checkpoint is a
  `CheckpointError`, never a silently wrong model), then merges the shards with DeepSpeed's own
  `get_fp32_state_dict_from_zero_checkpoint` into one fp32 state dict (a stage-0 checkpoint without a ZeRO
  optimizer is read whole). `load_module_state(ckpt)` is that, or a `.ckpt` file's state. `check_finite` names the
  first tensor holding NaN or Inf.
- The format modules of this package (`bundle`, `state_dict`, `hf`, `adapter`) import this one and none another's
  private parts; it imports none of them.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from lt_plugins.checkpoint_io import MANIFEST, latest_checkpoint, verify_checkpoint
from lt_plugins.checkpoint_read import read_lightning_state
from lt_plugins.errors import CheckpointError
from shared_model.bundle import MANIFEST_FILE, check_bundle_target
from shared_model.errors import SharedModelError

META_DIR = "model_meta"
"""Folder of a run holding the model's config.json and tokenizer files."""


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory or Lightning `.ckpt` file, or a run directory / checkpoints folder → its newest
    complete checkpoint."""
    path = Path(path)
    if path.is_file():
        return path  # a Lightning .ckpt file
    if (path / "latest").is_file() or (path / "tandem_manifest.json").is_file():
        return path
    for folder in (path, path / "checkpoints"):
        found = latest_checkpoint(folder)
        if found is not None:
            return found
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}; give a checkpoint directory, a run dir or a .ckpt file")
    raise CheckpointError(f"no complete checkpoint found at {path} (no folder with a {MANIFEST} in it or below)")


def model_meta_or_none(ckpt_dir: Path) -> Path | None:
    """The `model_meta/` folder of the run a checkpoint belongs to (searched in the checkpoint and 3 parents)."""
    for folder in [ckpt_dir, *list(ckpt_dir.resolve().parents)[:3]]:
        if (folder / META_DIR / "config.json").is_file():
            return folder / META_DIR
    return None


def find_model_meta(ckpt_dir: Path) -> Path:
    """`model_meta_or_none`, or a CheckpointError naming the ways out."""
    found = model_meta_or_none(ckpt_dir)
    if found is None:
        raise CheckpointError(
            f"no {META_DIR}/config.json next to or above {ckpt_dir}, so it is not a Tandem run: pass --model-meta DIR "
            "for a bundle, or --format state-dict (any module) or --format hf (a Hugging Face model inside)"
        )
    return found


def check_export_target(
    out_dir: str | Path, ckpt_dir: Path, meta_dir: Path | None, given: str | Path | None = None
) -> None:
    """Raise CheckpointError if writing a bundle to `out_dir` could replace or nest inside what the export reads.
    `meta_dir` is the folder the model description comes from (None when the export reads none)."""
    out = Path(out_dir).resolve()
    ckpt = ckpt_dir.resolve()
    meta = meta_dir.resolve() if meta_dir is not None else None
    given_path = Path(given).resolve() if given is not None else None
    # read: out may not be, contain or lie inside these. held: out may not be or contain these (a new folder
    # inside the run, like the default <run>/bundle, is fine; a non-bundle folder there is refused by save_bundle).
    read: dict[Path, str] = {ckpt: "the checkpoint being exported"}
    if meta is not None:
        read[meta] = "the model description being read"
    held: dict[Path, str] = {}
    if given_path is not None:
        held[given_path] = "the checkpoint path given"
    if ckpt.parent.name == "checkpoints":
        read[ckpt.parent] = "the checkpoints folder being read"
        held[ckpt.parent.parent] = "the run being read"
    elif ckpt.parent == given_path:
        read[ckpt.parent] = "the folder of checkpoints being read"
    if meta is not None and meta.name == META_DIR:
        held[meta.parent] = "the run being read"
    guarded = {**held, **read}
    for folder, what in guarded.items():
        if out == folder:
            raise CheckpointError(f"refusing to export to {out_dir}: it is {what} ({folder})")
    for folder, what in guarded.items():
        if folder.is_relative_to(out):
            raise CheckpointError(f"refusing to export to {out_dir}: it contains {what} ({folder})")
    for folder, what in read.items():
        if out.is_relative_to(folder):
            raise CheckpointError(f"refusing to export to {out_dir}: it lies inside {what} ({folder})")


def check_bundle_out(out_dir: str | Path, overwrite: bool) -> None:
    """Raise CheckpointError unless a bundle may be written to `out_dir`: it does not exist, or `overwrite` is set
    and it is an empty folder or a Tandem bundle. Without `overwrite` the message says what is in the way and
    whether `--overwrite` would replace it."""
    out = Path(out_dir)
    if not out.exists() and not out.is_symlink():
        return
    try:
        check_bundle_target(out, overwrite=True)  # may --overwrite replace it?
    except SharedModelError as exc:
        if overwrite:
            raise CheckpointError(str(exc)) from exc
        reason = str(exc).removeprefix(f"refusing to overwrite {out}: ")
        raise CheckpointError(
            f"refusing to export to {out_dir}: it already exists, and --overwrite would not replace it either: "
            f"{reason}; choose another folder"
        ) from exc
    if overwrite:
        return
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        what = "is an empty folder"
    else:
        shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
        kind = "a Tandem bundle" if MANIFEST_FILE in entries else "a bundle written before manifests"
        what = f"holds {kind} ({shown})"
    raise CheckpointError(
        f"refusing to export to {out_dir}: it already exists and {what}; pass --overwrite to replace it"
    )


def consolidate(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """One fp32 state dict from the shards of a verified DeepSpeed checkpoint."""
    ckpt_dir = Path(ckpt_dir)
    tag_dir = verify_checkpoint(ckpt_dir)
    whole = _unsharded_module_state(tag_dir)
    if whole is not None:
        return whole
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:  # DeepSpeed prints its progress ("Loading checkpoint shards", "Reconstructed ...") on stdout/stderr
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag_dir.name)
    except Exception as exc:  # DeepSpeed raises ValueError/FileNotFoundError/RuntimeError/pickle errors
        raise CheckpointError(f"cannot consolidate the ZeRO shards in {tag_dir}: {type(exc).__name__}: {exc}") from exc
    return dict(state)


def _unsharded_module_state(tag_dir: Path) -> dict[str, torch.Tensor] | None:
    """Stage 0 without a ZeRO optimizer (32-true) saves no optimizer shards and no `param_shapes`, which DeepSpeed's
    zero_to_fp32 cannot read: there the model-states file's `module` is the whole state dict (as fp32). None when
    the checkpoint is sharded."""
    from lt_plugins.checkpoint_read import _load

    files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if not files or any(tag_dir.glob("*optim_states.pt")):
        return None
    data = _load(files[0])
    module = data.get("module")
    if data.get("param_shapes") is not None or not isinstance(module, dict):
        return None
    return {k: (v.float() if v.is_floating_point() else v).clone() for k, v in module.items()}


def load_module_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The module's full state dict: merged ZeRO shards (fp32) of a checkpoint directory, or a `.ckpt` file's."""
    return consolidate(ckpt) if ckpt.is_dir() else read_lightning_state(ckpt)


def check_finite(ckpt: Path, state: dict[str, torch.Tensor]) -> None:
    """CheckpointError naming the first floating tensor holding NaN or Inf."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{ckpt}: tensor {name} holds NaN or Inf values")
