"""`tandem serve`'s engine flags come from `EngineConfig` itself: every field has one, the flags' old names still
work, the dataclass spelling is an alias, and values reach the config unchanged (validation stays in it)."""

from __future__ import annotations

import dataclasses

import pytest

from inference_svc.cli import _serve_parser, build_serve_config
from inference_svc.engine.config import EngineConfig


def test_every_engine_field_has_a_flag(bundle_dir) -> None:
    dests = {a.dest for a in _serve_parser()._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= dests
    _, config, _ = build_serve_config(["--model", str(bundle_dir)])
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        if f.name != "dtype":  # resolved: 'auto' is float32 on a machine without CUDA
            assert getattr(config, f.name) == getattr(defaults, f.name), f.name


def test_old_names_aliases_and_the_settings_that_had_no_flag(bundle_dir) -> None:
    argv = ["--model", str(bundle_dir), "--max-running", "7", "--max-num-batched-tokens", "99", "--no-prefix-caching",
            "--no-chunked-prefill", "--prefill-chunk-size", "33", "--gpu-memory-fraction", "0.5",
            "--max-new-tokens", "12", "--verify-checksums", "--kv-cache-memory", "3MiB"]  # fmt: skip
    _, config, _ = build_serve_config(argv)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (7, 99)
    assert config.enable_prefix_caching is False and config.enable_chunked_prefill is False
    assert (config.prefill_chunk_size, config.gpu_memory_fraction, config.max_new_tokens_limit) == (33, 0.5, 12)
    assert config.verify_checksums is True and config.kv_cache_bytes == 3 * 1024**2
    _, again, _ = build_serve_config(["--model", str(bundle_dir), "--max-num-seqs", "5", "--enable-prefix-caching"])
    assert again.max_num_seqs == 5 and again.enable_prefix_caching is True


def test_an_invalid_value_names_the_field(bundle_dir, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_serve_config(["--model", str(bundle_dir), "--gpu-memory-fraction", "1.5"])
    assert info.value.code == 2
    assert "gpu_memory_fraction" in capsys.readouterr().err


def test_http_limits_are_derived_flags(bundle_dir) -> None:
    settings, _, _ = build_serve_config(
        ["--model", str(bundle_dir), "--http-max-connections", "7", "--http-max-connections-per-client", "3",
         "--http-head-timeout", "2.5", "--chat-template-timeout", "1.5"]
    )  # fmt: skip
    assert settings.http.max_connections == 7 and settings.http.max_connections_per_client == 3
    assert settings.http.head_timeout == 2.5 and settings.http.chat_template_timeout == 1.5
    with pytest.raises(SystemExit):
        build_serve_config(["--model", str(bundle_dir), "--http-head-timeout", "0"])
