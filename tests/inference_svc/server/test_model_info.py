"""GetModelInfo from the engine's typed `EngineInfo`: every figure present, the shared ledger's figures included
for a Llama 3 bundle with RoPE scaling (they used to be dropped when the config was rebuilt from a dict)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared_model.bundle import save_bundle
from shared_model.config import RopeScaling
from shared_model.ledger import kv_bytes_per_block, kv_bytes_per_token, kv_sequences_bytes, served_weight_bytes
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer
from tests.conftest import tiny_config
from tests.inference_svc.server.conftest import engine_config, make_server, metric_value


@pytest.fixture(scope="module")
def llama3_bundle(tmp_path_factory: pytest.TempPathFactory, small_tokenizer: Tokenizer) -> Path:
    config = tiny_config(model_type="llama", qk_norm=False, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))
    return save_bundle(tmp_path_factory.mktemp("llama3") / "llama3-tiny", config, build_model(config), small_tokenizer)


def test_model_info_of_a_rope_scaled_llama3_bundle(llama3_bundle: Path) -> None:
    srv = make_server(llama3_bundle)
    try:
        with srv.client(timeout=30) as c:
            info = c.model_info()
        engine_info = srv.server.engine_info()
        assert engine_info is not None
        assert info.model_name == "llama3-tiny"
        assert info.config.model_type == "llama" and info.config.num_parameters == engine_info.num_parameters
        assert info.max_context == engine_info.max_model_len
        assert info.kv_capacity_tokens == engine_info.kv_capacity_tokens == info.ledger.kv_capacity_tokens
        assert info.ledger.kv_block_size == engine_info.config.block_size
        assert info.ledger.weight_bytes == engine_info.weight_bytes
        assert info.ledger.extra["ledger.weight_bytes"] > 0  # computed, not skipped, with rope scaling set
        kv_seq = info.ledger.extra["ledger.kv_bytes_per_sequence_at_max_context"]
        assert kv_seq == info.ledger.kv_bytes_per_token * info.max_context
        assert info.ledger.extra["peak_workspace_bytes"] > 0  # the warm-up ran a step
    finally:
        srv.close()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_server_reports_its_weights_as_held(bundle_dir: Path, kind: str) -> None:
    """`--quantization`: GetModelInfo, the ledger's formula and /metrics agree on the bytes the weights occupy."""
    srv = make_server(bundle_dir, engine=engine_config(quantization=kind))
    try:
        with srv.client(timeout=30) as c:
            info = c.model_info()
            reply = c.generate("import os", max_new_tokens=4, ignore_eos=True)
        assert info.quantization == kind and len(reply.token_ids) == 4
        assert info.ledger.weight_bytes == info.ledger.extra["ledger.weight_bytes"]  # measured == formula
        config = srv.server.engine_info().model_config
        assert info.ledger.weight_bytes == served_weight_bytes(config, "float32", kind)
        assert info.ledger.weight_bytes < 0.5 * served_weight_bytes(config, "float32")
        held = metric_value(
            srv.server.metrics.render(), "tandem_model_weight_bytes", dtype="float32", quantization=kind
        )
        assert held == info.ledger.weight_bytes
    finally:
        srv.close()


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_a_quantized_kv_cache_reports_the_same_bytes_everywhere(bundle_dir: Path, kv: str) -> None:
    """`--kv-cache-dtype`: GetModelInfo, the engine, /metrics and the shared ledger agree on the K/V bytes
    (scales included), and the pool holds ≥ 1.9× the tokens of a bf16 cache in the same memory."""
    srv = make_server(bundle_dir, engine=engine_config(kv_cache_dtype=kv, kv_cache_memory="1MiB"))
    try:
        with srv.client(timeout=30) as c:
            info = c.model_info()
            reply = c.generate("import os", max_new_tokens=4, ignore_eos=True)
        assert info.kv_cache_dtype == kv and len(reply.token_ids) == 4
        engine_info = srv.server.engine_info()
        config, bs = engine_info.model_config, engine_info.config.block_size
        per_token, per_block = kv_bytes_per_token(config, kv, bs), kv_bytes_per_block(config, kv, bs)
        assert info.ledger.kv_bytes_per_token == engine_info.kv_bytes_per_token == per_token
        assert info.ledger.kv_bytes_per_block == engine_info.kv_bytes_per_block == per_block
        assert info.ledger.kv_cache_bytes == info.ledger.kv_blocks_total * per_block == engine_info.kv_cache_bytes
        kv_seq = info.ledger.extra["ledger.kv_bytes_per_sequence_at_max_context"]
        assert kv_seq == kv_sequences_bytes(config, kv, 1, info.max_context, bs)
        text = srv.server.metrics.render()
        assert metric_value(text, "tandem_kv_bytes_per_token", kv_cache_dtype=kv) == per_token
        assert metric_value(text, "tandem_kv_cache_bytes", kv_cache_dtype=kv) == info.ledger.kv_cache_bytes
        bf16_tokens = (2**20 // kv_bytes_per_block(config, "bf16", bs)) * bs
        assert info.kv_capacity_tokens >= 1.9 * bf16_tokens
    finally:
        srv.close()


def test_a_compiled_server_reports_its_compile_and_serves(bundle_dir: Path) -> None:
    """`--compile on`: health says SERVING only after the warm-up compile, whose seconds GetModelInfo and /metrics
    report alike; a tiny model under the default ('auto') stays eager and says so."""
    srv = make_server(bundle_dir, engine=engine_config(compile="on"))
    try:
        with srv.client(timeout=30) as c:
            info = c.model_info()
            reply = c.generate("import os", max_new_tokens=4, ignore_eos=True)
        assert info.compiled and info.compile_seconds > 0 and len(reply.token_ids) == 4
        assert metric_value(srv.server.metrics.render(), "tandem_compile_seconds") == info.compile_seconds
        assert srv.server.engine.engine.runner.compiled.eager_calls == 0
    finally:
        srv.close()
    srv = make_server(bundle_dir)
    try:
        with srv.client(timeout=30) as c:
            info = c.model_info()
        assert not info.compiled and info.compile_seconds == 0
        assert metric_value(srv.server.metrics.render(), "tandem_compile_seconds") == 0
    finally:
        srv.close()
