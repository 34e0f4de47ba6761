"""Logits parity with Hugging Face transformers (fp32, CPU) in both directions, on random tiny configs."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shared_model.bundle import load_bundle, save_bundle  # noqa: E402
from shared_model.config import ModelConfig  # noqa: E402
from shared_model.model import build_model  # noqa: E402

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# (name, config kwargs): GQA ratios 1/2/3, head_dim != hidden/heads, tied/untied, rope_theta, llama3 scaling.
CASES = [
    ("llama-gqa1-untied", "llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    ("llama-gqa2-scaled", "llama", dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)),
    ("llama-gqa3-headdim-tied", "llama", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=24,
                                              tie_word_embeddings=True, rope_theta=1000.0)),
    ("qwen2-gqa2", "qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6)),
    ("qwen2-gqa3", "qwen2", dict(num_attention_heads=6, num_key_value_heads=2)),
    ("qwen3-gqa1-tied", "qwen3", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                                      tie_word_embeddings=True)),
    ("qwen3-gqa3-untied", "qwen3", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                        tie_word_embeddings=False, rope_theta=5e5)),
]  # fmt: skip


def _hf_config(model_type: str, overrides: dict):
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[model_type]
    kwargs = dict(
        vocab_size=300,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    if model_type != "llama":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return cls(**kwargs)


def _randomize_biases_and_norms(model: torch.nn.Module) -> None:
    """transformers initialises biases to 0 and norms to 1: perturb them so the test sees them."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("name,model_type,overrides", CASES, ids=[c[0] for c in CASES])
def test_hf_folder_loads_with_same_logits(tmp_path, name, model_type, overrides):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(model_type, overrides)).eval()
    _randomize_biases_and_norms(hf)
    hf.save_pretrained(tmp_path)

    bundle = load_bundle(tmp_path, dtype=torch.float32)
    assert bundle.config.model_type == model_type
    ids = torch.randint(0, 300, (2, 70))  # 70 > original_max_position_embeddings: rope scaling matters
    with torch.no_grad():
        delta = (hf(ids).logits - bundle.model(ids)).abs().max().item()
    assert delta <= 1e-4, f"{name}: max |Δ logits| = {delta}"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_tandem_bundle_loads_in_transformers(tmp_path, model_type):
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=24,
        intermediate_size=96,
        qk_norm=model_type == "qwen3",
        attention_bias=model_type == "qwen2",
        tie_word_embeddings=model_type != "llama",
    )
    model = build_model(cfg, seed=3)
    _randomize_biases_and_norms(model)
    save_bundle(tmp_path / "b", cfg, model)

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        delta = (hf(ids).logits - model(ids)).abs().max().item()
    assert delta <= 1e-4


def test_load_in_bfloat16_matches_within_bf16_error(tmp_path):
    cfg = ModelConfig(
        vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=96, qk_norm=True,
    )  # fmt: skip
    model = build_model(cfg, seed=0)
    save_bundle(tmp_path / "b", cfg, model)
    bundle = load_bundle(tmp_path / "b", dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in bundle.model.parameters())
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        ref = model(ids)
        got = bundle.model(ids).float()
    assert (ref - got).abs().max().item() < 0.05 * ref.abs().max().item() + 0.05
