"""`tandem eval --kv-cache-dtype`: the held-out windows scored through an in-process engine whose K/V cache is
stored in that dtype. An fp32 cache reproduces the offline (shared_model, fp32) figure; int8 stays within 1%."""

from __future__ import annotations

import json

import pytest

from inference_svc import eval_cli
from inference_svc.engine.config import KV_CACHE_DTYPES


def _eval(capsys, *args: str) -> dict:
    assert eval_cli.main([*args, "--window", "64", "--max-tokens", "400", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("kv", "bound"), [("fp32", 1e-4), ("int8", 1e-2)])
def test_engine_path_scores_the_offline_windows(llama_dir, capsys, kv: str, bound: float) -> None:
    out = _eval(capsys, "--model", str(llama_dir), "--kv-cache-dtype", kv)
    engine, offline = out["engine"], out["offline"]
    assert engine["kv_cache_dtype"] == kv
    assert engine["tokens"] == offline["tokens"] and engine["bytes"] == offline["bytes"]
    assert engine["relative_difference"] <= bound, engine
    if kv == "int8":
        assert engine["relative_difference"] > 0  # the cache really is quantized


def test_a_bad_kv_cache_dtype_is_refused(llama_dir, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        eval_cli.main(["--model", str(llama_dir), "--kv-cache-dtype", "fp4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "int8" in err


def test_the_cli_choices_are_the_engine_config_values() -> None:
    assert eval_cli.KV_CACHE_DTYPES == KV_CACHE_DTYPES
