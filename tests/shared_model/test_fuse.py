"""Merged projections (`shared_model.serving_model`) leave the decoder's output bit-identical, for every architecture
variant, dtype and step length, and leave the state dict (names and values) as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tandem_native
from shared_model.attention import CAUSAL
from shared_model.config import RopeScaling
from shared_model.model import build_model
from shared_model.serving_model import ROW_KERNEL_MAX_ROWS, ServingLinear, fuse_projections, set_row_kernels
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
def test_merged_projections_are_bitwise_equal_to_the_plain_decoder(name: str, dtype: torch.dtype) -> None:
    cfg = CONFIGS[name]
    fused = fuse_projections(build_model(cfg, dtype=dtype, seed=0))
    reference = build_model(cfg, dtype=dtype, seed=0)
    gen = torch.Generator().manual_seed(0)
    for b, t in ((1, 1), (2, 1), (2, 5), (2, 33)):  # (1, 1): a batch-1 decode step, the GEMV path in bf16
        ids = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
        pos = torch.arange(100, 100 + t).expand(b, t)
        with torch.inference_mode():
            got = fused(ids, pos, CAUSAL)
            want = reference(ids, pos, CAUSAL)
        assert torch.equal(got, want), f"{name} {dtype} {b}x{t}: max |Δ| {(got.float() - want.float()).abs().max()}"


@pytest.mark.parametrize("shape", [(1280, 768), (768, 768), (4096, 768), (768, 2048), (8192, 768), (151, 96)])
def test_serving_linear_gemv_returns_the_bits_of_f_linear(shape: tuple[int, int]) -> None:
    """The batch-1 bf16 GEMV (`torch.mv`) against `F.linear` at decode shapes of real models (and an odd one)."""
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(shape[1], shape[0], bias=False).to(torch.bfloat16)
    serving = ServingLinear.sharing(linear)
    assert serving.weight is linear.weight
    for x in (torch.randn(1, 1, shape[1], generator=gen), torch.randn(3, shape[1], generator=gen)):
        with torch.inference_mode():
            got, want = serving(x.bfloat16()), torch.nn.functional.linear(x.bfloat16(), linear.weight)
        assert got.shape == want.shape and torch.equal(got, want)


def test_state_dict_keeps_its_names_and_values_and_shares_the_merged_memory() -> None:
    cfg = tiny_config()
    model = build_model(cfg, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    decoder = fuse_projections(model)
    assert fuse_projections(decoder) is decoder  # idempotent
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    attn, mlp, layer = model.model.layers[0].self_attn, model.model.layers[0].mlp, decoder.layers[0]
    assert attn.k_proj.weight.data_ptr() == layer.qkv.weight[cfg.q_size :].data_ptr()  # a view, not a copy
    assert mlp.up_proj.weight.data_ptr() == layer.gate_up.weight[cfg.intermediate_size :].data_ptr()
    assert not any(p.requires_grad for p in (attn.q_proj.weight, attn.v_proj.weight, mlp.gate_proj.weight))
    # the rest is the training model's own Parameters, not copies
    assert (
        decoder.embed_tokens.weight is model.model.embed_tokens.weight
        and decoder.lm_head.weight is model.lm_head.weight
    )
    assert layer.input_norm is model.model.layers[0].input_layernorm.weight


@pytest.mark.skipif(not tandem_native.available(), reason="needs AVX-512 VNNI and a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_kernels_are_the_compiled_steps_choice_and_give_each_row_the_same_bits_at_any_row_count(
    dtype: torch.dtype,
) -> None:
    model = fuse_projections(build_model(tiny_config(), dtype=dtype, seed=0))
    assert set_row_kernels(model, True) == 4 * model.config.num_layers + 1  # qkv, o, gate/up, down; the LM head
    head = model.lm_head
    assert head.row_kernel
    with torch.inference_mode():  # serving: no autograd through the kernel
        x = torch.randn(ROW_KERNEL_MAX_ROWS + 1, model.config.hidden_size, dtype=dtype)
        batch = head(x[:ROW_KERNEL_MAX_ROWS]).float()  # [17, vocab]: one kernel call
        exact = x[:ROW_KERNEL_MAX_ROWS].double() @ head.weight.double().t()
        bound = (2**-7 if dtype == torch.bfloat16 else 1e-5) * exact.abs().max().item()  # fp32 sums, one rounding
        assert (batch - exact).abs().max().item() <= bound
        for m in (0, 5, ROW_KERNEL_MAX_ROWS - 1):  # a decode step's row alone, a verify step's 5 rows
            assert torch.equal(head(x[m : m + 1]).float(), batch[m : m + 1])
            assert torch.equal(head(x[m : m + 5]).float()[0], batch[m])
        assert torch.equal(head(x[None, 3:8]).float()[0], batch[3:8])  # [B, T, hidden] inputs too
        past = head(x)  # one row more: F.linear
        assert torch.equal(past, F.linear(x, head.weight))
        compiled = torch.compile(head, fullgraph=True)  # the custom op does not break the graph
        assert torch.equal(compiled(x[:1]), head(x[:1]))
        assert set_row_kernels(model, False) == 0 and not head.row_kernel
        assert torch.equal(head(x[:1]), F.linear(x[:1], head.weight))  # the eager path's bit-equality is back
