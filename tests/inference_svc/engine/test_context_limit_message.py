"""A prompt too long for the context is refused with the setting that actually limits it named."""

from __future__ import annotations

import pytest

from inference_svc.engine.types import SamplingParams
from inference_svc.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({}, "max_position_embeddings (512, config.json)"),  # the model's own positions are the limit
        ({"max_model_len": 64}, "max_model_len (64, --max-model-len)"),
        ({"kv_cache_memory": "64KiB", "block_size": 16}, "the KV-cache pool"),
    ],
)
def test_the_limit_named_is_the_one_that_binds(make_engine, llama_dir, overrides: dict, named: str) -> None:
    engine = make_engine(llama_dir, **overrides)
    too_long = [5] * engine.max_model_len
    with pytest.raises(InvalidRequestError, match="prompt") as info:
        engine.add_request("r", too_long, SamplingParams(max_new_tokens=1))
    assert named in str(info.value)
    assert f"holds {engine.max_model_len}" in str(info.value)
