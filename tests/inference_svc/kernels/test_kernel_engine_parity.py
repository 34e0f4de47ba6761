"""The engine with `attention_backend="triton"` (interpreter on CPU) generates what it does with "torch".

A 2-layer qwen3 model (4 query heads over 2 kv heads, head_dim 64), float32, block size 16, prefill chunks of 24
tokens and prefix caching on: the kernels see chunks with and without cached prefixes, mixed prefill + decode
steps, and decode over several blocks. Greedy tokens must match and their log-probabilities agree to 1e-4, over
the model-dtype cache and over an int8 one (`--kv-cache-dtype int8`). This
is a light stand-in for the engine issue's exactness tests run with the Triton backend (owned by the engine).
Skipped when the engine cannot be imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

engine_mod = pytest.importorskip("inference_svc.engine.engine")

from inference_svc.engine.config import EngineConfig  # noqa: E402
from inference_svc.engine.types import SamplingParams  # noqa: E402
from shared_model.bundle import save_bundle  # noqa: E402
from shared_model.config import get_preset  # noqa: E402
from shared_model.model import build_model  # noqa: E402


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory, small_tokenizer) -> Path:
    config = get_preset("tiny").replace(vocab_size=512, num_layers=2, max_position_embeddings=512)
    model = build_model(config, dtype=torch.float32, seed=0)
    with torch.no_grad():  # larger logits: greedy choices far from ties
        for name, p in model.named_parameters():
            if "embed" in name:
                p.mul_(20.0)
    return save_bundle(tmp_path_factory.mktemp("kernel-engine") / "tiny", config, model, tokenizer=small_tokenizer)


def _generate(bundle: Path, backend: str, device: str, kv_cache_dtype: str = "auto") -> list:
    config = EngineConfig(
        attention_backend=backend, device=device, dtype="float32", block_size=16, prefill_chunk_size=24,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    engine = engine_mod.Engine.from_bundle(bundle, config)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(5, 500, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(5, 500, (n,), generator=g).tolist() for n in (3, 30)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True)
    first = engine.generate(prompts[:1], params)  # fills the prefix cache
    return first + engine.generate(prompts, params)


def test_triton_backend_matches_torch_backend(bundle_dir, device) -> None:
    want = _generate(bundle_dir, "torch", device)
    got = _generate(bundle_dir, "triton", device)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)


def test_triton_backend_matches_torch_backend_over_an_int8_cache(bundle_dir, device) -> None:
    """`--kv-cache-dtype int8`: both backends store the same bytes and scales (test_kernel_kv_dtype.py) and read
    them in fp32, so the greedy tokens match and the log-probabilities agree as closely as over fp32."""
    want = _generate(bundle_dir, "torch", device, "int8")
    got = _generate(bundle_dir, "triton", device, "int8")
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-4)
