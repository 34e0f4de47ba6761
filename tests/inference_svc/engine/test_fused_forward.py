"""The engine's fused forward (merged q/k/v and gate/up, shared q/k norm + RoPE pass) is bit-identical to the
reference decoder in shared_model, for every architecture variant, dtype and step length."""

from __future__ import annotations

import pytest
import torch

from inference_svc.engine.fused_forward import FusedForward
from shared_model.attention import CAUSAL
from shared_model.config import RopeScaling
from shared_model.model import build_model
from tests.conftest import tiny_config

CONFIGS = {
    "qwen3": tiny_config(),
    "llama": tiny_config(model_type="llama", qk_norm=False),
    "qwen2-bias": tiny_config(model_type="qwen2", qk_norm=False, attention_bias=True),
    "llama3-scaled": tiny_config(model_type="llama", qk_norm=False, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)),
    "gqa3-headdim": tiny_config(num_heads=6, num_kv_heads=2, head_dim=24),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_forward_is_bitwise_equal_to_reference(name, dtype):
    cfg = CONFIGS[name]
    fused_model = build_model(cfg, dtype=dtype, seed=0)
    reference = build_model(cfg, dtype=dtype, seed=0)
    fused = FusedForward(fused_model, 512)
    gen = torch.Generator().manual_seed(0)
    for t in (1, 5, 33):
        ids = torch.randint(0, cfg.vocab_size, (t,), generator=gen)
        pos = torch.arange(100, 100 + t)
        with torch.inference_mode():
            got = fused.hidden_states(ids, pos, CAUSAL)
            want = reference.hidden_states(ids[None], pos[None], CAUSAL)[0]
            after = fused_model.hidden_states(ids[None], pos[None], CAUSAL)[0]  # re-pointed params: same values
        assert torch.equal(got, want), f"{name} {dtype} T={t}: max |Δ| {(got.float() - want.float()).abs().max()}"
        assert torch.equal(after, want)
