"""The serving executor's load plan (`inference_svc.executor`): every lever chosen at load, in order, by a flag or a
rule, recorded with its reason, and the record is what runs."""

from __future__ import annotations

import pytest

import tandem_native
from inference_svc.engine import EngineConfig, EngineConfigError, SamplingParams
from inference_svc.executor.plan import Choice, LoadPlan
from inference_svc.executor.prepare import TRANSFORMS
from shared_model.quantize import INT4_TILE_MIN_ROWS, QuantizedLinear
from shared_model.serving_model import TILE_MAX_ROWS

NATIVE, WHY_NOT = tandem_native.status()
needs_native = pytest.mark.skipif(not NATIVE, reason=f"Tandem's CPU kernels do not run here: {WHY_NOT}")
TANDEM_METHODS = {"row_gemm", "int8_gemv", "int4_gemv", "int4_gemv+tile_gemm_int4", "int4_tiles"}


def _levers(plan: LoadPlan) -> list[str]:
    return [c.lever for c in plan]


def test_the_plan_lists_every_transform_in_order(qwen3_dir, make_engine) -> None:
    plan = make_engine(qwen3_dir, quantization="int8").info().load_plan
    kinds = [lever.split(".")[0] for lever in _levers(plan)]
    assert list(dict.fromkeys(kinds)) == list(TRANSFORMS)  # each transform, in the executor's order
    projections = [lever for lever in _levers(plan) if lever.startswith("linear.")]
    assert projections == [f"linear.{p}" for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")]
    assert all(c.value and c.reason for c in plan)
    assert plan.value("quantization") == "int8"
    with pytest.raises(KeyError, match="no lever 'nope'"):
        plan.value("nope")


def test_the_same_flags_give_the_same_plan_and_the_same_bits(qwen3_dir, make_engine) -> None:
    """Deterministic start-up: nothing is chosen from a timing, so two engines agree on every choice, and their
    greedy tokens and logprobs are bitwise the same."""
    engines = [make_engine(qwen3_dir, quantization="int4", compile="auto") for _ in range(2)]
    assert engines[0].info().load_plan == engines[1].info().load_plan
    params = SamplingParams(max_new_tokens=6, logprobs=True)
    runs = [e.generate([list(range(30, 50))], params)[0] for e in engines]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].logprobs == runs[1].logprobs


def test_cpu_kernels_off_runs_torch_everywhere_and_says_so(qwen3_dir, make_engine) -> None:
    engine = make_engine(qwen3_dir, quantization="int4", cpu_kernels="off")
    plan = engine.info().load_plan
    assert plan.value("cpu_kernels") == "off" and plan.value("sampler") == "torch"
    assert not {c.value for c in plan} & TANDEM_METHODS
    assert "torch ops only" in next(c.reason for c in plan if c.lever == "attention")
    # the record is what runs: the modules, the sampler and the attention ops were told the same answer
    layers = [m for m in engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and not any(m._row_kernel for m in layers)
    assert not engine.sampler.native
    r = engine.generate([list(range(30, 50))], SamplingParams(max_new_tokens=4))[0]
    assert len(r.token_ids) == 4


@needs_native
def test_int4_kernel_torch_keeps_the_int8_head_on_tandems_kernel(qwen3_dir, make_engine) -> None:
    plan = make_engine(qwen3_dir, quantization="int4", int4_kernel="torch").info().load_plan
    assert plan.value("linear.qkv_proj") == plan.value("linear.down_proj") == "int4_packed"
    head = "int8_gemv+tile_gemm_int8" if tandem_native.tiles() else "int8_gemv"  # bf16 on an AMX CPU: the tiles
    assert plan.value("linear.lm_head") == head and plan.value("cpu_kernels") == "tandem"
    default = make_engine(qwen3_dir, quantization="int4").info().load_plan
    int4 = "int4_gemv+tile_gemm_int4" if tandem_native.tiles() else "int4_gemv"  # bf16 with AMX: tiles for more rows
    assert default.value("linear.qkv_proj") == int4 and default.value("sampler") == "tandem"
    reason = next(c.reason for c in default if c.lever == "linear.qkv_proj")
    tiles = f"{INT4_TILE_MIN_ROWS}-{TILE_MAX_ROWS} rows: tandem::tile_gemm_int4"
    assert (tiles in reason) == tandem_native.tiles(), reason


def test_the_levers_are_validated_fields() -> None:
    with pytest.raises(EngineConfigError, match="cpu_kernels: must be one of"):
        EngineConfig(cpu_kernels="on")
    with pytest.raises(EngineConfigError, match="int4_kernel: must be one of"):
        EngineConfig(int4_kernel="fast")


def test_a_plan_summarises_in_one_line() -> None:
    plan = LoadPlan((Choice("cpu_kernels", "off", "--cpu-kernels off"), Choice("compile", "on", "--compile on")))
    assert plan.summary() == "cpu_kernels=off compile=on"
    assert plan.as_dicts()[1] == {"lever": "compile", "value": "on", "reason": "--compile on"}
    assert len(plan) == 2


def test_the_decode_runner_choice_names_its_rows_or_why_it_is_off() -> None:
    """`choose_decode_runner`: the rows it takes (the dense projections' `row_gemm` rows, int8's rows), and for
    each condition that turns it off, a reason naming it; with a draft model, the draft's choice in the reason."""
    import torch

    from inference_svc.executor import prepare as executor
    from shared_model.model import build_model
    from shared_model.quantize import quantize_weights
    from shared_model.serving_model import compiled_row_table, fuse_projections
    from tests.conftest import tiny_config

    model = fuse_projections(build_model(tiny_config(), seed=0).eval())  # fp32
    table = compiled_row_table(torch.float32, tiles=False, exact_verify=True)  # row_gemm for 1-17 rows
    on, f32 = EngineConfig(device="cpu"), torch.float32

    def choose(config=on, compiled=True, native=True, attention="torch", row_table=table, m=model, kv=f32):
        return executor.choose_decode_runner(config, compiled, native, attention, row_table, m, kv)

    off = {
        "--decode-runner off": choose(config=EngineConfig(device="cpu", decode_runner="off")),
        "runs eagerly": choose(compiled=False),
        "Tandem's row kernels": choose(native=False),
        "triton attention backend": choose(attention="triton"),
        "the KV cache is torch.bfloat16": choose(kv=torch.bfloat16),
    }
    for why, (rows, choice) in off.items():
        assert rows == 0 and choice.value == "off" and why in choice.reason, (why, choice)
    if not NATIVE:
        rows, choice = choose()
        assert rows == 0 and "native library" in choice.reason
        return
    rows, choice = choose()
    assert rows == 17 and choice.value == "1-17 rows" and "one C++ call" in choice.reason
    int8 = quantize_weights(build_model(tiny_config(), seed=0).eval(), "int8")  # fp32: int8 computes in bf16
    rows, choice = choose(m=int8)
    assert rows == 0 and "layer 0's qkv computes in torch.bfloat16" in choice.reason
    int8 = quantize_weights(build_model(tiny_config(), seed=0).to(torch.bfloat16).eval(), "int8")
    rows, choice = choose(m=int8, kv=torch.bfloat16)
    if tandem_native.tiles():  # int8_gemv takes one row where the AMX tiles take two and more
        assert rows == 1 and choice.value == "1 row"
    else:  # int8_gemv's rows (up to int8_gemv.MAX_ROWS) beyond the table's 17
        assert rows == 17 and choice.value == "1-17 rows"
    # a bf16 table with AMX tiles: the runner takes every row its table runs Tandem's kernels for (row_gemm, then
    # tile_gemm), not row_gemm's alone (a rule over the table: no AMX needed to choose it)
    tiled = compiled_row_table(torch.bfloat16, tiles=True, exact_verify=False)
    bounds = tiled.gemm_bounds()
    assert bounds is not None and bounds[1] > bounds[0]
    bf16 = fuse_projections(build_model(tiny_config(), seed=0).to(torch.bfloat16).eval())
    rows, choice = choose(row_table=tiled, m=bf16, kv=torch.bfloat16)
    assert rows == bounds[1] and choice.value == f"1-{bounds[1]} rows"
    both = executor.with_draft(choose()[1], choose(compiled=False)[1])
    assert both.value == "1-17 rows" and both.reason.endswith(
        "the draft model: off (the step runs eagerly: the runner takes a compiled engine's decode steps)"
    )
