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
    return _save_model(tmp, model_type, _hf_model(model_type, seed), tokenizer)


def _save_model(tmp: Path, name: str, model, tokenizer: Tokenizer) -> Path:
    model.config.eos_token_id = tokenizer.eos_id
    model.config.bos_token_id = tokenizer.bos_id
    model.config.pad_token_id = tokenizer.pad_id
    folder = tmp / name
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


@pytest.fixture(scope="session")
def trained_dir(tmp_path_factory, small_tokenizer) -> Path:
    """The tiny llama trained for a few seconds on standard-library source: it has learned the corpus's common
    n-grams and, greedy, falls into the loops undertrained models fall into, so prompt lookup has real matches
    (acceptance on random weights means nothing)."""
    from shared_model.corpus import CorpusConfig, load_corpus

    model = _hf_model("llama", seed=3)
    for p in model.parameters():  # a plain small init: trained logits, not the peaked random ones
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else None
    ids: list[int] = []
    for text in load_corpus(CorpusConfig(max_documents=40)).texts():
        ids += small_tokenizer.encode(text)
        if len(ids) >= TRAIN_TOKENS:
            break
    data = torch.tensor(ids[:TRAIN_TOKENS]).view(-1, 64)  # [rows, 64]
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(TRAIN_STEPS):
        batch = data[torch.randint(0, data.shape[0], (8,), generator=gen)]  # [8, 64]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return _save_model(tmp_path_factory.mktemp("engine-models"), "trained", model, small_tokenizer)


TRAIN_STEPS = 40
TRAIN_TOKENS = 64 * 512
