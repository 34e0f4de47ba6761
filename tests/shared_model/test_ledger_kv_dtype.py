"""The ledger's K/V bytes per dtype: one fp32 scale per (layer, K|V, block, kv head) for fp8/int8, none for the
float dtypes; `tandem ledger --kv-dtype` prints the same figures (`kv_bytes_per_block` is their one owner)."""

from __future__ import annotations

import json

import pytest

from shared_model.config import PRESETS
from shared_model.ledger import (
    kv_bytes_per_block,
    kv_bytes_per_token,
    kv_scale_bytes_per_block,
    kv_sequences_bytes,
    ledger_report,
)
from shared_model.ledger_cli import main

TINY = PRESETS["tiny"].config  # 4 layers, 2 kv heads, head_dim 64


def test_per_block_and_per_token_bytes_by_dtype() -> None:
    data_bf16 = 2 * 4 * 16 * 128 * 2  # 2 (K, V) · layers · tokens · kv width · bytes
    assert kv_bytes_per_block(TINY, "bf16") == data_bf16 and kv_scale_bytes_per_block(TINY, "bf16") == 0
    assert kv_bytes_per_block(TINY, "fp32") == 2 * data_bf16
    for name in ("fp8", "int8"):
        assert kv_scale_bytes_per_block(TINY, name) == 2 * 4 * 2 * 4  # 2 · layers · kv heads · fp32
        assert kv_bytes_per_block(TINY, name) == data_bf16 // 2 + 64
        assert kv_bytes_per_token(TINY, name) == 1024 + 4
        assert kv_bytes_per_block(TINY, "bf16") / kv_bytes_per_block(TINY, name) >= 1.9
    assert kv_bytes_per_token(TINY, "bf16") == 2048


def test_a_fractional_scale_share_rounds_the_per_token_figure_up() -> None:
    # 4 layers · 2 heads · 8 B = 64 B of scales per block: over 48 tokens, 1.33 B per token -> counted as 2
    assert kv_bytes_per_block(TINY, "int8", 48) == 1024 * 48 + 64
    assert kv_bytes_per_token(TINY, "int8", 48) == 1024 + 2


def test_sequence_bytes_count_the_scales_of_every_block_touched() -> None:
    assert kv_sequences_bytes(TINY, "int8", 3, 17) == 3 * (17 * 1024 + 2 * 64)  # 17 tokens touch 2 blocks
    assert kv_sequences_bytes(TINY, "bf16", 3, 17) == 3 * 17 * 2048
    with pytest.raises(ValueError, match="unknown dtype 'fp4'"):
        kv_bytes_per_block(TINY, "fp4")


def test_tandem_ledger_kv_dtype_reports_the_same_bytes(capsys) -> None:
    assert main(["--model", "tiny", "--kv-dtype", "int8", "--context", "100", "--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv_cache"]
    assert kv["bytes_per_token"] == kv_bytes_per_token(TINY, "int8")
    assert kv["bytes_per_block"] == kv_bytes_per_block(TINY, "int8")
    assert kv["scale_bytes_per_block"] == 64 and kv["block_size"] == 16
    assert kv["bytes"] == kv_sequences_bytes(TINY, "int8", 1, 100)
    assert main(["--model", "tiny", "--kv-dtype", "fp8", "--kv-block-size", "32"]) == 0
    table = capsys.readouterr().out
    assert "+ 64 B scales / 32 tokens" in table
    rep = ledger_report(TINY, "tiny", kv_dtype="fp8", kv_block_size=32)
    assert rep.kv_cache["bytes_per_token"] == kv_bytes_per_token(TINY, "fp8", 32) == 1024 + 2
