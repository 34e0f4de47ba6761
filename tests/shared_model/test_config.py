"""ModelConfig validation, presets and the Hugging Face config.json mapping."""

from __future__ import annotations

import pytest

from shared_model.config import PRESETS, ModelConfig, get_preset
from shared_model.errors import ConfigError
from tests.conftest import tiny_config


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(hidden_size=0), "hidden_size must be a positive integer"),
        (dict(num_heads=6, num_kv_heads=4), r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
        (dict(head_dim=15), "head_dim must be even"),
        (dict(rope_theta=-1.0), "rope_theta must be > 0"),
        (dict(rms_norm_eps=0.0), r"rms_norm_eps must be in \(0, 1\)"),
        (dict(model_type="gpt2"), "model_type must be one of"),
        (dict(bos_token_id=9999), "bos_token_id=9999 is outside the vocabulary"),
        (dict(eos_token_ids=(1, 600)), "eos_token_ids contains 600"),
    ],
)
def test_invalid_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides)


def test_presets_sizes():
    assert 3e6 < get_preset("tiny").num_parameters() < 8e6
    assert 25e6 < get_preset("mini").num_parameters() < 35e6
    assert 80e6 < get_preset("small").num_parameters() < 120e6
    assert round(get_preset("qwen3-8b").num_parameters() / 1e9, 2) == 8.19
    assert round(get_preset("qwen3-0.6b").num_parameters() / 1e9, 2) == 0.6
    assert round(get_preset("llama-3.2-1b").num_parameters() / 1e9, 2) == 1.24
    with pytest.raises(ConfigError, match="unknown model preset 'huge'; choose one of: tiny, mini, small"):
        get_preset("huge")


@pytest.mark.parametrize("name", list(PRESETS))
def test_hf_round_trip(name):
    cfg = PRESETS[name].config
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_parameter_count_matches_module():
    from shared_model.model import CausalLM

    for cfg in (tiny_config(), tiny_config(tie_word_embeddings=True, model_type="llama", qk_norm=False)):
        model = CausalLM(cfg)
        assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())


def _hf(**changes):
    raw = tiny_config().to_hf_dict()
    raw.update(changes)
    return raw


@pytest.mark.parametrize(
    "raw,message",
    [
        (_hf(model_type="mistral"), "model_type 'mistral' is not supported"),
        (_hf(hidden_act="gelu"), "field 'hidden_act'='gelu' is not supported"),
        (_hf(use_sliding_window=True), "field 'use_sliding_window'=True is not supported"),
        (_hf(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn' is not supported"),
        (_hf(quantization_config={"bits": 4}), r"unsupported field\(s\): quantization_config"),
        (_hf(num_hidden_layers="2"), "'num_hidden_layers' must be an integer, got '2'"),
        (_hf(attention_dropout=0.1), "'attention_dropout'=0.1 is not supported"),
        (_hf(layer_types=["sliding_attention", "full_attention"]), "'layer_types' has unsupported types"),
        ({k: v for k, v in _hf().items() if k != "vocab_size"}, "missing required field 'vocab_size'"),
    ],
)
def test_unsupported_hf_fields_are_named(raw, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(raw)


def test_legacy_rope_layout_is_read():
    raw = get_preset("llama-3.2-1b").to_hf_dict()
    raw.pop("rope_parameters")
    assert ModelConfig.from_hf_dict(raw) == get_preset("llama-3.2-1b")
