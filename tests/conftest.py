"""Shared test helpers: free loopback ports, a small trained tokenizer, tiny random model configs, benchmark scripts
imported as modules."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

# Triton chooses interpreter or compiler once, when it is first imported (Lightning and torch._dynamo import it
# early). Without CUDA the kernels can only run in the interpreter, so decide before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from inference_svc.serve_process import free_port  # the project's one free-port helper (re-exported for tests)
from shared_model.config import ModelConfig
from shared_model.corpus import CorpusConfig, load_corpus
from shared_model.tokenizer import Tokenizer

__all__ = ["free_port", "load_benchmark", "tiny_config"]


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def small_tokenizer() -> Tokenizer:
    """A 512-token byte-level BPE trained on the first 40 standard-library files (a second or two)."""
    corpus = load_corpus(CorpusConfig(max_documents=40))
    return Tokenizer.train(corpus.texts(), vocab_size=512)


def tiny_config(**overrides) -> ModelConfig:
    """A random-init-sized qwen3 config; override any field."""
    base = dict(
        model_type="qwen3",
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        qk_norm=True,
        max_position_embeddings=512,
    )
    base.update(overrides)
    return ModelConfig(**base)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py` as the module `name` (once per session; benchmarks/ is not a package): its directory
    goes on sys.path first, as the scripts import their siblings (cpu_peer, llama_cpp, ...) by name."""
    if name in sys.modules:
        return sys.modules[name]
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
