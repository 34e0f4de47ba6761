"""Which export a checkpoint gets, and why: what `tandem export CKPT OUT --format auto|bundle|state-dict|hf` runs.

Contract:
- Formats: `bundle` (Tandem's LitCausalLM → shared_model bundle, `export.export_bundle`), `state-dict` (any
  LightningModule → its consolidated safetensors state dict, `export_state_dict`), `hf` (a module holding a
  `transformers.PreTrainedModel` → a `save_pretrained` folder, `export_hf`).
- `auto` picks `bundle` when the run's `model_meta/config.json` exists (or `--model-meta` is given); else `hf` when
  `--hf-config` / `--hf-attribute` is given or the checkpoint's hyperparameters hold a Hugging Face config; else
  `state-dict`. `Exported.reason` says which, in one line, with the option that picks another.
- The target is checked before the choice reads anything (`check_export_target`, `check_bundle_out`, and
  `write_errors.check_writable`: a path through a file, a read-only file system or a folder without write
  permission is refused before the checkpoint is read). A write that fails (a full disk, a file size limit) is one
  `WriteError` line naming the reason and the folder; the formats write into a temporary sibling that is removed,
  so nothing is left half-written and an earlier export stays as it was.
- `adapter` (a LoRA run → PEFT adapter folder, `export_lora.export_adapter`); `merge=True` makes `bundle` write
  W + alpha/r·B·A. `auto` on a LoRA run (its model_meta/ holds lora.json) picks `adapter`, or `bundle` with merge.
- dtype None means each format's default: bfloat16 for a bundle, the checkpoint's own dtypes otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lt_plugins.errors import CheckpointError
from lt_plugins.export.adapter import export_adapter
from lt_plugins.export.bundle import export_bundle
from lt_plugins.export.checkpoint import (
    META_DIR,
    check_bundle_out,
    check_export_target,
    model_meta_or_none,
    resolve_checkpoint,
)
from lt_plugins.export.hf import export_hf, find_hf_config
from lt_plugins.export.state_dict import export_state_dict
from lt_plugins.lora import LORA_META
from lt_plugins.write_errors import check_writable, reported_writes
from shared_model.bundle import DEFAULT_MAX_SHARD_BYTES


@dataclass(frozen=True)
class Exported:
    """What an export wrote."""

    format: str
    """bundle, state-dict or hf"""
    path: Path
    """absolute path of the folder written"""
    reason: str
    """why this format (for auto: what was found), one line"""


def choose_format(
    ckpt: Path,
    requested: str,
    model_meta: str | Path | None,
    hf_config: str | Path | None,
    hf_attribute: str | None,
    merge: bool = False,
) -> tuple[str, str]:
    """(format, reason) for a resolved checkpoint; see the module docstring."""
    if requested != "auto":
        return requested, f"--format {requested}"
    meta = Path(model_meta) if model_meta is not None else model_meta_or_none(ckpt)
    if meta is not None and (meta / LORA_META).is_file() and not merge:
        return "adapter", f"format auto → adapter: a LoRA run ({meta / LORA_META}); --merge writes a full bundle"
    if meta is not None:
        return "bundle", f"format auto → bundle: Tandem model description in {meta}"
    if hf_config is not None or hf_attribute is not None:
        return "hf", "format auto → hf: --hf-config/--hf-attribute given"
    found = find_hf_config(ckpt)
    if found is not None:
        return "hf", f"format auto → hf: a Hugging Face config in the checkpoint's {found.where}"
    return "state-dict", (
        f"format auto → state-dict: no {META_DIR}/config.json and no Hugging Face config in the checkpoint's "
        "hyperparameters (--format hf --hf-config DIR writes a Hugging Face folder)"
    )


def export_checkpoint(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    format: str = "auto",
    dtype: str | None = None,
    model_meta: str | Path | None = None,
    hf_config: str | Path | None = None,
    hf_attribute: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    merge: bool = False,
) -> Exported:
    """Export a checkpoint (directory, run dir or `.ckpt` file) in the chosen format."""
    ckpt = resolve_checkpoint(ckpt_dir)
    check_export_target(out_dir, ckpt, None, ckpt_dir)  # the format's own checks follow; nothing read before them
    check_bundle_out(out_dir, overwrite)
    check_writable(out_dir, f"refusing to export to {out_dir}")
    chosen, reason = choose_format(ckpt, format, model_meta, hf_config, hf_attribute, merge)
    if merge and chosen != "bundle":
        raise CheckpointError(f"--merge writes a bundle; it cannot be combined with --format {chosen}")
    with reported_writes(out_dir, f"cannot export to {out_dir}, nothing was written"):
        if chosen == "bundle":
            path = export_bundle(
                ckpt_dir,
                out_dir,
                dtype or "bfloat16",
                model_meta,
                overwrite=overwrite,
                max_shard_bytes=max_shard_bytes,
                merge=merge,
            )
        elif chosen == "adapter":
            path = export_adapter(ckpt_dir, out_dir, model_meta, overwrite)
        elif chosen == "state-dict":
            path = export_state_dict(ckpt_dir, out_dir, dtype, max_shard_bytes, overwrite)
        else:
            path = export_hf(ckpt_dir, out_dir, hf_config, hf_attribute, dtype, overwrite, max_shard_bytes)
    return Exported(chosen, path, reason)
