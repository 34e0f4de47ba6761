"""The step budget's rule (`inference_svc.executor.step_budget`): 'auto' on a CPU is one whole prefill chunk beside
every running decode, on a GPU its fixed default (at least max_num_seqs); a number is used as given; the engine's
scheduler runs the resolved count and the load plan says why. The prefill group's rule likewise: 'auto' on a CPU is
128 tokens or the budget if smaller, on a GPU the budget; a step admits prompts while its prefill tokens stay within
it, its first chunk always."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_svc.engine import Engine, EngineConfig, SamplingParams
from inference_svc.engine.config import EngineConfigError
from inference_svc.executor.step_budget import (
    CPU_DEQUANTIZING_GROUP,
    CPU_PREFILL_GROUP,
    GPU_DEFAULT,
    choose_prefill_group,
    choose_step_budget,
)


@pytest.mark.parametrize(
    ("device", "chunk", "seqs", "expected"),
    [
        ("cpu", 512, 64, 576),  # the defaults
        ("cpu", 256, 8, 264),
        ("cuda", 512, 64, GPU_DEFAULT),
        ("cuda", 512, 4096, 4096),  # every running sequence decodes in each step
    ],
)
def test_auto_fits_a_chunk_beside_every_decode(device: str, chunk: int, seqs: int, expected: int) -> None:
    budget, choice = choose_step_budget("auto", device, chunk, seqs)
    assert budget == expected and choice.lever == "step_budget" and choice.value == str(expected)
    assert choice.reason.startswith("auto")


def test_a_number_is_used_as_given() -> None:
    assert choose_step_budget(48, "cpu", 512, 64)[0] == 48
    assert EngineConfig(max_num_batched_tokens="96").max_num_batched_tokens == 96  # a flag's text
    for bad in (0, -1, "many", 2.5):
        with pytest.raises(EngineConfigError, match="max_num_batched_tokens"):
            EngineConfig(max_num_batched_tokens=bad)  # type: ignore[arg-type]


def test_the_engine_schedules_with_the_resolved_budget(qwen3_dir: Path) -> None:
    config = EngineConfig(device="cpu", compile="off", max_num_seqs=8, prefill_chunk_size=32)
    engine = Engine.from_bundle(qwen3_dir, config)
    assert engine.config.max_num_batched_tokens == engine.scheduler.config.max_num_batched_tokens == 40
    assert engine.scheduler.config.prefill_group_tokens == 40  # 'auto' on a CPU: 128, within the budget
    choice = next(c for c in engine.info().load_plan if c.lever == "step_budget")
    assert choice.value == "40" and "chunk (32)" in choice.reason
    # a burst of 8 prompts of 16 tokens: the first step's 40 tokens answer two of them (and start a third)
    for i in range(8):
        engine.add_request(f"r{i}", list(range(3, 19)), SamplingParams(max_new_tokens=2, temperature=0.0))
    answered = {out.request_id for out in engine.step() if out.new_token_ids}
    assert answered == {"r0", "r1"}


@pytest.mark.parametrize(
    ("device", "budget", "expected"),
    [("cpu", 576, CPU_PREFILL_GROUP), ("cpu", 40, 40), ("cuda", 2048, 2048)],  # the defaults, a small budget, a GPU
)
def test_auto_prefill_group_on_a_cpu_is_its_constant_within_the_budget(device: str, budget: int, expected: int) -> None:
    group, choice = choose_prefill_group("auto", device, budget)
    assert group == expected and choice.lever == "prefill_group" and choice.value == str(expected)
    assert choice.reason.startswith("auto")
    assert choose_prefill_group(48, device, budget)[0] == 48
    assert EngineConfig(prefill_group_tokens="96").prefill_group_tokens == 96  # a flag's text
    for bad in (0, -1, "many", 2.5):
        with pytest.raises(EngineConfigError, match="prefill_group_tokens"):
            EngineConfig(prefill_group_tokens=bad)  # type: ignore[arg-type]


def test_auto_prefill_group_is_larger_where_a_steps_products_dequantize_their_weights() -> None:
    asked: list[int] = []

    def dequantizes(rows: int) -> bool:
        asked.append(rows)
        return True

    group, choice = choose_prefill_group("auto", "cpu", 576, dequantizes)
    assert asked == [CPU_PREFILL_GROUP]  # asked at the group it would otherwise be
    assert group == CPU_DEQUANTIZING_GROUP > CPU_PREFILL_GROUP and "dequantize" in choice.reason
    assert choose_prefill_group("auto", "cpu", 200, dequantizes)[0] == 200  # still within the budget
    assert choose_prefill_group("auto", "cpu", 576, lambda rows: False)[0] == CPU_PREFILL_GROUP
    asked.clear()
    assert choose_prefill_group("auto", "cuda", 2048, dequantizes)[0] == 2048 and not asked  # a GPU: no limit
    assert choose_prefill_group(48, "cpu", 576, dequantizes)[0] == 48 and not asked  # a number: as given


@pytest.mark.parametrize(("quantization", "expected"), [("none", CPU_PREFILL_GROUP), ("int8", CPU_DEQUANTIZING_GROUP)])
def test_an_int8_engine_groups_by_its_dequantizing_products(qwen3_dir: Path, quantization: str, expected: int) -> None:
    """With torch's kernels (`--cpu-kernels off`) int8 dequantizes its weight past `PACKED_MAX_ROWS` rows on every
    machine (Tandem's own take 128 rows on AMX tiles, and dequantize there only without them)."""
    config = EngineConfig(device="cpu", compile="off", quantization=quantization, cpu_kernels="off")
    engine = Engine.from_bundle(qwen3_dir, config)
    assert engine.config.prefill_group_tokens == engine.scheduler.config.prefill_group_tokens == expected
    choice = next(c for c in engine.info().load_plan if c.lever == "prefill_group")
    assert choice.value == str(expected) and ("dequantize" in choice.reason) == (quantization == "int8")


def test_a_step_admits_prompts_within_the_prefill_group_and_always_its_first_chunk(qwen3_dir: Path) -> None:
    config = EngineConfig(device="cpu", compile="off", max_num_seqs=8, prefill_chunk_size=32, prefill_group_tokens=16)
    engine = Engine.from_bundle(qwen3_dir, config)
    assert engine.config.prefill_group_tokens == engine.scheduler.config.prefill_group_tokens == 16
    assert (
        next(c for c in engine.info().load_plan if c.lever == "prefill_group").reason
        == "--prefill-group-tokens as given"
    )
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    # a prompt longer than the group still gets its whole chunk in a step of its own (32 tokens, not cut to 16)
    engine.add_request("long", list(range(3, 35)), params)
    engine.add_request("short", list(range(3, 11)), params)
    assert {out.request_id for out in engine.step() if out.new_token_ids} == {"long"}
    # then 8-token prompts, two to a step (16 tokens), beside the long one's decode
    for i in range(3):
        engine.add_request(f"r{i}", list(range(40, 48)), params)
    assert {out.request_id for out in engine.step() if out.new_token_ids} == {"long", "short", "r0"}
    assert {out.request_id for out in engine.step() if out.new_token_ids} == {"short", "r0", "r1", "r2"}


def test_a_cached_prefix_does_not_count_against_the_prefill_group(qwen3_dir: Path) -> None:
    config = EngineConfig(device="cpu", compile="off", max_num_seqs=8, prefill_chunk_size=64, prefill_group_tokens=16,
                          block_size=16)  # fmt: skip
    engine = Engine.from_bundle(qwen3_dir, config)
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    shared = list(range(100, 140))  # 40 tokens: two whole blocks are cached once it has run
    engine.add_request("warm", shared, params)
    assert {out.request_id for out in engine.step() if out.new_token_ids} == {"warm"}
    # 7 fresh tokens, then 41 of which 32 are cached: 7 + 9 = 16 tokens to compute, one step for both
    engine.add_request("fresh", list(range(3, 10)), params)
    engine.add_request("cached", [*shared, 7], params)
    assert {out.request_id for out in engine.step() if out.new_token_ids} == {"fresh", "cached"}
    assert engine.stats().prefix_cache_hit_tokens == 32
