"""Weight bundles: a Hugging Face–compatible folder written and read by Tandem.

Layout: `config.json`, `model.safetensors` (or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`
above `max_shard_bytes`), `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`, and Tandem's
manifest `tandem_bundle.json` (format version; every other file's size and SHA-256). The manifest is also the
marker that says "this folder is a Tandem bundle": only such a folder may be replaced.

Contract:
- `save_bundle` writes into a temporary sibling folder, manifest last, and renames it into place: a reader never
  sees a half bundle, and a failure leaves any previous bundle untouched. safetensors only, never pickle.
- `save_bundle(..., overwrite=True)` (and `check_bundle_target`) replaces only a missing folder, an empty folder,
  or a Tandem bundle (regular files named in its manifest, plus the manifest). Anything else, e.g. a run folder,
  a checkpoint, or a bundle with a foreign file in it, is a `BundleError` naming the folder and the reason, and
  nothing is touched.
- `load_bundle` reads any Llama/Qwen2/Qwen3 folder in that layout (Tandem's or transformers' `save_pretrained`;
  the manifest is optional) in a chosen dtype. Refused with a one-line `BundleError` naming the file and the
  field or tensor: a missing file, an unknown model_type, an invalid config.json field (e.g.
  max_position_embeddings below `shared_model.config.MIN_POSITIONS`), a tokenizer whose ids exceed config.json's
  vocab_size, a missing, unexpected or misshapen tensor (both shapes named), a weight that is not floating point
  (its dtype named), a NaN/Inf weight, a shard index that names a file outside the folder. With
  `verify_checksums=True` every manifest entry is checked (size, SHA-256) and every file the loader reads must be
  listed, by its path (the index's shards are plain names of the folder, so the file verified is the file read);
  a folder without a manifest is then refused (nothing to verify against).
- `FolderTensors(folder)` reads such a folder's weights one tensor at a time (shapes from the headers, no data read
  until `get`; a file is unmapped once all its tensors were read), so a caller can fill a model that is built
  piecewise (e.g. partitioned under ZeRO-3) without ever holding the whole state dict; `check(config)` refuses
  missing, unexpected or misshapen tensors as `load_bundle` does; `get` (one tensor) and `copy_into` (into a
  given tensor, in row blocks, never a full copy) refuse NaN/Inf values naming the file and tensor.
- Every file of a bundle gets the mode open() gives, 0666 minus the umask (0644 under the usual 022), the weights
  too (safetensors itself would leave them 0600).
- `sha256_file` is the one file-hashing helper (lt_plugins' checkpoint manifest uses it too).
- `save_bundle(..., source={...})` records provenance in the manifest (`read_source` reads it back); lt_plugins'
  export stores the checkpoint it came from there, so a finished run can tell a stale bundle from a current one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared_model.config import ModelConfig
from shared_model.errors import BundleError, ConfigError
from shared_model.model import CausalLM
from shared_model.tokenizer import Tokenizer

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
# Tensors some checkpoints carry that are derived, not learned: ignored on load.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


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


@dataclass
class Bundle:
    """A loaded model folder."""

    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    dtype: torch.dtype
    path: Path


# ------------------------------------------------------------------------------------------------ reading
def read_config(folder: str | Path) -> ModelConfig:
    """The ModelConfig of a folder's config.json."""
    folder = Path(folder)
    raw = _read_json(folder / CONFIG_FILE)
    try:
        return ModelConfig.from_hf_dict(raw)
    except ConfigError as exc:
        raise BundleError(f"{folder / CONFIG_FILE}: {exc}") from exc


def folder_dtype(folder: str | Path) -> torch.dtype | None:
    """The dtype a folder's config.json declares (torch_dtype or dtype), if any."""
    raw = _read_json(Path(folder) / CONFIG_FILE)
    name = raw.get("torch_dtype") or raw.get("dtype")
    return DTYPES.get(name) if isinstance(name, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise BundleError(f"missing file: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BundleError(f"{path} must hold a JSON object")
    return data


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a folder, single-file or sharded with an index."""
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        index = _read_json(folder / INDEX_FILE)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise BundleError(f"{folder / INDEX_FILE} has no weight_map")
        for tensor, name in weight_map.items():
            if not _plain_name(name):
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


def _plain_name(name: object) -> bool:
    """A file name of the folder itself: no path, no separator, not '.' or '..'."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def read_state_dict(folder: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a folder by name, optionally cast to `dtype`. A NaN/Inf value, stored or produced by the
    cast (a value beyond float16's range), is a BundleError naming the file and the tensor."""
    out: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    t = f.get_tensor(name)
                    _check_finite(file, name, t)
                    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                        t = t.to(dtype)
                        _check_finite(file, name, t, cast_to=dtype)
                    out[name] = t
        except BundleError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise BundleError(f"cannot read {file}: {exc}") from exc
    return out


def _check_finite(file: Path, name: str, t: torch.Tensor, cast_to: torch.dtype | None = None) -> None:
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return
    if cast_to is None:
        raise BundleError(f"{file}: tensor {name} holds NaN or Inf values")
    raise BundleError(f"{file}: tensor {name} has values outside the range of {dtype_name(cast_to)}")


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class FolderTensors:
    """The safetensors of a model folder, read one tensor at a time (see the module contract). A context manager."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._open: dict[Path, object] = {}
        self.where: dict[str, Path] = {}
        """Tensor name → the file holding it."""
        self._unread: dict[Path, set[str]] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}
        try:
            for file in weight_files(self.folder):
                handle = safe_open(str(file), framework="pt")
                self._open[file] = handle
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    self.where[name] = file
                self._unread[file] = {n for n, f in self.where.items() if f == file}
        except BundleError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise BundleError(f"cannot read the weights of {self.folder}: {exc}") from exc

    def __enter__(self) -> FolderTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._open.clear()

    def shape(self, name: str) -> tuple[int, ...]:
        """Read from the header; only before `get` has finished the tensor's file."""
        return tuple(self._open[self.where[name]].get_slice(name).get_shape())  # type: ignore[attr-defined]

    def check(self, config: ModelConfig, expected: Mapping[str, torch.Tensor] | None = None) -> None:
        """Every tensor a model of `config` needs is here with its shape, and nothing else (BundleError). `expected`
        (name → a tensor of the full shape, e.g. on the meta device) replaces the model built here to learn them."""
        if expected is None:
            with torch.device("meta"):
                expected = CausalLM(config).state_dict()
        found = {name: torch.empty(self.shape(name), device="meta") for name in self.where}
        _check_tensors(config, expected, found)

    def copy_into(self, name: str, dest: torch.Tensor, chunk_bytes: int = 32 * 1024**2) -> None:
        """Copy tensor `name` into `dest` (same shape, any dtype) in row blocks of about `chunk_bytes`, so no full
        copy of it is ever made; NaN/Inf (stored, or from the cast to dest's dtype) is a BundleError."""
        file = self.where[name]
        view = self._open[file].get_slice(name)  # type: ignore[attr-defined]
        shape = tuple(view.get_shape())
        if shape != tuple(dest.shape):
            raise BundleError(f"{file}: tensor {name} has shape {shape}, expected {tuple(dest.shape)}")
        if len(shape) == 0:
            dest.copy_(self.get(name))
            return
        row_bytes = max(1, math.prod(shape[1:]) * dest.element_size())
        step = max(1, chunk_bytes // row_bytes)
        for start in range(0, shape[0], step):
            block = view[start : start + step]
            _check_finite(file, name, block)
            dest[start : start + step].copy_(block)
            if block.is_floating_point() and block.dtype != dest.dtype:
                _check_finite(file, name, dest[start : start + step], cast_to=dest.dtype)
        self._done(file, name)

    def copy_range(self, name: str, dest: torch.Tensor, start: int, chunk_bytes: int = 8 * 1024**2) -> None:
        """Copy the flat elements [start, start + dest.numel()) of tensor `name` (row-major) into the 1-D `dest`
        (any dtype) with positional reads of the file in pieces of about `chunk_bytes`: no memory map, no copy of
        the whole tensor, so a ZeRO-3 rank reads only its own partition. The bytes land in `dest` itself when it is
        a contiguous CPU tensor of the file's dtype, else in one CPU staging buffer of one piece, copied (and cast,
        or moved to `dest`'s device) from there: the only transient memory is that piece. The element type and
        size are the file header's, never taken from an allocation (DeepSpeed's zero.Init with a bf16 config makes
        `torch.empty(dtype=float32)` return bfloat16). NaN/Inf is a BundleError."""
        file = self.where[name]
        dtype, shape, base = self._entry(file, name)
        count = dest.numel()
        if start < 0 or start + count > math.prod(shape):
            where = f"[{start}, {start + count})"
            raise BundleError(f"{file}: tensor {name} of shape {tuple(shape)} has no elements {where}")
        if count == 0:  # a rank whose partition holds none of this tensor (ZeRO-3 padding)
            return
        size = dtype.itemsize  # the file's element size, never an allocation's (see _staging)
        step = max(1, chunk_bytes // size)
        direct = dest.dtype == dtype and dest.is_contiguous() and dest.device.type == "cpu"
        staging = None if direct else _staging(min(step, count), dtype)  # [piece]
        with open(file, "rb") as fh:
            for lo in range(0, count, step):
                n = min(step, count - lo)
                target = dest[lo : lo + n] if direct else staging[:n]  # type: ignore[index]
                got = os.preadv(fh.fileno(), [target.view(torch.uint8).numpy()], base + (start + lo) * size)
                if got != n * size:
                    raise BundleError(f"{file}: tensor {name} is truncated")
                _check_finite(file, name, target)
                if not direct:
                    dest[lo : lo + n].copy_(target)
                    if target.is_floating_point() and dtype != dest.dtype:
                        _check_finite(file, name, dest[lo : lo + n], cast_to=dest.dtype)

    def _entry(self, file: Path, name: str) -> tuple[torch.dtype, list[int], int]:
        """(dtype, shape, absolute byte offset) of a tensor, from the file's safetensors header."""
        header = self._headers.get(file)
        if header is None:
            with open(file, "rb") as fh:
                length = int.from_bytes(fh.read(8), "little")
                header = self._headers[file] = (8 + length, json.loads(fh.read(length)))
        data_start, entries = header
        entry = entries[name]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise BundleError(f"{file}: tensor {name} has dtype {entry['dtype']}, which a partition read does not take")
        return dtype, list(entry["shape"]), data_start + int(entry["data_offsets"][0])

    def _done(self, file: Path, name: str) -> None:
        self._unread[file].discard(name)
        if not self._unread[file]:  # every tensor of this file read: unmap it (its pages leave the resident set)
            self._open.pop(file, None)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor, optionally cast to `dtype`; NaN/Inf (stored or from the cast) is a BundleError."""
        file = self.where[name]
        t = self._open[file].get_tensor(name)  # type: ignore[attr-defined]
        self._done(file, name)
        _check_finite(file, name, t)
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
            _check_finite(file, name, t, cast_to=dtype)
        return t


def _staging(count: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU buffer of `count` elements of `dtype` over fresh bytes. Not `torch.empty`: inside DeepSpeed's
    `zero.Init` with a bf16/fp16 config, torch.empty/zeros/... hand back the configured dtype whatever dtype is
    asked for, and reading fp32 bytes into such a buffer scrambles them. `torch.frombuffer` is not patched."""
    out = torch.frombuffer(bytearray(count * dtype.itemsize), dtype=dtype)  # [count]
    if out.dtype != dtype:  # a library patched this one too: fail loudly, never read with the wrong element size
        raise BundleError(f"cannot allocate a {dtype_name(dtype)} read buffer (got {dtype_name(out.dtype)})")
    return out


def load_bundle(
    folder: str | Path,
    dtype: str | torch.dtype | None = torch.float32,
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
    verify_checksums: bool = False,
) -> Bundle:
    """Load a model folder. dtype None or 'auto' means the folder's own dtype (float32 if it names none).
    `verify_checksums` checks every file against the folder's `tandem_bundle.json` before reading it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BundleError(f"model folder not found: {folder}")
    if verify_checksums:
        verify_bundle(folder)
    config = read_config(folder)
    tokenizer = None
    if load_tokenizer and (folder / TOKENIZER_FILE).is_file():
        tokenizer = Tokenizer.load(folder)
        _check_tokenizer_fits(folder, tokenizer, config)
    if dtype is None or dtype == "auto":
        target = folder_dtype(folder) or torch.float32
    else:
        target = parse_dtype(dtype)
    state = read_state_dict(folder, target)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = model.state_dict()
    _check_tensors(config, expected, state)
    state = {k: v for k, v in state.items() if k in expected}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if config.tie_word_embeddings:  # assign=True replaced both parameters: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device).eval()
    return Bundle(model=model, config=config, tokenizer=tokenizer, dtype=target, path=folder)


def tokenizer_id_bound(tokenizer: Tokenizer) -> int:
    """One more than the largest id the tokenizer can emit (added and special tokens included)."""
    # Tokenizer exposes no id table; its wrapped tokenizers.Tokenizer does (same package). Ids may be sparse.
    vocab = tokenizer._tk.get_vocab(with_added_tokens=True)
    return max(tokenizer.vocab_size, max(vocab.values(), default=-1) + 1)


def _check_tokenizer_fits(folder: Path, tokenizer: Tokenizer, config: ModelConfig) -> None:
    bound = tokenizer_id_bound(tokenizer)
    if bound > config.vocab_size:
        raise BundleError(
            f"{folder / TOKENIZER_FILE}: the tokenizer emits ids up to {bound - 1} ({bound} ids) but "
            f"{CONFIG_FILE}: vocab_size is {config.vocab_size}; every text prompt would hold ids the model has no "
            "embedding for"
        )


# ------------------------------------------------------------------------------------------------ manifest
def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_mismatch(
    root: Path, entries: Mapping[str, Mapping[str, object]], check_hashes: bool = True
) -> tuple[Path, str] | None:
    """The first file (in name order) that differs from its manifest entry `{"bytes", "sha256"}`, with how it
    differs: "missing", "size" or "sha256". None when every listed file matches. Shared by the bundle manifest
    and the checkpoint manifest (each names the problem in its own words)."""
    for name, meta in sorted(entries.items()):
        path = root / name
        if not path.is_file():
            return path, "missing"
        if path.stat().st_size != meta["bytes"]:
            return path, "size"
        if check_hashes and sha256_file(path) != meta["sha256"]:
            return path, "sha256"
    return None


def write_manifest(folder: Path, source: Mapping[str, object] | None = None) -> None:
    """Record every file of a freshly written bundle folder (written last, before the folder is renamed), with
    the optional provenance `source` (JSON values)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    entries = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}
    data: dict[str, object] = {"format": MANIFEST_FORMAT, "files": entries}
    if source is not None:
        data["source"] = dict(source)
    _write_json(folder / MANIFEST_FILE, data)


def read_source(folder: str | Path) -> dict | None:
    """The provenance object of a folder's tandem_bundle.json; None without a manifest or without a source."""
    if read_manifest(folder) is None:  # validates the manifest
        return None
    source = _read_json(Path(folder) / MANIFEST_FILE).get("source")
    return source if isinstance(source, dict) else None


def read_manifest(folder: str | Path) -> dict[str, dict] | None:
    """The `files` table of a folder's tandem_bundle.json, None when it has none; a malformed one is refused."""
    path = Path(folder) / MANIFEST_FILE
    if not path.exists() and not path.is_symlink():
        return None
    data = _read_json(path)
    if data.get("format") != MANIFEST_FORMAT:
        raise BundleError(f"{path}: format is {data.get('format')!r}, this Tandem reads format {MANIFEST_FORMAT}")
    files = data.get("files")
    if not isinstance(files, dict):
        raise BundleError(f"{path}: 'files' must be an object of file name → {{bytes, sha256}}")
    for name, meta in files.items():
        if not _plain_name(name) or name == MANIFEST_FILE:
            raise BundleError(f"{path}: files: {name!r} is not a plain file name of this folder")
        ok = isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and isinstance(meta.get("sha256"), str)
        if not ok:
            raise BundleError(f"{path}: files: {name} must hold an integer 'bytes' and a string 'sha256'")
    return files


def verify_bundle(folder: str | Path) -> None:
    """Check every file against the folder's manifest (size, then SHA-256); every file the loader reads must be
    listed. BundleError naming the file on the first mismatch, or when there is no manifest."""
    folder = Path(folder)
    files = read_manifest(folder)
    if files is None:
        raise BundleError(
            f"{folder / MANIFEST_FILE}: missing, so there is no manifest to verify checksums against "
            "(bundles written by Tandem's save_bundle have one; load without checksum verification otherwise)"
        )
    bad = manifest_mismatch(folder, files)
    if bad is not None:
        path, how = bad
        if how == "missing":
            raise BundleError(f"{path}: listed in {MANIFEST_FILE} but missing")
        if how == "size":
            raise BundleError(
                f"{path}: {path.stat().st_size} bytes, {MANIFEST_FILE} says {files[path.name]['bytes']} "
                "(corrupt or replaced)"
            )
        raise BundleError(f"{path}: SHA-256 does not match {MANIFEST_FILE} (corrupt or altered file)")
    read = [folder / CONFIG_FILE, folder / INDEX_FILE, folder / TOKENIZER_FILE, folder / TOKENIZER_CONFIG_FILE]
    read += weight_files(folder)  # the very paths the loader reads (a shard outside the folder is refused there)
    unlisted = [p for p in read if p.is_file() and (p.parent != folder or p.name not in files)]
    if unlisted:
        raise BundleError(f"{unlisted[0]}: not listed in {MANIFEST_FILE}, so its checksum cannot be verified")


def _check_tensors(
    config: ModelConfig, expected: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor]
) -> None:
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [k for k in expected if k not in found and k not in optional]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise BundleError(f"missing tensor(s): {shown}")
    unexpected = [k for k in found if k not in expected and not k.endswith(_DERIVED_SUFFIXES)]
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else "")
        raise BundleError(f"unexpected tensor(s) for this config: {shown}")
    for name, ref in expected.items():
        if name in found and tuple(found[name].shape) != tuple(ref.shape):
            raise BundleError(
                f"tensor {name} has shape {tuple(found[name].shape)}, expected {tuple(ref.shape)} from config.json"
            )
        if name in found and not found[name].is_floating_point():
            raise BundleError(
                f"tensor {name} has dtype {dtype_name(found[name].dtype)}; model weights are floating point "
                "(float32, float16 or bfloat16)"
            )


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
        _write_json(tmp / CONFIG_FILE, config.to_hf_dict(torch_dtype=dtype_name(first_float)))
        _write_json(tmp / GENERATION_FILE, _generation_config(config))
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
    `compile_cache/` folder; or, for a
    bundle written before manifests existed, config.json and only the other files of a bundle's layout)."""
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
    _check_tensors(config, reference, sd)
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
    _write_json(folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


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


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


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
