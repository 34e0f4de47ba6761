"""`unfilled_construction` builds a model without filling it, and LitCausalLM's writes then cover every parameter:
a decoder built that way and poisoned with NaN comes out of the seeded init equal to an ordinary build. The torch
fills are restored afterwards, also when construction fails. (Under zero.Init the skipped broadcast is checked by
the 2-process test_sharded_init.py, whose gathered weights must equal the folder's and the whole build's.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lt_plugins.lit_module import _DEFAULT_INITS, init_random_weights, unfilled_construction
from shared_model.config import ModelConfig
from shared_model.model import CausalLM, build_model

CONFIG = ModelConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    qk_norm=True,
    attention_bias=True,
    attention_out_bias=True,
)


def test_every_parameter_is_written_by_the_seeded_init() -> None:
    with unfilled_construction():
        model = CausalLM(CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # whatever construction left, nothing of it may survive
    init_random_weights(model, seed=5)
    reference = build_model(CONFIG, seed=5)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(got, want), name


def test_the_fills_are_skipped_inside_and_restored_after_an_error() -> None:
    originals = {name: getattr(nn.init, name) for name in _DEFAULT_INITS}
    probe = torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="construction failed"), unfilled_construction():
        nn.init.normal_(probe)
        nn.init.kaiming_uniform_(probe)
        assert torch.equal(probe, torch.zeros(4, 4))
        raise RuntimeError("construction failed")
    assert {name: getattr(nn.init, name) for name in _DEFAULT_INITS} == originals
    nn.init.normal_(probe)
    assert not torch.equal(probe, torch.zeros(4, 4))
