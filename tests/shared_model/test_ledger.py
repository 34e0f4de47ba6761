"""The memory ledger reproduces the lecture's figures exactly, and the CLI prints them."""

from __future__ import annotations

import json
import re

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


def _folder(tmp_path, torch_dtype: str | None, max_positions: int = 512):
    """A model folder holding only a config.json (the ledger never reads weights)."""
    folder = tmp_path / f"model-{torch_dtype}-{max_positions}"
    folder.mkdir()
    config = get_preset("tiny").replace(max_position_embeddings=max_positions)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(torch_dtype=torch_dtype)))
    return folder


def test_the_table_uses_decimal_units_throughout_and_says_so(capsys):
    assert ledger_main(["--model", "qwen3-8b"]) == 0
    out = capsys.readouterr().out
    assert (
        out.splitlines()[0] == "Memory ledger: qwen3-8b  (decimal units: 1 kB = 10^3 B, 1 MB = 10^6 B, 1 GB = 10^9 B)"
    )
    assert "KiB" not in out and "MiB" not in out and "GiB" not in out
    lines = [line.rstrip() for line in out.splitlines()]
    assert any(re.fullmatch(r"  K/V per token \(2 x 36 layers x 1024 x 2 B\) +147\.5 kB", line) for line in lines)
    assert any(re.fullmatch(r"  K/V cache \(B=1, L=4096, bf16\) +604\.0 MB", line) for line in lines)
    assert "  K/V cache bytes        604.0 MB -> 1.2 GB  (2x)" in lines
    assert "  8,190,735,360 parameters (8.19B), model card: 8.2B" in lines
    assert ledger_main(["--model", "tiny"]) == 0
    assert "  5,245,696 parameters (5.25M)" in capsys.readouterr().out.splitlines()


def test_default_context_is_the_models_own_maximum_when_smaller(capsys, tmp_path):
    folder = _folder(tmp_path, "bfloat16", max_positions=512)
    assert ledger_main(["--model", str(folder), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["context"] == 512 and data["kv_cache"]["bytes"] == 512 * data["kv_cache"]["bytes_per_token"]
    assert ledger_main(["--model", str(folder)]) == 0
    out = capsys.readouterr().out
    assert (
        "  context L = 512 tokens, batch B = 1 (default: the smaller of 4,096 and the model's "
        "max_position_embeddings, 512)"
    ) in out.splitlines()
    assert "If the context doubles (512 -> 1024)" in out
    # presets follow the same rule: tiny stops at 2,048, qwen3-8b (40,960) keeps the 4,096 default
    assert ledger_main(["--model", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 2048
    assert ledger_main(["--model", "qwen3-8b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 4096
    # an explicit context is kept, and flagged when the model cannot reach it
    assert ledger_main(["--model", str(folder), "--context", "1024"]) == 0
    assert (
        "L = 1,024 tokens, batch B = 1 (more than the model's max_position_embeddings, 512)" in capsys.readouterr().out
    )


def test_a_model_folder_defaults_to_its_own_torch_dtype(capsys, tmp_path):
    n = get_preset("tiny").num_parameters()
    fp32 = _folder(tmp_path, "float32")
    assert ledger_main(["--model", str(fp32), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["weight_dtype"] == "float32" and data["inference"]["weight_bytes"] == 4 * n
    assert data["kv_cache"]["dtype_bytes"] == 4  # the engine keeps K/V in the weights' dtype
    assert ledger_main(["--model", str(fp32)]) == 0
    assert re.search(
        r"\n  weights \(float32 from config\.json torch_dtype, 4 B/param\) +21\.0 MB\n", capsys.readouterr().out
    )
    assert ledger_main(["--model", str(fp32), "--weight-dtype", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inference"]["weight_bytes"] == 2 * n
    assert ledger_main(["--model", str(_folder(tmp_path, None)), "--json"]) == 0  # no torch_dtype: bf16
    data = json.loads(capsys.readouterr().out)
    assert data["weight_dtype"] == "bf16" and data["weight_dtype_source"] == "default"
