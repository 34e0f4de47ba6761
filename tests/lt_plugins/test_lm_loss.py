"""The chunked LM loss (`model.loss_chunk_tokens`, lt_plugins/lm_loss.py): the unchunked loss's value and gradients
at every chunk size, under autocast, with ignored targets and a frozen head; the bytes it holds for backward equal
memory_model's count; LitCausalLM and the config take it where it applies and refuse it where it does not."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from lt_plugins.activation_meter import SavedActivationMeter
from lt_plugins.config import ModelSection
from lt_plugins.errors import TrainingConfigError
from lt_plugins.lit_module import LitCausalLM
from lt_plugins.lm_loss import chunked_lm_loss
from lt_plugins.lora import LoraConfig
from lt_plugins.memory_model import activation_bytes, head_saved_bytes_per_token, loss_weight_grad_bytes
from tests.conftest import tiny_config

N, H, V = 45, 16, 37


def _inputs(dtype: torch.dtype = torch.float64, ignored: bool = True) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()  # [N, H]
    weight = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_()  # [V, H]
    targets = torch.randint(0, V, (N,), generator=g)  # [N]
    if ignored:
        targets[::4] = -100
    return hidden, weight, targets


def _reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), targets)


@pytest.mark.parametrize("chunk", [1, 7, 16, N, 4 * N])
def test_value_and_gradients_match_the_unchunked_loss(chunk: int) -> None:
    hidden, weight, targets = _inputs()
    ref = _reference(hidden, weight, targets)
    (3 * ref).backward()  # a scaled loss: backward must scale by the incoming gradient
    ref_grads = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    loss = chunked_lm_loss(hidden, weight, targets, chunk)
    (3 * loss).backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_grads[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad, ref_grads[1], rtol=1e-5, atol=1e-7)
    assert hidden.grad.dtype == weight.grad.dtype == torch.float64  # each input's own dtype


def test_under_bf16_autocast_the_matmuls_run_as_f_linear_would() -> None:
    hidden, weight, targets = (t.detach() for t in _inputs(torch.float32, ignored=False))
    hidden.requires_grad_()
    weight.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _reference(hidden, weight, targets)  # F.linear in bf16, the loss in fp32
    ref.backward()
    ref_grads = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_lm_loss(hidden, weight, targets, 8)
    loss.backward()
    fp32 = _reference(hidden.detach(), weight.detach(), targets)
    torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-3)  # bf16 logits: both round the same products
    assert (loss - fp32).abs() > 1e-6  # and not fp32's: the autocast dtype was taken
    torch.testing.assert_close(hidden.grad, ref_grads[0], rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(weight.grad, ref_grads[1], rtol=2e-2, atol=2e-3)
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32


def test_a_frozen_head_gets_no_gradient_and_holds_no_weight_sized_buffer() -> None:
    hidden, weight, targets = _inputs(torch.float32)
    weight.requires_grad_(False)
    with SavedActivationMeter() as meter:
        loss = chunked_lm_loss(hidden, weight, targets, 8)
    loss.backward()
    assert weight.grad is None
    assert meter.bytes == N * H * 4 + 8  # d hidden [N, H] fp32 and the target count, no [V, H]
    chunked_grad, hidden.grad = hidden.grad, None
    ref = _reference(hidden, weight, targets)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(chunked_grad, hidden.grad, rtol=1e-5, atol=1e-7)


def test_a_second_backward_through_the_same_loss_is_refused() -> None:
    hidden, weight, targets = _inputs(torch.float32)
    loss = chunked_lm_loss(hidden, weight, targets, 8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=re.escape("a second backward through the same loss")):
        loss.backward()


def test_without_grad_only_the_loss_is_computed() -> None:
    hidden, weight, targets = _inputs(torch.float32)
    with torch.no_grad(), SavedActivationMeter() as meter:
        loss = chunked_lm_loss(hidden, weight, targets, 8)
    assert meter.bytes == 0 and not loss.requires_grad
    torch.testing.assert_close(loss, _reference(hidden.detach(), weight.detach(), targets))


def test_every_target_ignored_is_nan_as_in_cross_entropy() -> None:
    hidden, weight, targets = _inputs(torch.float32)
    targets[:] = -100
    assert torch.isnan(chunked_lm_loss(hidden, weight, targets, 8))
    assert torch.isnan(_reference(hidden, weight, targets))


@pytest.mark.parametrize(
    ("hidden", "weight", "targets", "chunk", "message"),
    [
        ((N, H), (V, H), (N,), 0, "chunk_tokens must be at least 1, got 0"),
        ((N, H), (V, H + 1), (N,), 8, "hidden [N, H] and weight [V, H] must share H"),
        ((2, N, H), (V, H), (N,), 8, "hidden [N, H] and weight [V, H] must share H"),
        ((N, H), (V, H), (N - 1,), 8, f"targets must be [N] = [{N}], got ({N - 1},)"),
    ],
)
def test_bad_arguments_are_refused_naming_them(hidden, weight, targets, chunk, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        chunked_lm_loss(torch.zeros(hidden), torch.zeros(weight), torch.zeros(targets, dtype=torch.long), chunk)


# ------------------------------------------------------------------------------------------------ LitCausalLM
def _module(chunk: int, lora: LoraConfig | None = None, **config) -> LitCausalLM:
    module = LitCausalLM(tiny_config(num_layers=2, **config), seed=0, lora=lora, loss_chunk_tokens=chunk)
    module.configure_model()
    return module


def test_tied_embeddings_get_both_gradients_summed() -> None:
    batch = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(3))
    plain, chunked = _module(0, tie_word_embeddings=True), _module(16, tie_word_embeddings=True)
    assert chunked.model.lm_head.weight is chunked.model.model.embed_tokens.weight
    plain._loss(batch).backward()
    chunked._loss(batch).backward()
    for (name, p), q in zip(chunked.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=f"gradient of {name}")


def test_lit_module_chunked_loss_matches_its_unchunked_loss_and_the_memory_model() -> None:
    config = tiny_config(num_layers=2)
    batch = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    plain, chunked = _module(0), _module(16)
    assert not plain.chunks_loss() and chunked.chunks_loss()
    with SavedActivationMeter(exclude=plain.parameters()) as plain_meter:
        ref = plain._loss(batch)
    with SavedActivationMeter(exclude=chunked.parameters()) as chunked_meter:
        loss = chunked._loss(batch)
    ref.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(chunked.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=f"gradient of {name}")
    # what each holds for backward: the formula's difference, measured
    tokens = 2 * 32
    per_token = head_saved_bytes_per_token(config, 4) - head_saved_bytes_per_token(config, 4, chunked=True)
    assert per_token == 8 + 4 * config.vocab_size  # the targets and the fp32 log-softmax
    # cross_entropy's 4-byte weight sum is the one byte count the formula leaves out (within a byte a token)
    measured = plain_meter.bytes - 4 - chunked_meter.bytes
    assert measured == tokens * per_token - loss_weight_grad_bytes(config)
    modelled = activation_bytes(config, 2, 32, "none", "32-true")["saved"]
    modelled_chunked = activation_bytes(config, 2, 32, "none", "32-true", chunked_loss=True)["saved"]
    assert modelled - modelled_chunked == measured


def test_a_lora_wrapped_head_takes_the_unchunked_path_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    wrapped = _module(16, LoraConfig(enabled=True, rank=2, targets=("lm_head",)))
    assert not wrapped.chunks_loss()
    with caplog.at_level("WARNING", logger="lt_plugins.lit_module"):
        wrapped.on_fit_start()
        _module(16).on_fit_start()
    assert "model.loss_chunk_tokens=16 -> unchunked (the LM head is a LoraLinear, not a plain Linear)" in caplog.text
    assert "model.loss_chunk_tokens=16 -> chunked" in caplog.text


def test_a_frozen_head_holds_no_weight_gradient_as_the_memory_model_counts() -> None:
    batch = torch.randint(0, 512, (1, 17), generator=torch.Generator().manual_seed(2))
    lora = _module(16, LoraConfig(enabled=True, rank=2))  # adapters on the projections; the head frozen, plain
    assert lora.chunks_loss()
    lora._loss(batch).backward()
    assert lora.model.lm_head.weight.grad is None
    module = _module(16)
    held = {}
    for trains in (True, False):
        module.model.lm_head.weight.requires_grad_(trains)
        with SavedActivationMeter(exclude=module.parameters()) as meter:
            module._loss(batch)
        held[trains] = meter.bytes
    config = module.model_config
    modelled = {
        trains: activation_bytes(config, 1, 16, "none", "32-true", chunked_loss=True, head_trains=trains)["saved"]
        for trains in (True, False)
    }
    assert held[True] - held[False] == modelled[True] - modelled[False] == 4 * config.vocab_size * config.hidden_size


def test_the_config_validates_the_key() -> None:
    assert ModelSection().loss_chunk_tokens == 0
    assert ModelSection(loss_chunk_tokens=256).loss_chunk_tokens == 256
    with pytest.raises(TrainingConfigError, match=re.escape("model.loss_chunk_tokens must be 0 (unchunked) or more")):
        ModelSection(loss_chunk_tokens=-1)
    with pytest.raises(TrainingConfigError, match=re.escape("model.loss_chunk_tokens must be an integer, got '64'")):
        ModelSection(loss_chunk_tokens="64")  # type: ignore[arg-type]
    user = "tests.lt_plugins.user_module_example.BagOfTokens"
    with pytest.raises(TrainingConfigError, match=re.escape("sets the built-in LitCausalLM's loss; model.class_path=")):
        ModelSection(class_path=user, loss_chunk_tokens=64)
    assert ModelSection(class_path=user).loss_chunk_tokens == 0
