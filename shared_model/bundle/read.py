"""Reading a bundle: `load_bundle` (config, tokenizer, weights in a chosen dtype) and `FolderTensors` (one tensor
at a time).

Contract:
- `load_bundle` reads any Llama/Qwen2/Qwen3 folder in the bundle layout (Tandem's or transformers'
  `save_pretrained`; the manifest is optional) in a chosen dtype. Refused with a one-line `BundleError` naming the
  file and the field or tensor: a missing file, an unknown model_type, an invalid config.json field (e.g.
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
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shared_model.bundle.checks import check_finite, check_tensors, check_tokenizer_fits
from shared_model.bundle.layout import TOKENIZER_FILE, dtype_name, folder_dtype, parse_dtype, read_config, weight_files
from shared_model.bundle.manifest import verify_bundle
from shared_model.config import ModelConfig
from shared_model.errors import BundleError
from shared_model.model import CausalLM
from shared_model.tokenizer import Tokenizer


@dataclass
class Bundle:
    """A loaded model folder."""

    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    dtype: torch.dtype
    path: Path


def read_state_dict(folder: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a folder by name, optionally cast to `dtype`. A NaN/Inf value, stored or produced by the
    cast (a value beyond float16's range), is a BundleError naming the file and the tensor."""
    out: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    t = f.get_tensor(name)
                    check_finite(file, name, t)
                    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                        t = t.to(dtype)
                        check_finite(file, name, t, cast_to=dtype)
                    out[name] = t
        except BundleError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise BundleError(f"cannot read {file}: {exc}") from exc
    return out


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
        check_tensors(config, expected, found)

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
            check_finite(file, name, block)
            dest[start : start + step].copy_(block)
            if block.is_floating_point() and block.dtype != dest.dtype:
                check_finite(file, name, dest[start : start + step], cast_to=dest.dtype)
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
                check_finite(file, name, target)
                if not direct:
                    dest[lo : lo + n].copy_(target)
                    if target.is_floating_point() and dtype != dest.dtype:
                        check_finite(file, name, dest[lo : lo + n], cast_to=dest.dtype)

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
        check_finite(file, name, t)
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
            check_finite(file, name, t, cast_to=dtype)
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
        check_tokenizer_fits(folder, tokenizer, config)
    if dtype is None or dtype == "auto":
        target = folder_dtype(folder) or torch.float32
    else:
        target = parse_dtype(dtype)
    state = read_state_dict(folder, target)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = model.state_dict()
    check_tensors(config, expected, state)
    state = {k: v for k, v in state.items() if k in expected}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if config.tie_word_embeddings:  # assign=True replaced both parameters: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device).eval()
    return Bundle(model=model, config=config, tokenizer=tokenizer, dtype=target, path=folder)
