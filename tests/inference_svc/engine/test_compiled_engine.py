"""The compiled decode step (`EngineConfig.compile`, `shared_model.compiled`) against the eager decoder.

The compiled forward's kernels may round differently from eager, so the checks are the issue's: logits within a
tolerance, and greedy tokens equal to the eager reference's argmax at every position (teacher-forced through the
plain decoder) unless the reference's logit for the compiled engine's token is within `NEAR_TIE` of its best.
One compiled engine serves the module (compiling takes tens of seconds); it runs under the exactness test's
pressure (chunked prefill, prefix caching, preemption, batches of mixed prefill and decode), speculative verify
steps included, and must never fall back to eager once warmed up.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import transformers

import tandem_native
from inference_svc.attention import native_cpu as cpu_attention
from inference_svc.engine import Engine, EngineConfig, SamplingParams
from inference_svc.engine.config import EngineConfigError
from inference_svc.engine.model_runner import ModelRunner
from inference_svc.engine.sequence import ScheduledSeq
from inference_svc.errors import ModelLoadError
from inference_svc.executor import prepare as executor_prepare
from inference_svc.executor.prepare import COMPILE_AUTO_MIN_PARAMS
from shared_model import compiled as compiled_module
from shared_model.attention import CAUSAL
from shared_model.bundle import load_bundle
from shared_model.compiled import CompiledDecoder, compiler_available
from shared_model.model import build_model
from shared_model.quantize import fake_quantized
from shared_model.serving_model import fuse_projections
from tests.conftest import tiny_config
from tests.inference_svc.engine.conftest import _save_model
from tests.inference_svc.engine.test_speculative_exactness import KnownContinuation

NEW_TOKENS = 16
NEAR_TIE = 1e-4  # logit units: fp32 kernels that only reorder sums differ by ~1e-6 here

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not compiler_available(torch.device("cpu"))[0], reason=compiler_available(torch.device("cpu"))[1]
    ),
]  # slow: compiles decoders (the full suite only)


@pytest.fixture(scope="module")
def compiled_engine(qwen3_dir) -> Engine:
    return Engine.from_bundle(
        qwen3_dir,
        EngineConfig(
            dtype="float32",
            compile="on",
            kv_cache_memory=14 * 16 * 2 * 2 * 32 * 4,  # 14 blocks of 16 tokens: preemption under the load below
            max_num_batched_tokens=64,
            prefill_chunk_size=24,
            max_num_seqs=8,
        ),
    )


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 33, 90)]
    return prompts + [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (3, 20)]


def _check_against_reference(reference, prompt: list[int], tokens: list[int], near_tie: float = NEAR_TIE) -> int:
    """Every token is the reference's argmax (or within `near_tie` of it); returns how many were near ties."""
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1 :]  # [n, vocab]
    near = 0
    for pos, tok in enumerate(tokens):
        best = int(logits[pos].argmax())
        if tok != best:
            gap = float(logits[pos, best] - logits[pos, tok])
            assert gap <= near_tie, f"position {pos}: token {tok} is {gap:.2e} below the reference's best {best}"
            near += 1
    return near


def test_compiled_engine_reports_its_warm_up(qwen3_dir, make_engine) -> None:
    engine = make_engine(qwen3_dir, compile="on")
    info = engine.info()
    assert info.compiled and info.compile_seconds > 0
    assert engine.runner.compiled is not None and engine.runner.compiled.eager_calls == 0
    assert engine.block_manager.num_used == 0  # the warm-up's throwaway sequences hold no blocks
    assert not engine.runner.cache.data.any()  # and left nothing in the cache
    assert info.peak_workspace_bytes == 0  # nor its steps' workspace in the service's figure


def test_compiled_engine_generates_the_eager_reference_tokens(compiled_engine, qwen3_dir) -> None:
    reference = load_bundle(qwen3_dir, dtype=torch.float32).model.eval()
    prompts = _prompts(3, compiled_engine.model_config.vocab_size)
    results = compiled_engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert compiled_engine.scheduler.counters.num_preemptions > 0  # the pressure was real
    near = sum(_check_against_reference(reference, p, r.token_ids) for p, r in zip(prompts, results, strict=True))
    assert near <= 2, f"{near} near ties in {len(prompts) * NEW_TOKENS} tokens"
    assert compiled_engine.runner.compiled.eager_calls == 0  # every step of every shape ran compiled


def test_compiled_speculative_greedy_equals_compiled_plain(compiled_engine) -> None:
    prompts = [[5, 6, 7, 8] * 6, list(range(10, 40))]
    plain = compiled_engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, num_speculative_tokens=0))
    spec = compiled_engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, num_speculative_tokens=4))
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert sum(r.usage.draft_tokens for r in spec) > 0  # verify steps (T = K + 1 rows) did run
    assert compiled_engine.runner.compiled.eager_calls == 0


@pytest.mark.skipif(cpu_attention.extension() is None, reason="needs Tandem's C++ CPU kernels")
def test_compiled_decode_steps_attend_in_cpp_with_the_python_backends_results(qwen3_dir, make_engine, monkeypatch):
    """The graph's C++ attention (`GraphDecode`: the cache and the step's metadata as graph inputs) serves exactly
    the decode-only steps, with no Python backend built for them, at every batch size and context length without a
    recompile, and gives bitwise the logits of an engine whose every step's attention calls the Python backend
    (through `tandem::attention`, the backend passed as the op's opaque argument)."""

    def recorded(engine) -> list[tuple[bool, torch.Tensor]]:
        runner = engine.runner
        run, factory = runner.run, runner.backend_factory
        steps: list[tuple[bool, torch.Tensor]] = []
        built: list[int] = []  # Python backends built by the step

        def counting_factory(cache, meta):
            built.append(1)
            return factory(cache, meta)

        def recording_run(batch):
            built.clear()
            out = run(batch)
            steps.append((not built, out.sample.clone()))  # (the step attended in C++, its logits)
            return out

        runner.backend_factory, runner.run = counting_factory, recording_run
        return steps

    prompts = [[5, 6, 7, 8] * 5, list(range(10, 47)), [3, 4, 5]]  # the last: one block (a table of width 1)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    # both runs: the same steps, every decode through the graph (the decode runner's own test is below)
    engine = make_engine(qwen3_dir, compile="on", enable_prefix_caching=False, decode_runner="off")
    assert engine.runner.graph_decode and engine.runner.native_decode is None
    steps = recorded(engine)
    in_cpp = engine.generate(prompts, params)
    in_graph = sum(decode for decode, _ in steps)
    assert in_graph >= (NEW_TOKENS - 1) // 2  # the decodes ran there (batched)
    assert in_graph < len(steps)  # prefill steps too, which must not
    assert engine.runner.compiled is not None and engine.runner.compiled.eager_calls == 0

    monkeypatch.setattr(cpu_attention.GraphDecode, "serves", staticmethod(lambda cache: False))
    python = make_engine(qwen3_dir, compile="on", enable_prefix_caching=False, decode_runner="off")  # all Python
    assert not python.runner.graph_decode
    python_steps = recorded(python)
    in_python = python.generate(prompts, params)
    assert not any(decode for decode, _ in python_steps)
    assert [r.token_ids for r in in_python] == [r.token_ids for r in in_cpp]
    assert len(python_steps) == len(steps)
    for i, ((decode, a), (_, b)) in enumerate(zip(steps, python_steps, strict=True)):
        assert torch.equal(a, b), f"step {i} ({'decode' if decode else 'prefill'}) differs"
    assert python.runner.compiled is not None and python.runner.compiled.eager_calls == 0


@pytest.mark.skipif(not tandem_native.available(), reason="needs AVX-512 VNNI and a C++ compiler")
@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_the_decode_runner_takes_the_decode_steps_within_the_graphs_tolerance(
    qwen3_dir, make_engine, dtype: str, tol: float
) -> None:
    """Where it serves the model (the default), the decode runner runs the decode-only steps of up to its rows (those
    the projections' table runs Tandem's kernels for: `row_gemm`'s 2 for fp32 without speculation; bf16 on AMX up to
    `tile_gemm`'s last row, so the 3-row decodes too), the graph the longer ones and the prefills; its logits are
    within the compiled step's tolerance of an engine whose graph runs every step, the tokens the same, nothing falls
    back to eager, and the plan says which steps it takes, the LM head among them."""

    def recorded(engine) -> tuple[list[torch.Tensor], list[int]]:
        runner, run = engine.runner, engine.runner.run
        logits: list[torch.Tensor] = []
        native_rows: list[int] = []
        native = runner.native_decode
        if native is not None:  # the steps it takes, with the LM head (`logits`) or without
            for name in ("hidden_states", "logits"):
                method = getattr(native, name)

                def counted(input_ids, *args, method=method):
                    native_rows.append(int(input_ids.shape[0]))
                    return method(input_ids, *args)

                setattr(native, name, counted)

        def recording_run(batch):
            out = run(batch)
            logits.append(out.sample.clone())
            return out

        runner.run = recording_run
        return logits, native_rows

    prompts = [[5, 6, 7, 8] * 5, list(range(10, 47)), [3, 4, 5]]
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    engines = [make_engine(qwen3_dir, dtype=dtype, compile="on", enable_prefix_caching=False, decode_runner=mode)
               for mode in ("auto", "off")]  # fmt: skip
    plans = [{c.lever: c for c in e.load_plan.choices}["decode_runner"] for e in engines]
    compiled = engines[0].runner.compiled
    assert compiled is not None and compiled.row_table is not None
    bounds = compiled.row_table.gemm_bounds()
    assert bounds is not None
    most = bounds[1]  # row_gemm's rows, then tile_gemm's where the table has tiles
    assert most == 2 or (dtype == "bfloat16" and most > 3)
    assert plans[0].value == f"1-{most} rows" and "decoder and its LM head as one C++ call" in plans[0].reason
    assert engines[0].runner.native_decode.has_lm_head  # every decode-only step samples every row
    assert plans[1].value == "off" and engines[1].runner.native_decode is None
    runs = [recorded(e) for e in engines]
    outputs = [[r.token_ids for n in (3, 2, 1) for r in e.generate(prompts[:n], params)] for e in engines]
    assert outputs[0] == outputs[1]
    (logits, native_rows), (graph_logits, _) = runs
    assert sorted(set(native_rows)) == [r for r in (1, 2, 3) if r <= most] and len(native_rows) >= 2 * NEW_TOKENS - 2
    assert len(logits) == len(graph_logits) > len(native_rows)  # the same steps; the prefills (and longer): graph
    for i, (a, b) in enumerate(zip(logits, graph_logits, strict=True)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"step {i}")
    assert all(e.runner.compiled is not None and e.runner.compiled.eager_calls == 0 for e in engines)


@pytest.fixture(scope="module")
def wide_qwen3_dir(tmp_path_factory, small_tokenizer):
    """A 4-layer qwen3 of the `mini` preset's widths (hidden 512, head_dim 64, GQA 8/4, vocab 8192, tied): there
    inductor fuses the T == 1 graph's bf16 ops otherwise than the T >= 2 graph's (the tiny model's do not show it)."""
    cfg = transformers.Qwen3Config(
        vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, intermediate_size=1536, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_theta=10000.0, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(4)
    model = transformers.Qwen3ForCausalLM(cfg)
    return _save_model(tmp_path_factory.mktemp("wide"), "qwen3-wide", model, small_tokenizer)


@pytest.mark.skipif(not tandem_native.available(), reason="needs AVX-512 VNNI and a C++ compiler")
@pytest.mark.parametrize(("model", "decode_runner"), [("qwen3_dir", "auto"), ("wide_qwen3_dir", "auto"),
                                                    ("wide_qwen3_dir", "off")])  # fmt: skip
def test_compiled_verify_rows_are_bitwise_the_rows_of_plain_decode_steps(model, decode_runner, make_engine,
                                                                         request) -> None:  # fmt: skip
    """Compiled on CPU, a verify step's K + 1 rows run the row kernel, whose arithmetic per row does not depend on
    the row count (`serving_model`), the decode attention, whose arithmetic per row is a plain decode's, and
    generated kernels that round each op's bf16 result as eager does (`shared_model.compiled`): so each verify
    row's logits are bitwise those of decoding its token alone. In bf16, where torch's matmul of K + 1 rows, or
    the T == 1 and T >= 2 graphs' different fusions, would round otherwise. The decode runner (on by default), which
    takes both kinds of step here (up to 17 rows), keeps the property with its own per-row arithmetic; with it off
    the graph runs both."""
    # no prefix cache: the plain run's prompt would be cached for the speculative one, whose last prompt tokens
    # would then run as a short chunk (the row kernel) where the plain run's ran in the prefill GEMM (bf16: other bits)
    engine = make_engine(request.getfixturevalue(model), dtype="bfloat16", compile="on", speculative="ngram",
                         speculative_max_batch=0, speculative_verify_cost=0.0, enable_prefix_caching=False,
                         decode_runner=decode_runner)  # fmt: skip
    runner, run = engine.runner, engine.runner.run
    assert (runner.native_decode is not None) == (decode_runner == "auto")
    checked: list[int] = []

    def checked_run(batch):
        out = run(batch)
        if len(batch) == 1 and batch[0].draft:
            b = batch[0]
            for j in range(len(b.draft) + 1):  # each row alone, in place (it rewrites its own K/V slot)
                alone = run([ScheduledSeq(b.seq, b.start + j, 1, draft=b.draft[:j])]).sample  # [1, vocab]
                assert torch.equal(alone[0], out.sample[j]), f"verify row {j} of {len(b.draft) + 1}"
            checked.append(len(b.draft))
        return out

    prompt = [5, 6, 7, 8] * 6
    plain = engine.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, num_speculative_tokens=0))
    vocab = engine.model_config.vocab_size  # drafts that know the output, every 5th token wrong
    engine.scheduler.speculator.proposer = KnownContinuation([prompt], [plain[0].token_ids], 5, vocab)
    runner.run = checked_run
    spec = engine.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS))
    assert checked and max(checked) > 1  # verify steps with drafts ran
    assert spec[0].token_ids == plain[0].token_ids
    assert runner.compiled is not None and runner.compiled.eager_calls == 0


def test_compiled_decoder_logits_match_eager_within_tolerance(qwen3_dir) -> None:
    model = load_bundle(qwen3_dir, dtype=torch.float32).model.eval()
    decoder = CompiledDecoder(fuse_projections(model))  # compiled serving decoder against the plain one
    with torch.inference_mode():  # as the engine runs it (inference tensors: guards check the dispatch keys)
        ids = torch.randint(3, model.config.vocab_size, (1, 23))
        pos = torch.arange(23)[None]
        want = model.hidden_states(ids, pos, CAUSAL)
        short_ids, short_pos = ids[0, :9][None], pos[0, :9][None]

        def both() -> None:  # a prefill longer than ROW_KERNEL_MAX_ROWS and a short chunk: the row kernel's branch
            decoder.hidden_states(ids, pos, CAUSAL)
            decoder.hidden_states(short_ids, short_pos, CAUSAL)

        decoder.warm_up(both)
        shorter = decoder.hidden_states(short_ids, short_pos, CAUSAL)
        got = decoder.hidden_states(ids, pos, CAUSAL)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shorter, want[:, :9], atol=1e-5, rtol=1e-5)
    assert decoder.eager_calls == 0


def test_two_compiled_decoders_of_one_architecture_each_run_their_own_weights() -> None:
    """Dynamo's guards on module state are dropped (`shared_model.compiled`): two decoders of the same architecture
    (a target and a same-shaped draft, two engines in one process) share the code object's cache, and each call
    must still run its own graph over its own weights, alternating, with no recompile."""
    models = [fuse_projections(build_model(tiny_config(), seed=seed).eval()) for seed in (0, 1)]
    decoders = [CompiledDecoder(m) for m in models]
    with torch.inference_mode():
        ids = torch.randint(3, models[0].config.vocab_size, (1, 7))
        pos = torch.arange(7)[None]
        want = [m.hidden_states(ids, pos, CAUSAL) for m in models]
        for d in decoders:
            d.warm_up(lambda d=d: d.hidden_states(ids, pos, CAUSAL))
        for _ in range(2):
            for d, w in zip(decoders, want, strict=True):
                torch.testing.assert_close(d.hidden_states(ids, pos, CAUSAL), w, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want[0], want[1])
    assert all(d.eager_calls == 0 for d in decoders)
    assert "guard_filter_fn" in compiled_module._OPTIONS  # torch.compile pops it from the dict it gets: a copy each


def test_compile_auto_leaves_a_small_model_eager(qwen3_dir, make_engine) -> None:
    engine = make_engine(qwen3_dir, compile="auto")
    assert sum(p.numel() for p in engine.runner.model.parameters()) < COMPILE_AUTO_MIN_PARAMS
    assert not engine.info().compiled and engine.runner.compiled is None and engine.info().compile_seconds == 0


def test_compile_on_without_a_compiler_is_refused(qwen3_dir, make_engine, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no g++, clang++ or c++
    monkeypatch.delenv("CXX", raising=False)
    assert not os.listdir(tmp_path)
    with pytest.raises(ModelLoadError, match=r"compile: .*no C\+\+ compiler"):
        make_engine(qwen3_dir, compile="on")
    monkeypatch.setattr(executor_prepare, "COMPILE_AUTO_MIN_PARAMS", 0)  # large enough for auto: the compiler decides
    assert not make_engine(qwen3_dir, compile="auto").info().compiled


def test_compile_auto_is_a_rule_and_the_plan_says_which(qwen3_dir, make_engine, monkeypatch) -> None:
    """'auto' compiles by the size rule, with no timing at start-up: the same flags give the same plan, and the
    plan's `compile` choice names the rule it applied."""
    small = [make_engine(qwen3_dir, compile="auto").info().load_plan for _ in range(2)]
    assert small[0] == small[1] and small[0].value("compile") == "off"
    assert "parameters <" in next(c.reason for c in small[0] if c.lever == "compile")
    monkeypatch.setattr(executor_prepare, "COMPILE_AUTO_MIN_PARAMS", 0)
    big = make_engine(qwen3_dir, compile="auto")
    assert big.info().compiled and big.runner.compiled is not None and big.info().compile_seconds > 0
    choice = next(c for c in big.info().load_plan if c.lever == "compile")
    assert choice.value == "on" and choice.reason.startswith("--compile auto:")
    assert not hasattr(ModelRunner, "probe")  # nothing left that could time the two forwards at start


def test_a_failed_auto_compile_runs_eagerly_and_the_plan_says_why(qwen3_dir, make_engine, monkeypatch) -> None:
    """A compile that fails at warm-up under 'auto' leaves every step eager (the eager engine's tokens), and the
    plan records the failure; under 'on' it is refused."""

    def failing_warm_up(self, run, packages=None) -> float:
        raise RuntimeError("inductor exploded")

    monkeypatch.setattr(executor_prepare, "COMPILE_AUTO_MIN_PARAMS", 0)
    monkeypatch.setattr(CompiledDecoder, "warm_up", failing_warm_up)
    engine = make_engine(qwen3_dir, compile="auto")
    assert engine.runner.compiled is None and not engine.info().compiled
    choice = next(c for c in engine.info().load_plan if c.lever == "compile")
    assert choice.value == "off" and "inductor exploded" in choice.reason
    assert all("row_gemm" not in c.value for c in engine.info().load_plan)  # the row kernels left with the graph
    prompts = [list(range(20, 50)), [7, 8, 9] * 5]
    want = make_engine(qwen3_dir, compile="off").generate(prompts, SamplingParams(max_new_tokens=8))
    got = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    with pytest.raises(ModelLoadError, match="inductor exploded"):
        make_engine(qwen3_dir, compile="on")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_compiled_quantized_engine_covers_every_step_shape(qwen3_dir, make_engine, kind: str) -> None:
    """Quantized projections branch on the row count (packed kernel up to PACKED_MAX_ROWS rows): batched decodes
    of 2..7 sequences, chunks and 4-row verify steps must all run compiled, with the eager reference's tokens."""
    engine = make_engine(qwen3_dir, quantization=kind, compile="on", max_num_batched_tokens=64, prefill_chunk_size=24)
    prompts = _prompts(5, engine.model_config.vocab_size)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=8, num_speculative_tokens=3))
    assert engine.runner.compiled is not None and engine.runner.compiled.eager_calls == 0
    reference = fake_quantized(load_bundle(qwen3_dir, dtype=torch.float32).model, kind).eval()
    pairs = zip(prompts, results, strict=True)
    near = sum(_check_against_reference(reference, p, r.token_ids, near_tie=0.15) for p, r in pairs)
    assert near <= 4, f"{near} near ties in {len(prompts) * 8} tokens"


def test_compile_mode_is_validated() -> None:
    with pytest.raises(EngineConfigError, match="compile: must be one of auto, on, off"):
        EngineConfig(compile="fast")


def test_a_compiled_draft_model_runs_compiled_and_keeps_the_output(llama_dir, qwen3_dir, make_engine) -> None:
    """`--speculative DRAFT_DIR` with `--compile on`: both runners are compiled at start-up, the draft's catch-up
    chunks and one-token steps and the target's verify steps all run compiled, and greedy output is plain
    decoding's (the eager reference engine, no draft)."""
    prompts = _prompts(9, 512)[:4]
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    plain = [r.token_ids for r in make_engine(llama_dir).generate(prompts, params)]
    spec = make_engine(llama_dir, speculative=str(qwen3_dir), speculative_verify_cost=0.0, compile="on")
    assert spec.runner.compiled is not None and spec.draft_runner is not None
    assert spec.draft_runner.compiled is not None
    got = spec.generate(prompts, params)
    assert sum(r.usage.draft_tokens for r in got) > 0
    near = sum(
        _check_against_reference(load_bundle(llama_dir, dtype=torch.float32).model.eval(), p, r.token_ids)
        for p, r in zip(prompts, got, strict=True)
    )
    assert near <= 1
    if near == 0:  # no token excused: the very tokens of plain decoding
        assert [r.token_ids for r in got] == plain
    assert spec.runner.compiled.eager_calls == 0 and spec.draft_runner.compiled.eager_calls == 0
