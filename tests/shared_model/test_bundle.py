"""Bundle I/O: round trip, sharding, atomic replacement, and every error naming what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared_model.bundle import INDEX_FILE, load_bundle, read_state_dict, save_bundle
from shared_model.errors import BundleError
from shared_model.model import build_model
from tests.conftest import tiny_config


@pytest.fixture
def saved(tmp_path, small_tokenizer):
    cfg = tiny_config(tie_word_embeddings=True)
    model = build_model(cfg, seed=0)
    path = save_bundle(tmp_path / "bundle", cfg, model, small_tokenizer)
    return path, cfg, model


def test_round_trip_files_logits_and_tokenizer(saved):
    path, cfg, model = saved
    names = sorted(p.name for p in path.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tandem_bundle.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    bundle = load_bundle(path)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(bundle.model(ids), model(ids))
    assert bundle.tokenizer is not None and bundle.tokenizer.eos_id == bundle.config.eos_token_ids[0]
    # tied weights are stored once and tied again on load
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    assert bundle.model.lm_head.weight is bundle.model.model.embed_tokens.weight


def test_sharded_with_index(tmp_path):
    cfg = tiny_config()
    model = build_model(cfg)
    path = save_bundle(tmp_path / "b", cfg, model, max_shard_bytes=200_000)
    index = json.loads((path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((path / s).is_file() for s in shards)
    total = sum(t.numel() * t.element_size() for t in read_state_dict(path).values())
    assert index["metadata"]["total_size"] == total
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.equal(load_bundle(path).model(ids), model(ids))


def test_dtype_selectable_on_save(tmp_path):
    cfg = tiny_config()
    path = save_bundle(tmp_path / "b", cfg, build_model(cfg), dtype="bfloat16")
    assert {t.dtype for t in read_state_dict(path).values()} == {torch.bfloat16}
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_bundle(path, dtype="auto").dtype == torch.bfloat16


def test_existing_folder_needs_overwrite_and_failure_keeps_old_bundle(saved):
    path, cfg, model = saved
    before = (path / "model.safetensors").read_bytes()
    with pytest.raises(BundleError, match="already exists"):
        save_bundle(path, cfg, model)
    broken = dict(model.state_dict())
    del broken["model.norm.weight"]
    with pytest.raises(BundleError, match=r"missing tensor\(s\): model.norm.weight"):
        save_bundle(path, cfg, broken, overwrite=True)
    assert (path / "model.safetensors").read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["bundle"], "no temporary folder left behind"
    save_bundle(path, cfg, build_model(cfg, seed=5), overwrite=True)
    assert (path / "model.safetensors").read_bytes() != before


def test_missing_config(tmp_path):
    tmp_path.joinpath("m").mkdir()
    with pytest.raises(BundleError, match=r"missing file: .*config.json"):
        load_bundle(tmp_path / "m")


def test_missing_folder(tmp_path):
    with pytest.raises(BundleError, match="model folder not found"):
        load_bundle(tmp_path / "nope")


def test_unknown_model_type(saved):
    path = saved[0]
    raw = json.loads((path / "config.json").read_text())
    raw["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(BundleError, match="model_type 'gpt2' is not supported"):
        load_bundle(path)


def test_missing_weights_file(saved):
    path = saved[0]
    (path / "model.safetensors").unlink()
    with pytest.raises(BundleError, match=r"missing file: .*model.safetensors"):
        load_bundle(path)


def test_pickle_only_folder_is_refused(saved):
    path = saved[0]
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(BundleError, match="pickle"):
        load_bundle(path)


def test_missing_tensor_is_named(saved):
    path = saved[0]
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(BundleError, match=r"missing tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        load_bundle(path)


def test_misshapen_tensor_names_both_shapes(saved):
    path, cfg, _ = saved
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(7, cfg.hidden_size)
    save_file(tensors, path / "model.safetensors")
    expected = rf"model.layers.0.self_attn.k_proj.weight has shape \(7, 64\), expected \({cfg.kv_size}, 64\)"
    with pytest.raises(BundleError, match=expected):
        load_bundle(path)


def test_unexpected_tensor_is_named(saved):
    path = saved[0]
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(BundleError, match=r"unexpected tensor\(s\) for this config: model.layers.9"):
        load_bundle(path)


def test_corrupt_safetensors(saved):
    path = saved[0]
    (path / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(BundleError, match="cannot read"):
        load_bundle(path)


def test_tokenizer_larger_than_vocab_refused(tmp_path, small_tokenizer):
    cfg = tiny_config(vocab_size=300)
    with pytest.raises(BundleError, match="tokenizer has 512 tokens but the model's vocab_size is 300"):
        save_bundle(tmp_path / "b", cfg, build_model(cfg), small_tokenizer)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_bundle_file_gets_the_umask_mode(tmp_path, small_tokenizer, umask):
    # safetensors writes its weights through a 0600 temporary file; the bundle's files must all read like the
    # config (0644 under umask 022), single-file and sharded alike
    import os

    cfg = tiny_config()
    old = os.umask(umask)
    try:
        one = save_bundle(tmp_path / "one", cfg, build_model(cfg), small_tokenizer)
        sharded = save_bundle(tmp_path / "sharded", cfg, build_model(cfg), small_tokenizer, max_shard_bytes=100_000)
    finally:
        os.umask(old)
    for path in (one, sharded):
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in path.iterdir()}
        assert len(modes) >= 6 and set(modes.values()) == {oct(0o666 & ~umask)}, modes
