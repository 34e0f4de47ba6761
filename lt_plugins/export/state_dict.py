"""Export any LightningModule checkpoint as one consolidated safetensors state dict.

Contract:
- `export_state_dict(ckpt, out_dir, dtype=None, max_shard_bytes=2 GiB, overwrite=False)` reads a ZeroStrategy
  checkpoint directory (any ZeRO stage, merged by DeepSpeed's zero_to_fp32; a run dir picks its newest) or a plain
  Lightning `.ckpt` file, and writes the module's full state dict under the module's own names (the keys of
  `module.state_dict()`, e.g. `encoder.layers.0.linear1.weight`): `model.safetensors`, or, when the tensors exceed
  `max_shard_bytes`, `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` (Hugging Face's layout:
  {"metadata": {"total_size": bytes}, "weight_map": {name: file}}). Tandem's manifest `tandem_bundle.json` lists
  every file's size and SHA-256 and the checkpoint the folder came from.
- dtype None keeps the checkpoint's dtypes (fp32 for ZeRO shards); a dtype casts floating tensors only. A NaN/Inf
  tensor is a `CheckpointError` naming it. Tensors sharing storage (tied weights, views of one flat buffer) are
  written once per name, as copies: safetensors refuses shared storage.
- The target is checked before anything is read (`check_export_target`, `check_bundle_out`: an existing folder is
  refused unless `overwrite` and it is empty or a folder Tandem wrote). `publish_folder` writes into a temporary
  sibling folder, manifest last, and renames it into place: a failure removes it and leaves the target as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from lt_plugins.checkpoint_read import checkpoint_source
from lt_plugins.errors import CheckpointError
from lt_plugins.export import checkpoint
from lt_plugins.export.checkpoint import check_bundle_out, check_export_target, check_finite, resolve_checkpoint
from shared_model.bundle import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    WEIGHTS_FILE,
    dtype_name,
    parse_dtype,
    plan_shards,
    replace_dir,
    write_manifest,
)
from shared_model.errors import SharedModelError


def export_state_dict(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Consolidate `ckpt_dir` and write its state dict to `out_dir` atomically; returns the folder's absolute path."""
    given, ckpt = ckpt_dir, resolve_checkpoint(ckpt_dir)
    check_export_target(out_dir, ckpt, None, given)
    check_bundle_out(out_dir, overwrite)
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    try:
        target = parse_dtype(dtype) if dtype is not None else None
    except SharedModelError as exc:
        raise CheckpointError(str(exc)) from exc
    source = {"format": "state-dict", **checkpoint_source(ckpt)}
    state = checkpoint.load_module_state(ckpt)
    check_finite(ckpt, state)
    tensors = unshared(state, target)
    return publish_folder(Path(out_dir), overwrite, lambda tmp: save_sharded(tmp, tensors, max_shard_bytes), source)


def unshared(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors (floating ones cast to `dtype`; a value the cast turns into Inf is a CheckpointError),
    no two sharing storage."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        t = tensor.detach().to(device="cpu", dtype=dtype if tensor.is_floating_point() else None).contiguous()
        if t.dtype != tensor.dtype and not torch.isfinite(t).all():
            raise CheckpointError(f"tensor {name} has values outside the range of {dtype_name(t.dtype)}")
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a tied weight or a view into a larger buffer: its own storage
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def save_sharded(folder: Path, tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """Write `tensors` as one safetensors file, or shards of at most `max_shard_bytes` (a tensor larger than that
    gets a shard of its own) plus the index. Returns the file names written."""
    shards = plan_shards(tensors, max_shard_bytes)
    mode = _open_mode(folder)
    n = len(shards)
    names = [WEIGHTS_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        os.chmod(folder / name, mode)  # safetensors leaves 0600; every other file gets open()'s mode
    if n > 1:
        weight_map = {tensor: file for file, shard in zip(names, shards, strict=True) for tensor in shard}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append(INDEX_FILE)
    return names


def _open_mode(folder: Path) -> int:
    """The mode open() gives a new file here (0666 minus the umask), read from a probe file."""
    probe = folder / f".mode-{uuid.uuid4().hex[:8]}"
    probe.touch()
    mode = stat.S_IMODE(probe.stat().st_mode)
    probe.unlink()
    return mode


def publish_folder(
    out_dir: Path, overwrite: bool, write: Callable[[Path], object], source: Mapping[str, object]
) -> Path:
    """Run `write(tmp)` in a temporary sibling of `out_dir`, add the manifest, and rename it into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        write_manifest(tmp, source)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        check_bundle_out(out_dir, overwrite)  # again: the target may have changed while the tensors were written
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir.resolve()
