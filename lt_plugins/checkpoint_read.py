"""Reading any LightningModule checkpoint without its class: weights, hyperparameters, identity.

Contract:
- A checkpoint is either a ZeroStrategy directory (`tandem_manifest.json`, DeepSpeed's `latest` tag, shards of any
  ZeRO stage) or a plain Lightning `.ckpt` file. Nothing here imports the module's class or unpickles objects:
  `.ckpt` files and DeepSpeed's model-states file are read with `torch.load(weights_only=True)`. (Merging ZeRO
  shards is `lt_plugins.export.checkpoint.consolidate`, DeepSpeed's own zero_to_fp32 reader.)
- `read_lightning_state(path)` is the `state_dict` of a `.ckpt` file: the module's names, its dtypes.
- `read_hyperparameters(ckpt)` is the `hyper_parameters` Lightning saved (`save_hyperparameters()`), `{}` when the
  module saved none; a value that is not plain data (a pickled object) is a `CheckpointError` naming the file.
- `checkpoint_source(ckpt)` is the checkpoint's identity for provenance: its name, path and the SHA-256 of its
  manifest (a ZeRO directory: the manifest hashes every shard) or of the file itself. Two exports of the same
  checkpoint carry the same `checkpoint_sha256`, wherever the run folder is mounted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lt_plugins.checkpoint_io import MANIFEST, verify_checkpoint
from lt_plugins.errors import CheckpointError
from shared_model.bundle import sha256_file


def _load(path: Path) -> dict[str, Any]:
    """A torch file read with weights_only=True (memory-mapped), as a dict."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # UnpicklingError for objects, RuntimeError for a file that is not a torch archive
        first = " ".join(str(exc).split())[:200]
        raise CheckpointError(
            f"cannot read {path} safely (torch.load weights_only=True): {type(exc).__name__}: {first}"
        ) from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not a Lightning checkpoint dict")
    return data


def read_lightning_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The module state dict stored in a Lightning `.ckpt` file."""
    path = Path(path)
    state = _load(path).get("state_dict")
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{path} has no 'state_dict' (not a Lightning checkpoint, or one saved without weights)")
    return {str(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _model_states_file(ckpt_dir: Path) -> Path:
    """Rank 0's DeepSpeed model-states file (`mp_rank_00_model_states.pt`, or `zero_pp_rank_0_…` at stage 3)."""
    tag_dir = verify_checkpoint(ckpt_dir, check_hashes=False)
    files = sorted(tag_dir.glob("*model_states.pt"))
    if not files:
        raise CheckpointError(f"{tag_dir} holds no DeepSpeed *model_states.pt file")
    return files[0]


def read_hyperparameters(ckpt: str | Path) -> dict[str, Any]:
    """The hyperparameters a LightningModule saved into this checkpoint (`{}` if none)."""
    ckpt = Path(ckpt)
    data = _load(_model_states_file(ckpt) if ckpt.is_dir() else ckpt)
    hparams = data.get("hyper_parameters")
    return dict(hparams) if isinstance(hparams, dict) else {}


def checkpoint_source(ckpt: str | Path) -> dict[str, str]:
    """Provenance of an export: {"checkpoint": name, "checkpoint_path": abs path, "checkpoint_sha256": hex}."""
    ckpt = Path(ckpt).resolve()
    hashed = ckpt / MANIFEST if ckpt.is_dir() else ckpt
    if not hashed.is_file():
        raise CheckpointError(f"{ckpt} has no {MANIFEST}: not a complete checkpoint (an interrupted save?)")
    return {"checkpoint": ckpt.name, "checkpoint_path": str(ckpt), "checkpoint_sha256": sha256_file(hashed)}
