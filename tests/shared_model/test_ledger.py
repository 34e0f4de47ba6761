"""The memory ledger reproduces the lecture's figures exactly, and the CLI prints them."""

from __future__ import annotations

import json

import pytest

from shared_model.config import PRESETS, get_preset
from shared_model.ledger import (
    GB,
    TRAINING_BYTES_PER_PARAM,
    MiB,
    decode_pairs,
    kv_bytes_per_token,
    kv_cache_bytes,
    ledger_report,
    prefill_pairs,
    zero_state_bytes_per_gpu,
)
from shared_model.ledger_cli import main as ledger_main


def test_lecture_training_table_for_qwen3_8b():
    rep = ledger_report(get_preset("qwen3-8b"), "qwen3-8b", nominal_params=PRESETS["qwen3-8b"].nominal_params)
    figures = [round(row["bytes_at_nominal"] / GB, 1) for row in rep.training_state]
    assert figures == [16.4, 32.8, 32.8, 65.6, 147.6]
    assert [row["bytes_per_param"] for row in rep.training_state] == [2, 4, 4, 8, 18]
    assert TRAINING_BYTES_PER_PARAM == 18
    assert round(rep.num_params / 1e9, 1) == 8.2
    assert round(rep.inference["weight_bytes"] / GB, 1) == 16.4


def test_lecture_kv_example_is_24_mib():
    assert kv_cache_bytes(num_layers=12, batch=1, context=1024, kv_width=512, bytes_per_element=2) == 24 * MiB


def test_doubling_context():
    L = 1024
    assert prefill_pairs(2 * L) == 4 * prefill_pairs(L)
    assert decode_pairs(2 * L) == 2 * decode_pairs(L)
    assert kv_cache_bytes(12, 1, 2 * L, 512, 2) == 2 * kv_cache_bytes(12, 1, L, 512, 2)
    assert prefill_pairs(4, causal=True) == 10


def test_kv_bytes_per_token_of_qwen3_8b():
    # 2 (K and V) x 36 layers x 8 kv heads x 128 dims x 2 bytes
    assert kv_bytes_per_token(get_preset("qwen3-8b"), "bf16") == 2 * 36 * 8 * 128 * 2


@pytest.mark.parametrize(
    "stage,expected",
    [(0, [2, 4, 4, 8]), (1, [2, 1, 4, 2]), (2, [2, 1, 1, 2]), (3, [0.5, 1, 1, 2])],
)
def test_zero_stages_divide_the_promised_terms(stage, expected):
    per_gpu = zero_state_bytes_per_gpu(1, stage, gpus=4)
    assert list(per_gpu.values()) == expected


def test_cli_prints_the_lecture_table(capsys):
    assert ledger_main(["--model", "qwen3-8b"]) == 0
    out = capsys.readouterr().out
    for figure in ("16.4 GB", "32.8 GB", "65.6 GB", "147.6 GB"):
        assert figure in out
    assert "(4x)" in out and "(2x)" in out


def test_cli_json_and_errors(capsys, tmp_path):
    assert ledger_main(["--model", "tiny", "--json", "--gpus", "2", "--zero-stage", "3", "--context", "100"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["zero"]["stage"] == 3 and data["kv_cache"]["bytes"] == 100 * data["kv_cache"]["bytes_per_token"]
    assert ledger_main(["--model", "nonexistent"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert ledger_main(["--model", "tiny", "--context", "0"]) == 2
    assert "context must be >= 1" in capsys.readouterr().err


def test_cli_reports_weights_as_served_under_each_quantization(capsys):
    served = {}
    for kind in ("none", "int8", "int4"):
        assert ledger_main(["--model", "qwen3-8b", "--quantization", kind, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        served[kind] = data["inference"]["served_weight_bytes"]
        assert data["quantization"] == kind and data["inference"]["weight_bytes"] == data["num_params"] * 2
    cfg = get_preset("qwen3-8b")
    matrices = cfg.num_parameters(include_embeddings=False) - cfg.num_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim)
    matrices -= cfg.hidden_size  # the final norm: what is left is the layers' projection weights
    # int8 saves a byte per projection weight (minus its row scales); the LM head goes from 2 bytes to 1 (+ scales)
    head_saving = cfg.vocab_size * cfg.hidden_size - 2 * cfg.vocab_size
    assert served["none"] - served["int8"] == pytest.approx(matrices + head_saving, rel=1e-3)
    assert served["int4"] < 0.4 * served["none"]
    assert ledger_main(["--model", "qwen3-8b", "--quantization", "int4"]) == 0
    assert "weights as served (int4)" in capsys.readouterr().out
