"""A child process for tests/inference_svc/engine/test_compile_cache.py: builds one compiled engine over a bundle
with a given compile cache folder, greedy-decodes two prompts with logprobs, and prints one JSON line (the load
plan, the tokens, the logprobs as hex floats: bitwise comparable)."""

from __future__ import annotations

import json
import sys

from inference_svc.engine import Engine, EngineConfig, SamplingParams


def main(bundle: str, cache: str) -> None:
    config = EngineConfig(dtype="float32", kv_cache_memory="8MiB", compile="on", compile_cache=cache, threads=1)
    engine = Engine.from_bundle(bundle, config)
    params = SamplingParams(max_new_tokens=8, logprobs=True, ignore_eos=True)
    runs = engine.generate([list(range(30, 50)), list(range(7, 12))], params)
    print(
        json.dumps(
            {
                "plan": engine.info().load_plan.as_dicts(),
                "tokens": [r.token_ids for r in runs],
                "logprobs": [[float(x).hex() for x in r.logprobs or []] for r in runs],
                "eager_calls": engine.runner.compiled.eager_calls if engine.runner.compiled is not None else None,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
