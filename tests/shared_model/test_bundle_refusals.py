"""Bundles that must be refused at load (issue 15, item 4) and the checksum manifest save_bundle writes.

Each defect is built on a tiny random model and must be a one-line BundleError naming the file and the field (or
tensor). Folders without a manifest (plain Hugging Face ones) still load unless verification is asked for.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared_model.bundle import MANIFEST_FILE, load_bundle, save_bundle
from shared_model.config import MIN_POSITIONS
from shared_model.errors import BundleError, ConfigError
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer
from tests.conftest import tiny_config


@pytest.fixture
def bundle(tmp_path: Path, small_tokenizer: Tokenizer) -> Path:
    cfg = tiny_config()
    return save_bundle(tmp_path / "bundle", cfg, build_model(cfg, seed=0), small_tokenizer)


def _refusal(folder: Path, **kwargs: object) -> str:
    with pytest.raises(BundleError) as info:
        load_bundle(folder, **kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message, message
    return message


def _edit_config(folder: Path, **fields: object) -> None:
    raw = json.loads((folder / "config.json").read_text())
    raw.update(fields)
    (folder / "config.json").write_text(json.dumps(raw))


# ------------------------------------------------------------------------------------------------ manifest
def test_save_bundle_writes_a_manifest_of_every_file_that_verifies(bundle: Path) -> None:
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    assert manifest["format"] == 1
    others = sorted(p.name for p in bundle.iterdir() if p.name != MANIFEST_FILE)
    assert sorted(manifest["files"]) == others
    for name, entry in manifest["files"].items():
        data = (bundle / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert load_bundle(bundle, verify_checksums=True).tokenizer is not None


def test_one_flipped_bit_in_the_weights_is_caught_only_with_verify(bundle: Path) -> None:
    weights = bundle / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4] ^= 0x01  # lowest mantissa bit of the last float32: still a finite, readable file
    weights.write_bytes(bytes(data))
    load_bundle(bundle)  # safetensors has no checksum: without verification the flip goes unnoticed
    message = _refusal(bundle, verify_checksums=True)
    assert str(weights) in message and "SHA-256" in message and MANIFEST_FILE in message


def test_a_file_the_manifest_does_not_list_is_refused_with_verify(bundle: Path) -> None:
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    del manifest["files"]["tokenizer.json"]
    (bundle / MANIFEST_FILE).write_text(json.dumps(manifest))
    message = _refusal(bundle, verify_checksums=True)
    assert str(bundle / "tokenizer.json") in message and "not listed" in message


def test_a_folder_without_manifest_loads_but_cannot_be_verified(bundle: Path) -> None:
    (bundle / MANIFEST_FILE).unlink()  # what a Hugging Face save_pretrained folder looks like
    assert load_bundle(bundle).config.vocab_size == 512
    message = _refusal(bundle, verify_checksums=True)
    assert str(bundle / MANIFEST_FILE) in message and "no manifest to verify" in message


# ------------------------------------------------------------------------------------------------ refusals
def test_tokenizer_larger_than_config_vocab_is_refused(tmp_path: Path, bundle: Path) -> None:
    small = tiny_config(vocab_size=256)
    folder = save_bundle(tmp_path / "v256", small, build_model(small, seed=0))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the 512-token tokenizer of another bundle
        shutil.copy(bundle / name, folder / name)
    message = _refusal(folder)
    assert str(folder / "tokenizer.json") in message
    assert "config.json: vocab_size is 256" in message and "511" in message


def test_nan_weight_is_refused_naming_file_and_tensor(bundle: Path) -> None:
    weights = bundle / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    message = _refusal(bundle)
    assert f"{weights}: tensor model.layers.1.mlp.down_proj.weight holds NaN or Inf" in message


def test_inf_weight_is_refused(bundle: Path) -> None:
    weights = bundle / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"][0] = float("-inf")
    save_file(tensors, weights, metadata={"format": "pt"})
    assert "tensor model.norm.weight holds NaN or Inf" in _refusal(bundle, dtype="bfloat16")


def test_weight_beyond_float16_range_is_refused_when_loading_as_float16(bundle: Path) -> None:
    weights = bundle / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.embed_tokens.weight"][7, 0] = 1e6  # finite in float32, inf in float16
    save_file(tensors, weights, metadata={"format": "pt"})
    assert load_bundle(bundle, dtype="float32").model is not None
    message = _refusal(bundle, dtype="float16")
    assert f"{weights}: tensor model.embed_tokens.weight has values outside the range of float16" in message


@pytest.mark.parametrize("positions", [1, MIN_POSITIONS - 1])
def test_tiny_max_position_embeddings_is_refused_naming_config_field(bundle: Path, positions: int) -> None:
    _edit_config(bundle, max_position_embeddings=positions)
    message = _refusal(bundle)
    assert f"{bundle / 'config.json'}: max_position_embeddings must be at least {MIN_POSITIONS}" in message
    assert f"got {positions}" in message


def test_model_config_refuses_tiny_context() -> None:
    with pytest.raises(ConfigError, match=f"max_position_embeddings must be at least {MIN_POSITIONS}"):
        tiny_config(max_position_embeddings=1)
    assert tiny_config(max_position_embeddings=MIN_POSITIONS).max_position_embeddings == MIN_POSITIONS


def test_refused_loads_leave_every_file_in_place(bundle: Path) -> None:
    before = {p.name: p.read_bytes() for p in bundle.iterdir()}
    _edit_config(bundle, max_position_embeddings=1)
    before["config.json"] = (bundle / "config.json").read_bytes()
    _refusal(bundle, verify_checksums=True)  # the edited config.json no longer matches the manifest
    assert {p.name: p.read_bytes() for p in bundle.iterdir()} == before


def test_a_folder_without_a_manifest_is_never_overwritten(bundle: Path, small_tokenizer: Tokenizer) -> None:
    """Only a manifest says which files a bundle owns: a folder without one is refused even when its files look
    like a bundle's (the shim for bundles written before manifests is gone), and nothing in it is touched."""
    (bundle / MANIFEST_FILE).unlink()
    before = {p.name: p.read_bytes() for p in bundle.iterdir()}
    cfg = tiny_config()
    with pytest.raises(BundleError, match="not a Tandem bundle"):
        save_bundle(bundle, cfg, build_model(cfg, seed=1), small_tokenizer, overwrite=True)
    assert {p.name: p.read_bytes() for p in bundle.iterdir()} == before


# ------------------------------------------------------------------------------------------------ issue 34
def test_an_integer_weight_is_refused_naming_tensor_and_dtype(bundle: Path) -> None:
    weights = bundle / "model.safetensors"
    tensors = load_file(weights)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(torch.int64)
    save_file(tensors, weights, metadata={"format": "pt"})
    message = _refusal(bundle)
    assert f"tensor {name} has dtype int64" in message and "floating point" in message


@pytest.fixture
def sharded(tmp_path: Path, small_tokenizer: Tokenizer) -> Path:
    cfg = tiny_config()
    folder = save_bundle(tmp_path / "sharded", cfg, build_model(cfg, seed=0), small_tokenizer, max_shard_bytes=50_000)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.mark.parametrize("where", ["parent", "absolute", "subfolder"])
def test_a_shard_outside_the_folder_is_refused_and_never_verified_by_name(
    sharded: Path, tmp_path: Path, where: str
) -> None:
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    # an altered copy of the shard, outside the folder (or below it), with the same file name: the manifest entry
    # for that name still matches the untouched shard inside the folder
    outside = {"parent": tmp_path / "elsewhere", "absolute": tmp_path / "abs", "subfolder": sharded / "sub"}[where]
    outside.mkdir()
    tensors = load_file(sharded / shard)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 1.0
    save_file(tensors, outside / shard, metadata={"format": "pt"})
    pointer = {"parent": f"../elsewhere/{shard}", "absolute": str(outside / shard), "subfolder": f"sub/{shard}"}[where]
    index["weight_map"] = {k: (pointer if v == shard else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    manifest = json.loads((sharded / MANIFEST_FILE).read_text())  # the manifest rewritten to match the new index
    data = index_path.read_bytes()
    manifest["files"][index_path.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (sharded / MANIFEST_FILE).write_text(json.dumps(manifest))
    for verify in (False, True):
        message = _refusal(sharded, verify_checksums=verify)
        assert "weight_map" in message and "not a file of this folder" in message and repr(pointer) in message
