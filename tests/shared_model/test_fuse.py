"""Merged projections (`shared_model.serving_model`) leave the decoder's output bit-identical, for every architecture
variant, dtype and step length, and leave the state dict (names and values) as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tandem_native
from shared_model.attention import CAUSAL
from shared_model.config import RopeScaling
from shared_model.model import build_model
from shared_model.serving_model import (
    DOT_MAX_ROWS,
    PLAIN_TABLE,
    ROW_KERNEL_MAX_ROWS,
    TILE_MAX_ROWS,
    RowTable,
    ServingLinear,
    compiled_row_table,
    fp32_onednn,
    fuse_projections,
    set_row_kernels,
)
from tests.conftest import tiny_config

CONFIGS = {
    "qwen3": tiny_config(),
    "llama": tiny_config(model_type="llama", qk_norm=False),
    "qwen2-bias": tiny_config(model_type="qwen2", qk_norm=False, attention_bias=True),
    "llama3-scaled": tiny_config(model_type="llama", qk_norm=False, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)),
    "gqa3-headdim": tiny_config(num_heads=6, num_kv_heads=2, head_dim=24),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_merged_projections_are_bitwise_equal_to_the_plain_decoder(name: str, dtype: torch.dtype) -> None:
    cfg = CONFIGS[name]
    fused = fuse_projections(build_model(cfg, dtype=dtype, seed=0))
    reference = build_model(cfg, dtype=dtype, seed=0)
    gen = torch.Generator().manual_seed(0)
    for b, t in ((1, 1), (2, 1), (2, 5), (2, 33)):  # (1, 1): a batch-1 decode step, the GEMV path in bf16
        ids = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
        pos = torch.arange(100, 100 + t).expand(b, t)
        with torch.inference_mode():
            got = fused(ids, pos, CAUSAL)
            want = reference(ids, pos, CAUSAL)
        assert torch.equal(got, want), f"{name} {dtype} {b}x{t}: max |Δ| {(got.float() - want.float()).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1280, 768), (768, 768), (4096, 768), (768, 2048), (8192, 768), (151, 96)])
def test_eager_serving_linear_returns_the_bits_of_f_linear(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """Eager serving runs the training decoder's kernel at decode shapes of real models (and an odd one), one row
    included: a GEMV special case (bf16 `torch.mv` once was one) differed from `F.linear` on an AMD Zen 4 at
    768 x 2048 for about one weight in eight."""
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(shape, generator=gen) * shape[1] ** -0.5)
    serving = ServingLinear.sharing(linear)
    assert serving.weight is linear.weight and serving.method() == ("linear", "every row count: F.linear")
    for _ in range(4):
        for x in (torch.randn(1, 1, shape[1], generator=gen), torch.randn(3, shape[1], generator=gen)):
            with torch.inference_mode():
                got, want = serving(x.to(dtype)), torch.nn.functional.linear(x.to(dtype), linear.weight)
            assert got.shape == want.shape and torch.equal(got, want)


def test_state_dict_keeps_its_names_and_values_and_shares_the_merged_memory() -> None:
    cfg = tiny_config()
    model = build_model(cfg, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    decoder = fuse_projections(model)
    assert fuse_projections(decoder) is decoder  # idempotent
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    attn, mlp, layer = model.model.layers[0].self_attn, model.model.layers[0].mlp, decoder.layers[0]
    assert attn.k_proj.weight.data_ptr() == layer.qkv.weight[cfg.q_size :].data_ptr()  # a view, not a copy
    assert mlp.up_proj.weight.data_ptr() == layer.gate_up.weight[cfg.intermediate_size :].data_ptr()
    assert not any(p.requires_grad for p in (attn.q_proj.weight, attn.v_proj.weight, mlp.gate_proj.weight))
    # the rest is the training model's own Parameters, not copies
    assert (
        decoder.embed_tokens.weight is model.model.embed_tokens.weight
        and decoder.lm_head.weight is model.lm_head.weight
    )
    assert layer.input_norm is model.model.layers[0].input_layernorm.weight


def _tables() -> list:
    """(id, dtype, table) of every compiled row table this machine can run."""
    out = []
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        out.append((f"{name}-exact-verify", dtype, compiled_row_table(dtype, tiles=False, exact_verify=True)))
        out.append((f"{name}-fma", dtype, compiled_row_table(dtype, tiles=False, exact_verify=False)))
    if tandem_native.tiles():
        out.append(("bf16-tiles", torch.bfloat16, compiled_row_table(torch.bfloat16, tiles=True, exact_verify=False)))
    elif tandem_native.dot_bf16():  # table_gemm runs dot_gemm for the same rows only where AMX tiles do not run
        dot = compiled_row_table(torch.bfloat16, tiles=False, exact_verify=False, dot=True)
        out.append(("bf16-dot", torch.bfloat16, dot))
    if torch.backends.mkldnn.is_available():  # the many-row fp32 product through oneDNN (`fp32_onednn`'s rule)
        out.append(("fp32-onednn", torch.float32, compiled_row_table(torch.float32, False, False, onednn=True)))
    return out


def _more(table: RowTable, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [rows, in] through the kernel a table runs past its last step: F.linear, or oneDNN's matmul."""
    if table.more == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return F.linear(x, w)


@pytest.mark.skipif(not tandem_native.available(), reason="needs AVX-512 VNNI and a C++ compiler")
@pytest.mark.parametrize(("dtype", "table"), [t[1:] for t in _tables()], ids=[t[0] for t in _tables()])
def test_row_kernels_are_the_compiled_steps_choice_and_give_each_row_the_same_bits_at_any_row_count(
    dtype: torch.dtype, table: RowTable
) -> None:
    model = fuse_projections(build_model(tiny_config(), dtype=dtype, seed=0))
    assert set_row_kernels(model, table) == 4 * model.config.num_layers + 1  # qkv, o, gate/up, down; the LM head
    head = model.lm_head
    assert head.row_table is table
    most = table.largest_step
    with torch.inference_mode():  # serving: no autograd through the kernel
        x = torch.randn(most + 1, model.config.hidden_size, dtype=dtype)
        exact = x.double() @ head.weight.double().t()  # [most + 1, vocab]
        bound = (2**-7 if dtype == torch.bfloat16 else 1e-5) * exact.abs().max().item()  # fp32 sums, one rounding
        low = 1
        for top, kernel in table.steps:  # within each step of the table: one kernel, each row's bits at any count
            full = head(x[:top]).float()  # one call of `top` rows
            assert (full - exact[:top]).abs().max().item() <= bound, kernel
            for count in sorted({low, top}):  # the last `count` rows alone: the same bits
                assert torch.equal(head(x[top - count : top]).float(), full[top - count :]), (kernel, count)
            low = top + 1
        assert torch.equal(head(x[None, : min(most, 5)]).float()[0], head(x[: min(most, 5)]).float())  # [B, T, hidden]
        past = head(x)  # one row more than the table's last step: F.linear, or oneDNN's matmul
        assert torch.equal(past, _more(table, x, head.weight))
        assert (past.double() - exact).abs().max().item() <= bound
        torch._dynamo.reset()  # each table's graphs are new entries of ServingLinear.forward: no recompile limit
        compiled = torch.compile(head, fullgraph=True)  # the custom ops do not break the graph
        assert torch.equal(compiled(x[:1]), head(x[:1]))
        assert torch.equal(compiled(x[:most]), head(x[:most]))
        assert set_row_kernels(model, None) == 0 and head.row_table is None
        assert torch.equal(head(x[:1]), F.linear(x[:1], head.weight))  # the eager path's bit-equality is back


@pytest.mark.skipif(not tandem_native.available(), reason="needs AVX-512 VNNI and a C++ compiler")
@pytest.mark.parametrize(("dtype", "table"), [t[1:] for t in _tables()], ids=[t[0] for t in _tables()])
def test_a_compiled_row_table_is_one_graph_for_every_row_count_with_each_kernels_bits(
    dtype: torch.dtype, table: RowTable
) -> None:
    """The table's kernel is chosen inside `tandem::table_gemm`, not by a Python branch a graph traces: a projection
    traced with a dynamic row count compiles once for every T >= 2 (a cold start compiles fewer graphs), and each
    row count still gets the bits of the kernel the table names for it."""
    from torch._dynamo.testing import CompileCounter

    model = fuse_projections(build_model(tiny_config(), dtype=dtype, seed=0))
    set_row_kernels(model, table)
    head = model.lm_head
    assert head.row_bounds() == () and table.gemm_bounds() is not None
    kernels = {ops: getattr(torch.ops.tandem, ops) for ops in ("row_gemm", "tile_gemm", "dot_gemm")}
    most = table.largest_step
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(head, backend=counter, fullgraph=True)
    with torch.inference_mode():
        x = torch.randn(most + 3, 1, model.config.hidden_size, dtype=dtype)  # [rows, 1, hidden]
        for rows in sorted({2, 3, most, most + 1, most + 3}):
            xs = x[:rows].clone()
            torch._dynamo.maybe_mark_dynamic(xs, 0)
            kernel = table.kernel(rows)
            run = kernels.get(kernel, lambda x, w: _more(table, x, w))
            want = run(xs[:, 0], head.weight)[:, None]
            assert torch.equal(compiled(xs), want), (rows, kernel)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs: a row count branched in the graph"
    set_row_kernels(model, None)
    assert head.row_bounds() == () and head.table == PLAIN_TABLE  # eager: F.linear for every row count


@pytest.mark.skipif(not tandem_native.available(), reason="needs AVX-512 VNNI and a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "k"), [(256, 64), (203, 96), (3, 32), (13, 32)])
def test_row_gemm_gives_one_row_the_bits_it_has_among_others_at_any_weight_height(
    dtype: torch.dtype, n: int, k: int
) -> None:
    """One activation row takes passes of more weight rows than a call of several rows does (more cache lines in
    flight); weight rows past the last whole pass repeat the last real row. Each output is still the same sums in
    the same order: one row alone has the bits it has inside a call of 2-5 rows, near the exact product."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(5, k, generator=gen).to(dtype)
    with torch.inference_mode():
        exact = x.double() @ w.double().t()  # [5, n]
        full = torch.ops.tandem.row_gemm(x, w)  # [5, n]
        bound = (2**-7 if dtype == torch.bfloat16 else 1e-5) * exact.abs().max().item()
        assert (full.double() - exact).abs().max().item() <= bound
        for i in range(5):
            assert torch.equal(torch.ops.tandem.row_gemm(x[i : i + 1], w), full[i : i + 1]), i
        assert torch.equal(torch.ops.tandem.row_gemm(x[1:4], w), full[1:4])


@pytest.mark.skipif(not tandem_native.available(), reason="needs AVX-512 VNNI and a C++ compiler")
@pytest.mark.parametrize("rows", [1, 3])
def test_passes_split_over_threads_give_the_bits_of_one_thread(rows: int) -> None:
    """The row kernels split their passes over the intra-op threads, a thread done with its share taking passes from
    the back of another's (balanced.h): more threads than cores (so a thread often waits for its core and the others
    take its passes), many calls, and every output is still the one thread's bits: no pass lost or computed with
    another pass's rows."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1283, 256, generator=gen)
    x = torch.randn(rows, 256, generator=gen)
    q = torch.randint(-127, 128, (1283, 256), dtype=torch.int8, generator=gen)
    scales = torch.rand(1283, generator=gen) / 100
    calls = {
        "row_gemm fp32": lambda: torch.ops.tandem.row_gemm(x, w),
        "row_gemm bf16": lambda: torch.ops.tandem.row_gemm(x.bfloat16(), w.bfloat16()),
        "int8_gemv": lambda: torch.ops.tandem.int8_gemv(x, q, scales, 64),
    }
    if tandem_native.dot_bf16():
        calls["dot_gemm"] = lambda: torch.ops.tandem.dot_gemm(x.bfloat16(), w.bfloat16())
    threads = torch.get_num_threads()
    with torch.inference_mode():
        torch.set_num_threads(1)
        try:
            alone = {name: call() for name, call in calls.items()}
            torch.set_num_threads(5)
            for _ in range(20):
                for name, call in calls.items():
                    assert torch.equal(call(), alone[name]), name
        finally:
            torch.set_num_threads(threads)


_MANY_ROW_KERNELS = [
    pytest.param(
        "tile_gemm",
        "x and w must both be bf16",
        marks=pytest.mark.skipif(not tandem_native.tiles(), reason="needs AMX-BF16 tiles this process may use"),
    ),
    pytest.param(
        "dot_gemm",
        "x and w must be bf16",
        marks=pytest.mark.skipif(not tandem_native.dot_bf16(), reason="needs a CPU with AVX512_BF16"),
    ),
]


@pytest.mark.parametrize(("kernel", "refusal"), _MANY_ROW_KERNELS)
@pytest.mark.parametrize(("n", "k"), [(256, 64), (203, 96), (3, 32), (40, 32)])
def test_many_row_kernels_match_the_exact_product_and_each_row_keeps_its_bits_at_any_row_count(
    kernel: str, refusal: str, n: int, k: int
) -> None:
    """tile_gemm: up to 64 rows share one read of the weight (four activation tiles), more take passes of 64, weight
    rows past the last whole tile of 16 run the FMA kernel. dot_gemm: blocks of 4 weight rows x 4 activation rows,
    a block short of either repeating its last real row, the sums across lanes one tree for every output. Every row:
    its own bits, whatever else is in the call."""
    op = getattr(torch.ops.tandem, kernel)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(70, k, generator=gen).bfloat16()
    with torch.inference_mode():
        exact = x.double() @ w.double().t()
        full = op(x, w)  # [70, n]
        assert full.dtype == torch.bfloat16 and full.shape == (70, n)
        assert (full.double() - exact).abs().max().item() <= 2**-7 * exact.abs().max().item()
        for lo, hi in ((0, 1), (3, 4), (0, 5), (10, 26), (0, 64), (1, 64), (5, 70)):
            assert torch.equal(op(x[lo:hi], w), full[lo:hi]), (lo, hi)
        with pytest.raises(RuntimeError, match=f"{kernel}: {refusal}"):
            op(x.float(), w.float())


def test_row_table_describes_itself_and_the_compiled_rule() -> None:
    table = compiled_row_table(torch.bfloat16, tiles=True, exact_verify=False)
    bound = TILE_MAX_ROWS
    assert [table.kernel(r) for r in (1, 2, 3, bound, bound + 1)] == ["row_gemm"] * 2 + ["tile_gemm"] * 2 + ["linear"]
    assert table.describe() == f"1-2 rows: tandem::row_gemm; 3-{bound} rows: tandem::tile_gemm; more: F.linear"
    exact = compiled_row_table(torch.bfloat16, tiles=True, exact_verify=True)  # verify rows as decode rows score
    assert exact.steps == ((ROW_KERNEL_MAX_ROWS, "row_gemm"),)
    assert compiled_row_table(torch.float32, tiles=True, exact_verify=False).steps == ((2, "row_gemm"),)
    dot = compiled_row_table(torch.bfloat16, tiles=False, exact_verify=False, dot=True)  # AVX512_BF16 without AMX
    assert dot.describe() == f"1-2 rows: tandem::row_gemm; 3-{DOT_MAX_ROWS} rows: tandem::dot_gemm; more: F.linear"
    assert dot.gemm_bounds() == (2, DOT_MAX_ROWS)
    assert compiled_row_table(torch.float32, tiles=False, exact_verify=False, dot=True).steps == ((2, "row_gemm"),)
    onednn = compiled_row_table(torch.float32, tiles=False, exact_verify=False, onednn=True)
    assert onednn.describe() == "1-2 rows: tandem::row_gemm; more: oneDNN matmul" and onednn.gemm_bounds() == (2, 2)
    verify = compiled_row_table(torch.float32, tiles=False, exact_verify=True, onednn=True)
    assert verify.more == "onednn" and verify.steps == ((ROW_KERNEL_MAX_ROWS, "row_gemm"),)
    assert compiled_row_table(torch.bfloat16, tiles=False, exact_verify=False, onednn=True).more == "linear"
    assert fp32_onednn("AuthenticAMD") == torch.backends.mkldnn.is_available()  # MKL's generic path: oneDNN
    assert not fp32_onednn("GenuineIntel")  # MKL's sgemm keeps Intel's CPUs
    no_steps = ServingLinear(64, 32, bias=False)
    no_steps.row_table = RowTable((), "onednn")  # a table table_gemm does not run: the kernel from Python
    x = torch.randn(5, 64)
    assert no_steps.row_bounds() == () and torch.equal(no_steps(x), _more(no_steps.row_table, x, no_steps.weight))
    assert RowTable().describe() == "every row count: F.linear"
    linear = ServingLinear(64, 32, bias=False, dtype=torch.bfloat16)
    assert linear.method() == ("linear", "every row count: F.linear")
