"""Fixtures for the engine tests: tiny random llama and qwen3 models saved with transformers' `save_pretrained`,
with the session's small byte-level BPE tokenizer, plus an engine factory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference_svc.engine import Engine, EngineConfig
from shared_model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 512


def _hf_model(model_type: str, seed: int):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if model_type == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0)
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=16, rope_theta=10000.0)
    torch.manual_seed(seed)
    # a larger init than transformers' 0.02 gives peaked logits: fewer near-ties for greedy comparisons
    cfg.initializer_range = 0.2
    cls = transformers.LlamaForCausalLM if model_type == "llama" else transformers.Qwen3ForCausalLM
    return cls(cfg).eval()


def _save(tmp: Path, model_type: str, tokenizer: Tokenizer, seed: int) -> Path:
    model = _hf_model(model_type, seed)
    model.config.eos_token_id = tokenizer.eos_id
    model.config.bos_token_id = tokenizer.bos_id
    model.config.pad_token_id = tokenizer.pad_id
    folder = tmp / model_type
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save(folder)
    return folder


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, small_tokenizer) -> Path:
    return _save(tmp_path_factory.mktemp("engine-models"), "llama", small_tokenizer, seed=1)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory, small_tokenizer) -> Path:
    return _save(tmp_path_factory.mktemp("engine-models"), "qwen3", small_tokenizer, seed=2)


@pytest.fixture(params=["llama", "qwen3"])
def model_dir(request) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture
def make_engine():
    def make(path: Path, **overrides) -> Engine:
        overrides.setdefault("dtype", "float32")
        overrides.setdefault("kv_cache_memory", "8MiB")
        return Engine.from_bundle(path, EngineConfig(**overrides))

    return make
