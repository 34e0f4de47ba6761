"""Writing a bundle: `save_bundle` (atomic: a temporary sibling folder renamed into place) and the checks of where
it may go.

Contract:
- `save_bundle` writes into a temporary sibling folder, manifest last, and renames it into place: a reader never
  sees a half bundle, and a failure leaves any previous bundle untouched. safetensors only, never pickle; weights
  above `max_shard_bytes` are split into shards with an index (`plan_shards`).
- `save_bundle(..., overwrite=True)` (and `check_bundle_target`) replaces only a missing folder, an empty folder,
  or a Tandem bundle (regular files named in its manifest, plus the manifest). Anything else, e.g. a run folder,
  a checkpoint, or a bundle with a foreign file in it, is a `BundleError` naming the folder and the reason, and
  nothing is touched.
- Every file of a bundle gets the mode open() gives, 0666 minus the umask (0644 under the usual 022), the weights
  too (safetensors itself would leave them 0600).
- `save_bundle(..., source={...})` records provenance in the manifest (`manifest.read_source` reads it back).
- `replace_dir` is the one atomic folder swap (lt_plugins' export uses it too).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared_model.bundle.checks import check_tensors, tokenizer_id_bound
from shared_model.bundle.layout import (
    COMPILE_CACHE_FOLDER,
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_BYTES,
    GENERATION_FILE,
    INDEX_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    dtype_name,
    parse_dtype,
    write_json,
)
from shared_model.bundle.manifest import read_manifest, write_manifest
from shared_model.config import ModelConfig
from shared_model.errors import BundleError
from shared_model.model import CausalLM
from shared_model.tokenizer import Tokenizer


# ------------------------------------------------------------------------------------------------ writing
def save_bundle(
    out_dir: str | Path,
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor] | CausalLM,
    tokenizer: Tokenizer | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    source: Mapping[str, object] | None = None,
) -> Path:
    """Write a bundle atomically and return its path. `state_dict` may be a model; dtype None keeps each
    tensor's own dtype (the config records the dtype of the first floating tensor). `overwrite` replaces an
    existing `out_dir` only if it is empty or a Tandem bundle (see `check_bundle_target`). `source` is recorded
    in the manifest as provenance."""
    out_dir = Path(out_dir)
    check_bundle_target(out_dir, overwrite)
    if tokenizer is not None and tokenizer_id_bound(tokenizer) > config.vocab_size:
        raise BundleError(
            f"tokenizer has {tokenizer_id_bound(tokenizer)} tokens but the model's vocab_size is {config.vocab_size}"
        )
    sd = state_dict.state_dict() if isinstance(state_dict, CausalLM) else dict(state_dict)
    if tokenizer is not None:
        config = _with_tokenizer_ids(config, tokenizer)
    tensors = _tensors_to_write(config, sd, None if dtype is None else parse_dtype(dtype))
    first_float = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_weights(tmp, tensors, max_shard_bytes)
        write_json(tmp / CONFIG_FILE, config.to_hf_dict(torch_dtype=dtype_name(first_float)))
        write_json(tmp / GENERATION_FILE, _generation_config(config))
        if tokenizer is not None:
            tokenizer.save(tmp)
        write_manifest(tmp, source)
        _fsync_dir(tmp)
        check_bundle_target(out_dir, overwrite)  # again: the folder may have changed while the weights were written
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def check_bundle_target(out_dir: str | Path, overwrite: bool = False) -> None:
    """Raise BundleError unless `out_dir` may receive a bundle: it does not exist, or (with `overwrite`) it is an
    empty folder or a Tandem bundle (regular files named in its tandem_bundle.json, that manifest and a
    `compile_cache/` folder; or, for a bundle written before manifests existed, config.json and only the other
    files of a bundle's layout)."""
    out_dir = Path(out_dir)
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not overwrite:
        raise BundleError(f"{out_dir} already exists (pass overwrite=True to replace it)")
    refuse = f"refusing to overwrite {out_dir}:"
    if out_dir.is_symlink():
        raise BundleError(f"{refuse} it is a symbolic link (give the folder it points to)")
    if not out_dir.is_dir():
        raise BundleError(f"{refuse} it is a file, not a bundle folder")
    entries = sorted(out_dir.iterdir())
    if not entries:
        return
    if not (out_dir / MANIFEST_FILE).is_file() or (out_dir / MANIFEST_FILE).is_symlink():
        shown = ", ".join(p.name for p in entries[:3]) + (", …" if len(entries) > 3 else "")
        raise BundleError(f"{refuse} it is not empty and not a Tandem bundle (no {MANIFEST_FILE}; holds {shown})")
    try:
        listed = set(read_manifest(out_dir) or {})
    except BundleError as exc:
        raise BundleError(f"{refuse} its {MANIFEST_FILE} is unreadable ({exc})") from None
    for entry in entries:
        if entry.name == MANIFEST_FILE or (entry.name == COMPILE_CACHE_FOLDER and entry.is_dir()
                                           and not entry.is_symlink()):  # fmt: skip
            continue
        if entry.name not in listed:
            raise BundleError(f"{refuse} {entry.name} is not a file of the bundle (not in its {MANIFEST_FILE})")
        if entry.is_symlink() or not entry.is_file():
            raise BundleError(f"{refuse} {entry.name} is not a regular file")


def _tensors_to_write(
    config: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        reference = CausalLM(config).state_dict()
    check_tensors(config, reference, sd)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in reference:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: stored once, as transformers does
        t = sd[name].detach().to(device="cpu", dtype=dtype if sd[name].is_floating_point() else None)
        t = t.contiguous()
        if t.data_ptr() in seen:  # safetensors refuses tensors that share memory
            t = t.clone()
        seen.add(t.data_ptr())
        out[name] = t
    return out


def plan_shards(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors grouped in order into shards of at most `max_shard_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _write_weights(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    shards = plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        _save_safetensors(shards[0], folder / WEIGHTS_FILE)
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_safetensors(shard, folder / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors writes a private temporary file (mode 0600) and renames it into place: give the weights the mode
    every other file of the bundle gets from open(), 0666 minus the umask (0644 under the usual 022)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux: /proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _with_tokenizer_ids(config: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    """Fill the config's bos/eos/pad ids from the tokenizer where the config has none."""
    return config.replace(
        bos_token_id=config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_id,
        eos_token_ids=config.eos_token_ids or ((tokenizer.eos_id,) if tokenizer.eos_id is not None else ()),
        pad_token_id=config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_id,
    )


def _generation_config(config: ModelConfig) -> dict:
    eos = list(config.eos_token_ids)
    return {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": config.pad_token_id,
        "do_sample": False,
    }


def _fsync_dir(folder: Path) -> None:
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def replace_dir(src: Path, dst: Path) -> None:
    """Rename src onto dst; an existing dst is moved aside first and removed only after the swap."""
    if not dst.exists():
        os.rename(src, dst)
        return
    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(dst, old)
    try:
        os.rename(src, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)
