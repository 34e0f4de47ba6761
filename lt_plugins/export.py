"""Export: consolidate a sharded ZeRO checkpoint (any stage) or a Lightning `.ckpt` into a shared_model bundle.

Other formats for any LightningModule (a safetensors state dict, a Hugging Face folder) live in
`export_state_dict.py` and `export_hf.py`; `export_any.py` picks one. All of them use the target checks here.

Contract:
- `consolidate(ckpt_dir)` verifies the checkpoint's manifest first (a partial or corrupt checkpoint is a
  `CheckpointError`, never a silently wrong model), then merges the shards with DeepSpeed's own
  `get_fp32_state_dict_from_zero_checkpoint` into one fp32 state dict.
- `export_bundle(ckpt_dir, out_dir, dtype)` strips the LightningModule prefix (`model.`), checks every tensor is
  finite, and writes the bundle with `shared_model.bundle.save_bundle` (safetensors, a manifest of checksums,
  atomic rename). The model's `config.json` and tokenizer come from the run's `model_meta/` folder (found next to
  or above the checkpoint, or given explicitly).
- Before reading any shard, `export_bundle` checks the target (`check_export_target`): `out_dir` may not be, contain
  or lie inside what the export reads (the checkpoint, the checkpoints folder holding it, `model_meta/`), nor be or
  contain the run folder or the path given as `ckpt_dir`; paths are compared resolved (symlinks followed). A new
  folder inside the run beside those (the default `<run>/bundle`) is allowed. With `overwrite`, an existing
  `out_dir` must be empty or a Tandem bundle (`shared_model.bundle.check_bundle_target`). Without it, an existing
  `out_dir` is refused with what is in the way and whether `--overwrite` would replace it. Any refusal is a
  one-line `CheckpointError` starting "refusing to ..." and nothing is written or deleted; a target that changes
  while the shards are read is refused the same way (never blamed on the checkpoint).
- Provenance: the bundle's manifest records the checkpoint it came from (`checkpoint_read.checkpoint_source`:
  name, path, SHA-256 of the checkpoint's manifest). `bundle_staleness(bundle, ckpt)` says why a bundle is not
  the export of `ckpt` (missing; from another checkpoint; older than it, for a bundle without provenance; a file
  missing or resized; in another dtype than asked), or None when it is.
- `ExportBundle` is the callback form: when training ends, rank 0 exports the newest checkpoint; all ranks wait.
  `ExportBundle.ensure()` (called by `tandem train` on rank 0 after `fit`) covers a rerun of a finished run, where
  Lightning returns from `fit` without training and the callback never fires: it exports the newest checkpoint
  when the bundle is missing or stale and leaves a current bundle untouched.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lt_plugins.checkpoint_io import MANIFEST, latest_checkpoint, verify_checkpoint
from lt_plugins.checkpoint_read import checkpoint_source, read_lightning_state
from lt_plugins.errors import CheckpointError, TrainingError
from lt_plugins.lit_module import STATE_PREFIX
from shared_model.bundle import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_BYTES,
    MANIFEST_FILE,
    check_bundle_target,
    dtype_name,
    manifest_mismatch,
    parse_dtype,
    read_config,
    read_manifest,
    read_source,
    save_bundle,
)
from shared_model.errors import SharedModelError
from shared_model.tokenizer import Tokenizer

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


def export_bundle(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    dtype: str | torch.dtype = "bfloat16",
    meta_dir: str | Path | None = None,
    prefix: str = STATE_PREFIX,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    merge: bool = False,
) -> Path:
    """Consolidate `ckpt_dir` and write a bundle to `out_dir` atomically; returns the bundle's absolute path. A LoRA
    checkpoint needs `merge` (each adapted weight becomes W + alpha/r·B·A, alpha from the run's model_meta/lora.json);
    without it, it is refused with the two ways out."""
    given, ckpt_dir = ckpt_dir, resolve_checkpoint(ckpt_dir)
    meta = Path(meta_dir) if meta_dir is not None else find_model_meta(ckpt_dir)
    check_export_target(out_dir, ckpt_dir, meta, given)
    check_bundle_out(out_dir, overwrite)
    try:
        config = read_config(meta)
        tokenizer = Tokenizer.load(meta) if (meta / "tokenizer.json").is_file() else None
    except SharedModelError as exc:
        raise CheckpointError(f"cannot read the model description in {meta}: {exc}") from exc
    full = load_module_state(ckpt_dir)  # verifies the checkpoint's manifest first: a partial one is refused here
    source = {"format": "bundle", "dtype": dtype_name(parse_dtype(dtype)), **checkpoint_source(ckpt_dir)}
    state = {k.removeprefix(prefix): v for k, v in full.items() if k.startswith(prefix)}
    if not state:
        raise CheckpointError(
            f"{ckpt_dir} holds no tensor named '{prefix}…' (found e.g. {sorted(full)[:3]}): not Tandem's "
            "LitCausalLM; use --format state-dict, or --format hf for a Hugging Face model inside"
        )
    state = _merged_or_plain(ckpt_dir, meta, state, merge)
    check_finite(ckpt_dir, state)
    try:
        out = save_bundle(out_dir, config, state, tokenizer, dtype, max_shard_bytes, overwrite=overwrite, source=source)
    except SharedModelError as exc:
        check_bundle_out(out_dir, overwrite)  # the target changed while the shards were read: say so, not "mismatch"
        raise CheckpointError(f"{ckpt_dir} does not match the model in {meta}: {exc}") from exc
    return out.resolve()


def _merged_or_plain(ckpt: Path, meta: Path, state: dict[str, torch.Tensor], merge: bool) -> dict[str, torch.Tensor]:
    from lt_plugins.export_lora import read_lora_meta
    from lt_plugins.lora import lora_module_names, merge_state

    adapted = lora_module_names(state)
    if not adapted:
        if merge:
            raise CheckpointError(f"--merge: {ckpt} holds no LoRA adapter (no '<module>.lora_A.weight' key)")
        return state
    if not merge:
        raise CheckpointError(
            f"{ckpt} holds LoRA adapters ({len(adapted)} modules, e.g. {adapted[0]}): pass --merge for a full bundle "
            "(W + alpha/r·B·A), or --format adapter for a PEFT adapter folder"
        )
    cfg = read_lora_meta(meta)["config"]
    return merge_state(state, cfg["alpha"] / cfg["rank"])


def bundle_staleness(bundle: Path, ckpt: Path, dtype: str | None = None) -> str | None:
    """Why `bundle` is not the export of checkpoint `ckpt` ("missing", "exported from step-000002", ...), or None
    when it is (its manifest names `ckpt`'s SHA-256, and `dtype` when given, and its files have their listed
    sizes)."""
    if not bundle.exists() and not bundle.is_symlink():
        return "missing"
    try:
        files, source = read_manifest(bundle), read_source(bundle)
    except SharedModelError as exc:
        return f"its manifest is unreadable ({exc})"
    if files is not None and manifest_mismatch(bundle, files, check_hashes=False) is not None:
        return "a file of it is missing or resized"
    if source is None:  # written before bundles recorded their checkpoint: compare times
        marker = bundle / (MANIFEST_FILE if files is not None else CONFIG_FILE)
        newer = marker.is_file() and marker.stat().st_mtime_ns >= (ckpt / MANIFEST).stat().st_mtime_ns
        return None if newer else f"older than {ckpt.name} and without a record of its checkpoint"
    if source.get("checkpoint_sha256") == checkpoint_source(ckpt)["checkpoint_sha256"]:
        wanted = dtype_name(parse_dtype(dtype)) if dtype is not None else None
        if wanted is not None and source.get("dtype", wanted) != wanted:
            return f"in {source['dtype']}, not the configured {wanted}"
        return None
    return f"exported from {source.get('checkpoint', 'another checkpoint')}, not the newest checkpoint {ckpt.name}"


class ExportBundle(Callback):
    """At the end of training, export the newest checkpoint under `checkpoint_dir` to `out_dir` (rank 0).

    `tandem_model=False` (a `model.class_path` module, not Tandem's LitCausalLM) exports what `tandem export
    --format auto` would for a module of its own: a Hugging Face folder when the checkpoint's hyperparameters hold
    a Hugging Face config, else the consolidated safetensors state dict (`export_any`), never a bundle.
    """

    def __init__(
        self,
        checkpoint_dir: str | Path,
        out_dir: str | Path,
        dtype: str = "bfloat16",
        meta_dir: str | Path | None = None,
        tandem_model: bool = True,
        adapter_dir: str | Path | None = None,
        merged: bool = False,
    ) -> None:
        self.checkpoint_dir, self.out_dir, self.dtype = Path(checkpoint_dir), Path(out_dir), dtype
        self.meta_dir = meta_dir
        self.tandem_model = tandem_model
        self.adapter_dir = Path(adapter_dir) if adapter_dir is not None else None  # a LoRA run: the PEFT folder
        self.merged = merged  # a LoRA run: also the merged bundle at out_dir
        self.bundle_path: Path | None = None
        self.adapter_path: Path | None = None

    def _export(self, ckpt: Path) -> Path:
        from lt_plugins.write_errors import reported_writes

        with reported_writes(self.out_dir, f"cannot export {ckpt.name} to {self.out_dir}, nothing was written"):
            return self._export_unreported(ckpt)

    def _export_unreported(self, ckpt: Path) -> Path:
        if self.adapter_dir is not None:  # LoRA: the adapter folder, and the merged bundle when asked
            from lt_plugins.export_lora import export_adapter

            self.adapter_path = export_adapter(ckpt, self.adapter_dir, self.meta_dir, overwrite=True)
            if not self.merged:
                return self.adapter_path
            return export_bundle(ckpt, self.out_dir, self.dtype, self.meta_dir, overwrite=True, merge=True)
        if self.tandem_model:
            return export_bundle(ckpt, self.out_dir, self.dtype, self.meta_dir, overwrite=True)
        from lt_plugins.export_any import export_checkpoint
        from lt_plugins.export_hf import hyperparameter_hf_config

        fmt = "hf" if hyperparameter_hf_config(ckpt) is not None else "state-dict"
        exported = export_checkpoint(ckpt, self.out_dir, format=fmt, dtype=self.dtype, overwrite=True)
        rank_zero_info(f"{exported.format}: {exported.path} (a model.class_path module: not a Tandem bundle)")
        return exported.path

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.barrier("tandem_export_start")
        error: Any = None
        if trainer.is_global_zero:
            try:
                ckpt = latest_checkpoint(self.checkpoint_dir)
                if ckpt is None:
                    raise CheckpointError(f"no checkpoint under {self.checkpoint_dir} to export")
                self.bundle_path = self._export(ckpt)
            except TrainingError as exc:  # CheckpointError, WriteError (a full disk): every rank passes the barrier
                error = exc
        trainer.strategy.barrier("tandem_export_done")
        if error is not None:
            raise error

    def ensure(self) -> Path | None:
        """On rank 0 after `fit`: the bundle path, (re-)exported from the newest checkpoint when `fit` returned
        without training (a finished run) and the bundle is missing or stale; a current bundle is left untouched."""
        if self.bundle_path is not None:  # exported at the end of this fit
            return self.bundle_path
        ckpt = latest_checkpoint(self.checkpoint_dir)
        if ckpt is None:
            return None  # nothing trained and nothing saved: no bundle to make
        if self.adapter_dir is not None:  # a LoRA run: the adapter folder is small, re-export it
            self.bundle_path = self._export(ckpt)
            return self.bundle_path
        why = bundle_staleness(self.out_dir, ckpt, self.dtype)
        if why is None:
            rank_zero_info(f"bundle {self.out_dir} is the export of {ckpt.name}: left as it is")
            return self.out_dir.resolve()
        rank_zero_info(f"bundle {self.out_dir} is {why}: exporting {ckpt.name}")
        self.bundle_path = self._export(ckpt)
        return self.bundle_path
