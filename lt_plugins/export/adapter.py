"""Export a LoRA run's adapter in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

Contract:
- `export_adapter(ckpt_dir, out_dir, meta_dir=None, overwrite=False)` consolidates the checkpoint (any ZeRO stage,
  a run dir: its newest), keeps the adapter tensors and the modules trained in full, and writes a folder that
  `peft.PeftModel.from_pretrained(base, out_dir)` loads onto the Hugging Face base model: keys
  `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` (A [r, in], B [out, r], fp32), full modules as
  `base_model.model.<module>.weight` (PEFT 0.21's spelling); the config holds `r`, `lora_alpha`, `lora_dropout`,
  `target_modules` (the exact module names wrapped), `modules_to_save`, `base_model_name_or_path` (the run's
  `model.init_from`, else the preset name) and `task_type: CAUSAL_LM`. Written into a temporary sibling and renamed
  into place. An existing `out_dir` is refused unless `overwrite` and it is empty or an adapter folder.
- The LoRA settings come from `model_meta/lora.json` (written by `tandem train`); a checkpoint without adapter
  tensors or without that file is a one-line `CheckpointError`.
- The merged bundle is `export.export_bundle(..., merge=True)`: each adapted weight becomes W + alpha/r·B·A.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from lt_plugins.errors import CheckpointError
from lt_plugins.export import checkpoint
from lt_plugins.export.checkpoint import check_export_target, find_model_meta, resolve_checkpoint
from lt_plugins.lit_module import STATE_PREFIX
from lt_plugins.lora import LORA_META, lora_module_names

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def read_lora_meta(meta: Path) -> dict[str, Any]:
    """The run's `model_meta/lora.json`: {"config": LoraConfig fields, "base": str, "full_modules": [...]}."""
    path = meta / LORA_META
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the run was not trained with lora.enabled=true")
    return json.loads(path.read_text())


def peft_config(meta: dict[str, Any], targets: list[str], full_modules: list[str]) -> dict[str, Any]:
    """PEFT's LoraConfig fields for an adapter on `targets` (module names, matched by PEFT exactly)."""
    cfg = meta["config"]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": meta.get("base"),
        "r": cfg["rank"],
        "lora_alpha": cfg["alpha"],
        "lora_dropout": cfg["dropout"],
        "target_modules": sorted(targets),
        "modules_to_save": full_modules or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
    }


def _check_out(out: Path, overwrite: bool) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise CheckpointError(f"refusing to export to {out}: it exists and is not a folder")
    entries = sorted(p.name for p in out.iterdir())
    if not overwrite:
        raise CheckpointError(f"refusing to export to {out}: it already exists; pass --overwrite to replace it")
    if entries and ADAPTER_CONFIG not in entries:
        raise CheckpointError(
            f"refusing to overwrite {out}: it is not an adapter folder (holds {', '.join(entries[:3])})"
        )


def adapter_state(state: dict[str, torch.Tensor], full_modules: list[str]) -> dict[str, torch.Tensor]:
    """PEFT's saved keys from a CausalLM state dict (names without the LightningModule prefix)."""
    out: dict[str, torch.Tensor] = {}
    for name in lora_module_names(state):
        for part in ("lora_A", "lora_B"):
            out[f"{PEFT_PREFIX}{name}.{part}.weight"] = state[f"{name}.{part}.weight"].float().contiguous()
    for name in full_modules:
        out[f"{PEFT_PREFIX}{name}.weight"] = state[f"{name}.weight"].float().contiguous()
    return out


def write_adapter(
    out_dir: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], overwrite: bool
) -> Path:
    """Write the PEFT folder atomically (temporary sibling, then rename); returns its absolute path."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    _check_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out.resolve()


def export_adapter(
    ckpt_dir: str | Path, out_dir: str | Path, meta_dir: str | Path | None = None, overwrite: bool = False
) -> Path:
    """Consolidate `ckpt_dir` and write its adapter as a PEFT folder (see the module contract)."""
    given, ckpt = ckpt_dir, resolve_checkpoint(ckpt_dir)
    meta = Path(meta_dir) if meta_dir is not None else find_model_meta(ckpt)
    check_export_target(out_dir, ckpt, meta, given)
    _check_out(Path(out_dir), overwrite)
    lora = read_lora_meta(meta)
    full = checkpoint.load_module_state(ckpt)
    state = {k.removeprefix(STATE_PREFIX): v for k, v in full.items() if k.startswith(STATE_PREFIX)}
    targets = lora_module_names(state)
    if not targets:
        raise CheckpointError(f"{ckpt} holds no LoRA adapter tensors (no '<module>.lora_A.weight' key)")
    full_modules = list(lora.get("full_modules") or [])
    return write_adapter(
        out_dir, peft_config(lora, targets, full_modules), adapter_state(state, full_modules), overwrite
    )
