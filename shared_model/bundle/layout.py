"""The bundle's layout: its file names, the dtype names, and reading a folder's config, dtype and weight files.

Contract:
- A bundle is a Hugging Face–compatible folder: `config.json`, `model.safetensors` (or
  `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` above `max_shard_bytes`), `tokenizer.json`,
  `tokenizer_config.json`, `generation_config.json`, and Tandem's manifest `tandem_bundle.json`.
- `read_config` / `folder_dtype` / `weight_files` read a folder (`BundleError` naming the file and field); the
  index's shards must be plain names of the folder (`plain_name`), never a path outside it.
- `parse_dtype` accepts the names in `DTYPES` (or a torch dtype); `dtype_name` is the name written back.
- `read_json` / `write_json` are the package's one JSON reader (errors name the file) and writer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shared_model.config import ModelConfig
from shared_model.errors import BundleError, ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
MANIFEST_FILE = "tandem_bundle.json"
"""Tandem's bundle manifest and marker: {"format": 1, "files": {name: {"bytes": n, "sha256": hex}}}, plus an
optional "source" object (provenance: which checkpoint the folder was exported from; readers may ignore it)."""
COMPILE_CACHE_FOLDER = "compile_cache"
"""A bundle's compiled decode steps (`tandem warm`, `inference_svc.executor.compile_cache`): not a file of the
manifest, and replaced with the bundle (its entries are keyed by the weights they were compiled for)."""
MANIFEST_FORMAT = 1
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bf16' / 'bfloat16' / torch.bfloat16 → torch.bfloat16; the error lists valid names."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise BundleError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------------ reading
def read_config(folder: str | Path) -> ModelConfig:
    """The ModelConfig of a folder's config.json."""
    folder = Path(folder)
    raw = read_json(folder / CONFIG_FILE)
    try:
        return ModelConfig.from_hf_dict(raw)
    except ConfigError as exc:
        raise BundleError(f"{folder / CONFIG_FILE}: {exc}") from exc


def folder_dtype(folder: str | Path) -> torch.dtype | None:
    """The dtype a folder's config.json declares (torch_dtype or dtype), if any."""
    raw = read_json(Path(folder) / CONFIG_FILE)
    name = raw.get("torch_dtype") or raw.get("dtype")
    return DTYPES.get(name) if isinstance(name, str) else None


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise BundleError(f"missing file: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BundleError(f"{path} must hold a JSON object")
    return data


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a folder, single-file or sharded with an index."""
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        index = read_json(folder / INDEX_FILE)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise BundleError(f"{folder / INDEX_FILE} has no weight_map")
        for tensor, name in weight_map.items():
            if not plain_name(name):
                raise BundleError(
                    f"{folder / INDEX_FILE}: weight_map puts {tensor} in {name!r}, which is not a file of this folder "
                    "(a shard must be named plainly, with no path: nothing outside the folder is read)"
                )
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise BundleError(f"missing file: {f} (listed in {INDEX_FILE})")
        return files
    single = folder / WEIGHTS_FILE
    if single.is_file():
        return [single]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise BundleError(f"{folder} holds only pickle weights (*.bin/*.pt); Tandem loads safetensors only")
    raise BundleError(f"missing file: {single} (and no {INDEX_FILE})")


def plain_name(name: object) -> bool:
    """A file name of the folder itself: no path, no separator, not '.' or '..'."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
