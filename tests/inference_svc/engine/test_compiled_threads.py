"""The compiled step under the thread governor (`shared_model.compiled`, dynamic threads): compiled once at the
ceiling, it serves every thread count from its graphs (no eager fallback, no recompile) with the same greedy tokens,
and a call in another global torch state still misses its graphs as dynamo's own guard would have made it."""

from __future__ import annotations

import pytest
import torch

from inference_svc.engine import SamplingParams
from inference_svc.executor.governor import ThreadGovernor
from shared_model.compiled import compiler_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not compiler_available(torch.device("cpu"))[0], reason=compiler_available(torch.device("cpu"))[1]
    ),
]  # slow: compiles a decoder (the full suite only)

PROMPTS = [[5, 6, 7, 8, 9], [11, 300, 12], [400, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


def test_one_compiled_step_serves_every_thread_count_with_the_same_tokens(qwen3_dir, make_engine) -> None:
    before = torch.get_num_threads()
    try:
        engine = make_engine(qwen3_dir, compile="on", threads=2, compile_cache="off")
        assert engine.info().load_plan.value("thread_governor") == "on"
        compiled = engine.runner.compiled
        assert compiled is not None and compiled.dynamic_threads
        gov = engine.thread_governor  # held at the ceiling: this test sets the count itself
        engine.thread_governor = ThreadGovernor(gov.ceiling, gov.cpus, enabled=False)
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)  # greedy
        at_two = [r.token_ids for r in engine.generate(PROMPTS, params)]
        torch.set_num_threads(1)
        at_one = [r.token_ids for r in engine.generate(PROMPTS, params)]
        torch.set_num_threads(2)
        again = [r.token_ids for r in engine.generate(PROMPTS, params)]
        assert at_one == at_two == again
        assert compiled.eager_calls == 0  # dynamo's global-state guard (the thread count in it) would miss at 1
        torch.use_deterministic_algorithms(True)  # another global state: the graphs' own check misses
        try:
            assert len(engine.generate(PROMPTS[:1], params)[0].token_ids) == 12
        finally:
            torch.use_deterministic_algorithms(False)
        assert compiled.eager_calls > 0  # run eagerly, as a guard miss under 'fail_on_recompile' does
    finally:
        torch.set_num_threads(before)
