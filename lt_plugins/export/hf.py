"""Export a LightningModule that wraps a Hugging Face model as a Hugging Face folder (`save_pretrained` layout).

Contract:
- `export_hf(ckpt, out_dir, hf_config=None, attribute=None, dtype=None, overwrite=False)` reads a ZeroStrategy
  checkpoint directory (any stage; a run dir picks its newest) or a Lightning `.ckpt` file, finds the state of the
  `transformers.PreTrainedModel` the module holds, and writes it with transformers' own `save_pretrained`
  (config.json, generation_config.json, model.safetensors or shards + index), plus tokenizer files found beside
  the config, plus Tandem's manifest (checksums, the checkpoint it came from). The folder loads with
  `transformers.AutoModelForCausalLM.from_pretrained(out)`, and with `shared_model.bundle.load_bundle` when the
  model is a Llama/Qwen2/Qwen3.
- The model's config comes from, in order: `hf_config` (a folder holding config.json, or a config.json file); a
  Hugging Face config saved in the checkpoint's hyperparameters (`self.save_hyperparameters()` with a dict that has
  a "model_type", e.g. `model.config.to_dict()`, or a local folder path holding a config.json); the run's
  `model_meta/config.json`. `find_hf_config` returns None when there is none.
- The module attribute holding the model (`attribute`, e.g. "lm" for `self.lm = AutoModelForCausalLM...`) is found
  by structure when not given: the one key prefix under which the module's keys are exactly the model's keys
  (tied weights may be absent). None or several candidates, a missing or unexpected key is a `CheckpointError`
  naming the keys and the `--hf-attribute` / `--hf-config` fix.
- The target is checked before anything is read; writing is atomic (`publish_folder`). transformers is imported only
  here, and its absence is a one-line `CheckpointError` (`pip install transformers`).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from lt_plugins.checkpoint_read import checkpoint_source, read_hyperparameters
from lt_plugins.errors import CheckpointError
from lt_plugins.export import checkpoint
from lt_plugins.export.checkpoint import (
    check_bundle_out,
    check_export_target,
    check_finite,
    model_meta_or_none,
    resolve_checkpoint,
)
from lt_plugins.export.state_dict import publish_folder, unshared
from shared_model.bundle import DEFAULT_MAX_SHARD_BYTES, parse_dtype
from shared_model.errors import SharedModelError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class HFConfig:
    """A Hugging Face config as a dict, where it came from, and the folder it sits in (for tokenizer files)."""

    def __init__(self, data: dict[str, Any], where: str, folder: Path | None = None) -> None:
        self.data, self.where, self.folder = data, where, folder


def _config_file(path: Path, where: str) -> HFConfig:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"{where}: no config.json at {path}; give a folder holding the model's config.json")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise CheckpointError(f"{file} has no 'model_type': not a Hugging Face config.json")
    return HFConfig(data, str(file), file.parent)


def _configs_in(hparams: Mapping[str, Any], where: str = "hyper_parameters", depth: int = 0) -> list[HFConfig]:
    found: list[HFConfig] = []
    if isinstance(hparams.get("model_type"), str):
        return [HFConfig(dict(hparams), where)]
    for key, value in hparams.items():
        here = f"{where}[{key!r}]"
        if isinstance(value, dict) and depth < 2:
            found += _configs_in(value, here, depth + 1)
        elif isinstance(value, str) and value and (Path(value) / "config.json").is_file():
            found.append(_config_file(Path(value), here))
    return found


def find_hf_config(ckpt: Path, hf_config: str | Path | None = None) -> HFConfig | None:
    """The Hugging Face config for `ckpt` (see the module docstring for the order), or None."""
    if hf_config is not None:
        return _config_file(Path(hf_config), "--hf-config")
    found = _configs_in(read_hyperparameters(ckpt))
    distinct = {json.dumps(c.data, sort_keys=True, default=str): c for c in found}
    if len(distinct) > 1:
        places = ", ".join(c.where for c in distinct.values())
        raise CheckpointError(f"{ckpt}: several Hugging Face configs in its {places}; pass --hf-config DIR")
    if distinct:
        return next(iter(distinct.values()))
    meta = model_meta_or_none(ckpt)
    return _config_file(meta, "model_meta") if meta is not None else None


def hyperparameter_hf_config(ckpt: Path) -> HFConfig | None:
    """A Hugging Face config among the checkpoint's saved hyperparameters only (not the run's model_meta, which
    describes Tandem's preset, not a module of the user's own), or None."""
    found = _configs_in(read_hyperparameters(ckpt))
    return found[0] if found else None


def find_prefix(keys: Iterable[str], expected: set[str], optional: set[str]) -> list[str]:
    """Every key prefix ("" or ending in ".") under which the keys hold all of `expected` (less `optional`)."""
    keys = list(keys)
    required = expected - optional
    candidates = {""} | {k[: i + 1] for k in keys for i, ch in enumerate(k) if ch == "."}
    return sorted(p for p in candidates if required <= {k[len(p) :] for k in keys if k.startswith(p)})


def _build(config: HFConfig) -> Any:
    """An empty (meta-device) AutoModelForCausalLM for the config."""
    try:
        import transformers
    except ModuleNotFoundError as exc:
        raise CheckpointError("--format hf needs the transformers package: pip install transformers") from exc
    data = dict(config.data)
    try:
        hf_config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{config.where}: transformers cannot build a causal LM from it: {exc}") from exc


def _select(state: dict[str, torch.Tensor], model: Any, attribute: str | None, ckpt: Path) -> dict[str, torch.Tensor]:
    """The model's tensors out of the module's state dict, prefix stripped."""
    expected = set(model.state_dict())
    tied = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ())
    kind = type(model).__name__
    if attribute is not None:
        prefix = f"{attribute}." if attribute else ""
    else:
        found = find_prefix(state, expected, tied)
        if len(found) != 1:
            tops = sorted({k.split(".")[0] for k in state})
            what = "no attribute" if not found else f"several attributes ({', '.join(p[:-1] for p in found)})"
            raise CheckpointError(
                f"{ckpt}: {what} of the module holds a whole {kind} (the module's attributes: {', '.join(tops[:8])}); "
                "pass --hf-attribute NAME, or --hf-config DIR if the config is not this model's"
            )
        prefix = found[0]
    sub = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    missing = sorted(expected - tied - set(sub))
    unexpected = sorted(set(sub) - expected)
    if missing or unexpected or not sub:
        if not sub:
            tops = ", ".join(sorted({k.split(".")[0] for k in state})[:8])
            problem = f"no tensor name starts with '{prefix}'; the module's attributes: {tops}"
        elif missing:
            problem = f"it lacks {', '.join(missing[:4])}"
        else:
            problem = f"{kind} has no {', '.join(unexpected[:4])}"
        raise CheckpointError(
            f"{ckpt}: the module's '{prefix}' tensors do not make a {kind} ({problem}); "
            "pass --hf-attribute NAME or --hf-config DIR"
        )
    return sub


def export_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    hf_config: str | Path | None = None,
    attribute: str | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the Hugging Face model inside `ckpt_dir`'s module to `out_dir` atomically; returns its absolute path."""
    given, ckpt = ckpt_dir, resolve_checkpoint(ckpt_dir)
    config_path = Path(hf_config) if hf_config is not None else None
    check_export_target(out_dir, ckpt, config_path, given)
    check_bundle_out(out_dir, overwrite)
    try:
        target = parse_dtype(dtype) if dtype is not None else None
    except SharedModelError as exc:
        raise CheckpointError(str(exc)) from exc
    config = find_hf_config(ckpt, hf_config)
    if config is None:
        raise CheckpointError(
            f"{ckpt} holds no Hugging Face config (none in its hyper_parameters, no model_meta/): pass --hf-config DIR"
        )
    model = _build(config)
    source = {"format": "hf", "config_from": config.where, **checkpoint_source(ckpt)}
    state = checkpoint.load_module_state(ckpt)
    sub = unshared(_select(state, model, attribute, ckpt))
    check_finite(ckpt, sub)
    model.load_state_dict(sub, strict=False, assign=True)
    model.tie_weights()
    if target is not None:
        model = model.to(target)

    def write(tmp: Path) -> None:
        with contextlib.redirect_stderr(io.StringIO()):  # transformers' "Writing model shards" progress bar
            model.save_pretrained(tmp, max_shard_size=max_shard_bytes)
        for name in TOKENIZER_FILES if config.folder is not None else ():
            if (config.folder / name).is_file():
                shutil.copyfile(config.folder / name, tmp / name)

    return publish_folder(Path(out_dir), overwrite, write, source)
