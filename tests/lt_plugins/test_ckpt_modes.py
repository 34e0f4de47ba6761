"""Checkpointing modes: same losses and gradients as no checkpointing, measured saved bytes, recomputed FLOPs.

Saved bytes are counted with saved_tensors_hooks (SavedActivationMeter) and must equal the per-op formula of
memory_model exactly; a reference that tracks every storage the forward allocates and is still alive confirms the
meter. Recompute is counted with torch.utils.flop_counter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import set_checkpoint_early_stop

from lt_plugins.activation_meter import SavedActivationMeter, flop_counter
from lt_plugins.checkpointing import CheckpointingConfig, apply_checkpointing
from lt_plugins.memory_model import head_saved_bytes_per_token, layer_saved_bytes_per_token
from shared_model.config import get_preset
from shared_model.model import build_model
from tests.conftest import tiny_config

MODES = ("none", "full", "attention", "ops")
B, T = 2, 32


def _batch(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T + 1), generator=torch.Generator().manual_seed(seed))


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def _model(config, mode: str, dtype: torch.dtype = torch.float32, **kw) -> torch.nn.Module:
    model = build_model(config, dtype=dtype, seed=0)
    apply_checkpointing(model, CheckpointingConfig(mode=mode, **kw))
    return model


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    with SavedActivationMeter(exclude=model.parameters()) as meter:
        _loss(model, ids)
    return meter.bytes


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize(("mode", "every_n"), [("full", 1), ("full", 2), ("attention", 1), ("ops", 1), ("ops", 3)])
def test_losses_and_gradients_match_no_checkpointing(mode: str, every_n: int) -> None:
    config = tiny_config(num_layers=4)
    ids = _batch(config.vocab_size)
    ref = _model(config, "none")
    ref_loss = _loss(ref, ids)
    ref_loss.backward()
    model = _model(config, mode, every_n=every_n)
    loss = _loss(model, ids)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=f"gradient of {name}")


def test_bf16_parity_and_no_grad_path_is_plain() -> None:
    config = tiny_config()
    ids = _batch(config.vocab_size, seed=1)
    losses = {}
    for mode in MODES:
        model = _model(config, mode, dtype=torch.bfloat16)
        losses[mode] = _loss(model, ids)
        losses[mode].backward()
        with torch.no_grad(), SavedActivationMeter() as meter:
            _loss(model, ids)
        assert meter.bytes == 0
    for mode in MODES[1:]:
        torch.testing.assert_close(losses[mode], losses["none"], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- bytes
TINY_FP32 = {"none": 5168, "full": 256, "attention": 5152, "ops": 2576}
"""Measured bytes per token per layer of `tiny_config()` in fp32 (hidden 64, 4 heads of 16, 2 kv heads, mlp 128)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_per_layer_match_the_formula(dtype: torch.dtype) -> None:
    b = torch.finfo(dtype).bits // 8
    measured = {}
    for mode in MODES:
        one = _saved_bytes(_model(tiny_config(num_layers=1), mode, dtype), _batch(512))
        two = _saved_bytes(_model(tiny_config(num_layers=2), mode, dtype), _batch(512))
        measured[mode] = (two - one) / (B * T)
        head = one - (two - one)
        assert measured[mode] == layer_saved_bytes_per_token(tiny_config(), mode, b), mode
        assert head / (B * T) == pytest.approx(head_saved_bytes_per_token(tiny_config(), b), abs=1.0)
    if dtype == torch.float32:
        assert measured == TINY_FP32
    # Theory's order where the fused kernel keeps no score matrix: none > ops > full; attention only drops the
    # log-sum-exp (the kernel saves no T×T scores, the output stays saved by o_proj).
    assert measured["none"] > measured["ops"] > measured["full"]
    assert measured["none"] - measured["attention"] == 4 * tiny_config().num_heads
    assert measured["ops"] <= 0.5 * measured["none"]


def test_attention_mode_removes_the_score_matrices_without_a_fused_kernel() -> None:
    """Megatron's setting: attention materialises scores and probabilities ([B, H, T, T] each) for backward."""
    config = tiny_config(num_layers=1)
    with sdpa_kernel(SDPBackend.MATH):
        none = _saved_bytes(_model(config, "none"), _batch(512))
        attention = _saved_bytes(_model(config, "attention"), _batch(512))
        ops = _saved_bytes(_model(config, "ops"), _batch(512))
    scores = B * config.num_heads * T * T * 4
    assert none - attention >= scores  # the [B, H, T, T] probabilities (and the scaled q) are no longer saved
    assert ops < attention


@pytest.mark.parametrize("mode", MODES)
def test_small_preset_layer_bytes_match_the_formula(mode: str) -> None:
    config = dataclasses.replace(get_preset("small"), num_layers=1, vocab_size=1024)
    two = dataclasses.replace(config, num_layers=2)
    ids = torch.randint(0, 1024, (1, 17), generator=torch.Generator().manual_seed(0))
    per_layer = _saved_bytes(_model(two, mode, torch.bfloat16), ids) - _saved_bytes(
        _model(config, mode, torch.bfloat16), ids
    )
    assert per_layer == 16 * layer_saved_bytes_per_token(config, mode, 2)


class _LiveStorages(TorchDispatchMode):
    """Reference: every storage an op creates during forward, by weak reference."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.refs[st.data_ptr()] = (weakref.ref(st), st.nbytes())
        return out

    def alive(self, exclude: set[int]) -> int:
        return sum(n for ptr, (ref, n) in self.refs.items() if ref() is not None and ptr not in exclude)


@pytest.mark.parametrize("mode", MODES)
def test_meter_equals_the_bytes_still_alive_after_forward(mode: str) -> None:
    model = _model(tiny_config(), mode)
    ids = _batch(512)
    live = _LiveStorages()
    with SavedActivationMeter(exclude=model.parameters()) as meter, live:
        loss = _loss(model, ids)
    gc.collect()
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()} | {loss.untyped_storage().data_ptr()}
    assert meter.bytes == live.alive(exclude)
    assert meter.bytes > 0


# ---------------------------------------------------------------------------------------------- FLOPs
def _train_flops(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, int]:
    with flop_counter() as counter:
        loss = _loss(model, ids)
        forward = counter.get_total_flops()
        loss.backward()
    return forward, counter.get_total_flops()


@pytest.mark.parametrize("early_stop", [True, False])
def test_recomputed_flops_match_each_mode(early_stop: bool) -> None:
    config = tiny_config(num_layers=2)
    ids = _batch(512)
    tokens = B * T
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    proj = 2 * tokens * (h * q + 2 * h * kv + q * h + 3 * h * i)
    attn = 4 * tokens * T * q  # scores and weighted sum, every query against every key (the counter's rule)
    down = 2 * tokens * i * h  # the last matmul: nothing in backward needs its output, early stop skips it
    expected = {
        "none": 0,
        "full": config.num_layers * (proj + attn - (down if early_stop else 0)),
        "attention": config.num_layers * attn,
        "ops": 0,  # only pointwise ops are recomputed: no matmul FLOPs
    }
    ctx = contextlib.nullcontext() if early_stop else set_checkpoint_early_stop(False)
    with ctx:
        base_forward, base_total = _train_flops(_model(config, "none"), ids)
        for mode in MODES:
            forward, total = _train_flops(_model(config, mode), ids)
            assert forward == base_forward
            assert total - base_total == expected[mode], mode
    assert base_forward == config.num_layers * (proj + attn) + 2 * tokens * h * config.vocab_size


class _InPlaceBiasBlock(torch.nn.Module):
    """A linear as DeepSpeed's ZeRO-3 `LinearFunctionForZeroStage3` computes it: the bias added in place to the matmul
    output, which `ops` mode saves."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.matmul(self.w.t())
        out += self.b
        return torch.tanh(out)


def test_ops_mode_keeps_a_saved_output_as_it_was_before_an_in_place_op() -> None:
    """Without the copy, the recompute got the saved matmul output with the bias already in it and added it again:
    gradients off by O(1), and no error from torch."""

    def grads(mode: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = torch.nn.Sequential()
        net.layers = torch.nn.ModuleList([_InPlaceBiasBlock(), _InPlaceBiasBlock()])
        apply_checkpointing(net, CheckpointingConfig(mode=mode))
        x = torch.randn(4, 3, 8)
        for layer in net.layers:
            x = layer(x)
        x.sum().backward()
        return [p.grad for p in net.parameters()]

    for ours, reference in zip(grads("ops"), grads("none"), strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)
