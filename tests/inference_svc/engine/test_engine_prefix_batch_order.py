"""Regression: prefix-cache hits admitted together must get their own logits.

A cache-hit admission whose uncached remainder is one token runs as a decode (decodes go first in the flat token
layout) while it sits after prefill chunks in the scheduler's batch; logits must follow the batch order.
"""

from __future__ import annotations

from inference_svc.engine.types import SamplingParams


def test_cached_prompts_batched_match_alone(llama_dir, make_engine):
    engine = make_engine(llama_dir, block_size=16, enable_prefix_caching=True)
    rng_prompts = [
        list(range(3, 3 + 41)),  # 2 full cached blocks + a 9-token prefill chunk
        list(range(100, 100 + 33)),  # 2 full cached blocks + a 1-token remainder (runs as a decode)
        list(range(200, 200 + 50)),  # 3 full cached blocks + 2 tokens
    ]
    params = SamplingParams(max_new_tokens=8)
    alone = [engine.generate([p], params)[0].token_ids for p in rng_prompts]  # also fills the prefix cache
    assert engine.stats().kv_blocks_cached >= 7
    together = engine.generate(rng_prompts, params)
    assert [r.token_ids for r in together] == alone
    assert all(r.usage.cached_prompt_tokens >= 32 for r in together)
