"""Export to a shared_model bundle: a sharded ZeRO checkpoint (any stage) or a Lightning `.ckpt`, consolidated.

The other formats (a safetensors state dict, a Hugging Face folder, a PEFT adapter) are this package's other
modules; `formats` picks one; all of them read through `checkpoint` (the target checks, the consolidation).

Contract:
- `export_bundle(ckpt_dir, out_dir, dtype)` strips the LightningModule prefix (`model.`), checks every tensor is
  finite, and writes the bundle with `shared_model.bundle.save_bundle` (safetensors, a manifest of checksums,
  atomic rename). The model's `config.json` and tokenizer come from the run's `model_meta/` folder (found next to
  or above the checkpoint, or given explicitly).
- Before reading any shard, `export_bundle` checks the target (`checkpoint.check_export_target`). A new folder
  inside the run beside those (the default `<run>/bundle`) is allowed. With `overwrite`, an existing
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

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lt_plugins.checkpoint_io import MANIFEST, latest_checkpoint
from lt_plugins.checkpoint_read import checkpoint_source
from lt_plugins.errors import CheckpointError, TrainingError
from lt_plugins.export import checkpoint
from lt_plugins.export.checkpoint import check_bundle_out, check_export_target, check_finite, find_model_meta
from lt_plugins.lit_module import STATE_PREFIX
from shared_model.bundle import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_BYTES,
    MANIFEST_FILE,
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
    given, ckpt_dir = ckpt_dir, checkpoint.resolve_checkpoint(ckpt_dir)
    meta = Path(meta_dir) if meta_dir is not None else find_model_meta(ckpt_dir)
    check_export_target(out_dir, ckpt_dir, meta, given)
    check_bundle_out(out_dir, overwrite)
    try:
        config = read_config(meta)
        tokenizer = Tokenizer.load(meta) if (meta / "tokenizer.json").is_file() else None
    except SharedModelError as exc:
        raise CheckpointError(f"cannot read the model description in {meta}: {exc}") from exc
    # verifies the checkpoint's manifest first: a partial one is refused here
    full = checkpoint.load_module_state(ckpt_dir)
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
    from lt_plugins.export.adapter import read_lora_meta
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
    a Hugging Face config, else the consolidated safetensors state dict (`export.formats`), never a bundle.
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
            from lt_plugins.export.adapter import export_adapter

            self.adapter_path = export_adapter(ckpt, self.adapter_dir, self.meta_dir, overwrite=True)
            if not self.merged:
                return self.adapter_path
            return export_bundle(ckpt, self.out_dir, self.dtype, self.meta_dir, overwrite=True, merge=True)
        if self.tandem_model:
            return export_bundle(ckpt, self.out_dir, self.dtype, self.meta_dir, overwrite=True)
        from lt_plugins.export.formats import export_checkpoint
        from lt_plugins.export.hf import hyperparameter_hf_config

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
