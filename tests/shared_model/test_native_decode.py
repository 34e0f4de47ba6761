"""The decode runner (`shared_model.native_decode`, `tandem_native/csrc/decode_runner.cpp`) against the serving
decoder it replaces for decode-only steps, dense and quantized: the same hidden states within the compiled
step's tolerance, the same K/V written, a row's bits independent of the other rows of its step, and refusals before
anything is written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tandem_native
from inference_svc.attention.native_cpu import GraphDecode
from inference_svc.attention.paged import AttentionMetadata
from inference_svc.engine.kv_cache import KVCache
from shared_model.model import CausalLM
from shared_model.native_decode import NativeDecode
from shared_model.quantize import QuantizedLinear, quantize_weights
from shared_model.serving_model import (
    RowTable,
    ServingDecoder,
    compiled_row_table,
    fuse_projections,
    set_row_kernels,
)
from tests.conftest import tiny_config

pytestmark = pytest.mark.skipif(not tandem_native.available(), reason="Tandem's native library does not run here")

BLOCK = 16
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
"""Largest difference from the serving decoder allowed, relative to the hidden states' largest magnitude."""


def _model(dtype: torch.dtype, **overrides) -> ServingDecoder:
    torch.manual_seed(0)
    config = tiny_config(**{"hidden_size": 64, "intermediate_size": 96, **overrides})
    model = CausalLM(config).to(dtype).eval()
    with torch.no_grad():  # norms away from one, so a wrong weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return fuse_projections(model)


class _Step:
    """A decode-only step over a cache whose earlier context is random: `rows` (sequence, position) queries, each
    over its sequence's tokens up to and including its own. `cache`: another step's, to decode on after it."""

    def __init__(self, model: ServingDecoder, rows: list[tuple[int, int]], ids: list[int] | None = None,
                 cache: KVCache | None = None) -> None:  # fmt: skip
        c = model.config
        dtype = model.embed_tokens.weight.dtype
        g = torch.Generator().manual_seed(1)
        if cache is None:
            shape = (c.num_layers, 32, BLOCK, c.num_kv_heads, c.head_dim)
            cache = KVCache.allocate(*shape, dtype, torch.device("cpu"))
            cache.data.copy_(torch.randn(cache.data.shape, generator=g).to(dtype))
        self.cache = cache
        tables = [[3 + 8 * s + b for b in range(8)][::-1] for s in range(3)]  # sequence s: 8 blocks, out of order
        self.ids = torch.tensor(ids) if ids is not None else torch.randint(0, c.vocab_size, (len(rows),), generator=g)
        self.positions = torch.tensor([p for _, p in rows])
        slots = [tables[s][p // BLOCK] * BLOCK + p % BLOCK for s, p in rows]
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), num_decode_tokens=len(rows),
            decode_context_lens=torch.tensor([p + 1 for _, p in rows], dtype=torch.int32),
            decode_block_tables=torch.tensor([tables[s] for s, _ in rows], dtype=torch.int32),
            cu_seqlens_q=torch.zeros(1, dtype=torch.int32), prefill_context_lens=torch.zeros(0, dtype=torch.int32),
            prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        )  # fmt: skip

    def native(self, runner: NativeDecode) -> torch.Tensor:
        m = self.meta
        return runner.hidden_states(self.ids, self.positions, self.cache.data, m.slot_mapping,
                                    m.decode_context_lens, m.decode_block_tables)  # fmt: skip

    def logits(self, runner: NativeDecode) -> torch.Tensor:
        m = self.meta
        return runner.logits(self.ids, self.positions, self.cache.data, m.slot_mapping, m.decode_context_lens,
                             m.decode_block_tables)  # fmt: skip

    def reference(self, model: ServingDecoder) -> torch.Tensor:
        return model.hidden_states(self.ids[None], self.positions[None], GraphDecode(self.cache, self.meta))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_the_runner_computes_the_serving_decoders_step(dtype: torch.dtype, qk_norm: bool) -> None:
    """Three sequences, a verify-shaped run of four consecutive positions among them: hidden states within the
    tolerance and every layer's K/V stored as the decoder stores them (V exactly: it is a projection's output)."""
    model = _model(dtype, qk_norm=qk_norm)
    rows = [(0, 40), (1, 70), (1, 71), (1, 72), (1, 73), (2, 5)]
    ours, theirs = _Step(model, rows), _Step(model, rows)
    with torch.inference_mode():
        got = ours.native(NativeDecode(model, 17))
        want = theirs.reference(model)
    assert got.shape == want.shape and got.dtype == dtype
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= TOL[dtype] * scale
    k_got, k_want = ours.cache.data[:, 0].float(), theirs.cache.data[:, 0].float()
    assert (k_got - k_want).abs().max() <= TOL[dtype] * k_want.abs().max()
    # V is layer 0's projection of the same embedding: row_gemm's sums against F.linear's
    assert torch.allclose(ours.cache.data[0, 1].float(), theirs.cache.data[0, 1].float(), rtol=TOL[dtype], atol=1e-3)
    untouched = torch.ones(ours.cache.data.shape[2:4], dtype=torch.bool)  # [num_blocks, block_size]
    for slot in ours.meta.slot_mapping.tolist():
        untouched[slot // BLOCK, slot % BLOCK] = False
    assert torch.equal(ours.cache.data[:, :, untouched], theirs.cache.data[:, :, untouched])


@pytest.mark.skipif(
    not (tandem_native.tiles() or tandem_native.dot_bf16()), reason="needs AMX-BF16 tiles or AVX512_BF16"
)
def test_a_many_row_step_runs_the_tables_many_row_kernel_as_the_decoder_does() -> None:
    """bf16 under the compiled step's row table for this CPU (`tile_gemm` with AMX, else `dot_gemm`): a step of up to
    39 rows (past `row_gemm`'s rows: the many-row kernel's) through the runner is the serving decoder's step under the
    same table, within the tolerance, with the K/V stored as it stores them; the runner takes the table's rows, no
    more."""
    model = _model(torch.bfloat16)
    tiles = tandem_native.tiles()
    table = compiled_row_table(torch.bfloat16, tiles=tiles, exact_verify=False, dot=not tiles)
    bounds = table.gemm_bounds()
    per = min(13, bounds[1] // 3) if bounds is not None else 0  # queries in each of 3 sequences
    assert bounds is not None and bounds[0] < 3 * per <= bounds[1]
    assert set_row_kernels(model, table) > 0
    try:
        assert NativeDecode.most_rows(model, 10_000) == bounds[1]
        rows = [(s, 4 + 9 * i + s) for s in range(3) for i in range(per)]
        ours, theirs = _Step(model, rows), _Step(model, rows)
        with torch.inference_mode():
            got = ours.native(NativeDecode(model, 64))
            want = theirs.reference(model)
    finally:
        set_row_kernels(model, None)
    scale = want.float().abs().max()
    assert got.shape == want.shape and (got.float() - want.float()).abs().max() <= TOL[torch.bfloat16] * scale
    k_got, k_want = ours.cache.data[:, 0].float(), theirs.cache.data[:, 0].float()
    assert (k_got - k_want).abs().max() <= TOL[torch.bfloat16] * k_want.abs().max()
    # layer 0's V: the same embedding rows, normed (sums in another order), through the same many-row kernel
    v_got, v_want = ours.cache.data[0, 1].float(), theirs.cache.data[0, 1].float()
    assert torch.allclose(v_got, v_want, rtol=TOL[torch.bfloat16], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_items_rows_are_bit_equal_to_decoding_them_one_by_one(dtype: torch.dtype) -> None:
    """A verify item's five rows in one step, among other sequences' rows, give each row the bits that decoding
    its tokens one step at a time gives (each step storing the K/V the next one reads)."""
    model = _model(dtype)
    runner = NativeDecode(model, 17)
    ids = [5, 77, 300, 12, 499]
    rows = [(1, 60 + i) for i in range(5)]
    with torch.inference_mode():
        together = _Step(model, [(0, 9), *rows, (2, 30)], [1, *ids, 2]).native(runner)[1:6]
        first = _Step(model, rows[:1], ids[:1])
        one_by_one = [first.native(runner)]
        for i in range(1, 5):
            one_by_one.append(_Step(model, rows[i : i + 1], ids[i : i + 1], cache=first.cache).native(runner))
    assert torch.equal(together, torch.cat(one_by_one))


def _compiled_table(dtype: torch.dtype) -> RowTable:
    tiles = tandem_native.tiles()
    return compiled_row_table(dtype, tiles=tiles, exact_verify=False, dot=not tiles and tandem_native.dot_bf16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lm_head_in_the_same_call_gives_the_head_modules_logits(dtype: torch.dtype) -> None:
    """Under the compiled step's row table, `logits` is the step's hidden states through the LM head module, bit for
    bit, at one row and at several (the head's kernel for that many rows), and it stores the same K/V."""
    model = _model(dtype)
    assert set_row_kernels(model, _compiled_table(dtype)) > 0
    try:
        runner = NativeDecode(model, NativeDecode.most_rows(model, 6))
        assert runner.has_lm_head and NativeDecode.head_unsupported(model, runner.max_rows) is None
        for rows in ([(1, 70)], [(0, 40), (1, 70), (2, 5)][: runner.max_rows]):
            ours, theirs = _Step(model, rows), _Step(model, rows)
            with torch.inference_mode():
                got = ours.logits(runner)  # [T, vocab]
                want = model.logits(theirs.native(runner))
            assert got.dtype == dtype and got.shape == (len(rows), model.config.vocab_size)
            assert torch.equal(got, want), len(rows)
            assert torch.equal(ours.cache.data, theirs.cache.data)
    finally:
        set_row_kernels(model, None)


def test_a_head_the_runner_cannot_call_stays_with_the_module_and_says_why() -> None:
    model = _model(torch.float32)
    model.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    assert NativeDecode.unsupported(model) is None  # the layers still run in the runner
    assert NativeDecode.head_unsupported(model, 4) == "the LM head is a Linear without a row kernel the runner calls"
    runner = NativeDecode(model, 4)
    assert not runner.has_lm_head
    with torch.inference_mode(), pytest.raises(RuntimeError, match="holds no LM head"):
        _Step(model, [(0, 20)]).logits(runner)


def test_refusals_name_the_fault_and_write_nothing() -> None:
    model = _model(torch.float32)
    runner = NativeDecode(model, 4)
    step = _Step(model, [(0, 20), (0, 21)])
    before = step.cache.data.clone()
    m = step.meta

    def call(**change) -> None:
        args = dict(input_ids=step.ids, positions=step.positions, kv_cache=step.cache.data,
                    slot_mapping=m.slot_mapping, context_lens=m.decode_context_lens,
                    block_tables=m.decode_block_tables)  # fmt: skip
        runner.hidden_states(**{**args, **change})

    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="token id 512 out of range"):
            call(input_ids=torch.tensor([1, 512]))
        with pytest.raises(RuntimeError, match="position 512 out of range"):
            call(positions=torch.tensor([20, 512]))
        with pytest.raises(RuntimeError, match="slot 512 out of range"):
            call(slot_mapping=torch.tensor([3, 512]))
        with pytest.raises(RuntimeError, match="context length 129 out of range"):
            call(context_lens=torch.tensor([21, 129], dtype=torch.int32))
        with pytest.raises(RuntimeError, match="block id out of range"):
            call(block_tables=torch.full((2, 8), 32, dtype=torch.int32))
        with pytest.raises(RuntimeError, match="5 rows; it runs 1 to 4"):
            call(input_ids=torch.zeros(5, dtype=torch.int64))
        with pytest.raises(RuntimeError, match="context_lens must be contiguous int32"):
            call(context_lens=torch.tensor([21, 22]))
        with pytest.raises(RuntimeError, match="kv_cache must be contiguous"):
            call(kv_cache=step.cache.data.to(torch.bfloat16))
    assert torch.equal(step.cache.data, before)


@pytest.mark.parametrize(("kind", "rows"), [("int8", 1), ("int8", 5), ("int4", 1), ("int4", 5)])
def test_quantized_projections_run_their_row_kernels(kind: str, rows: int) -> None:
    """int8's rows through `int8_gemv`, int4's through `int4_gemv` (the kernels `QuantizedLinear` runs for those
    rows, activations rounded to int8 as theirs are): the serving decoder's step within the bf16 tolerance; the
    runner's rows capped by the fewest a projection's kernel takes (int8 with AMX tiles: one)."""
    model = quantize_weights(_model(torch.bfloat16, intermediate_size=128), kind, group_size=32)  # int8's groups: 64
    kernel = model.layers[0].qkv.row_kernel()
    assert kernel is not None and kernel.name == f"{kind}_gemv"
    if rows > kernel.rows:
        pytest.skip(f"{kind}_gemv takes {kernel.rows} row(s) here (AMX tiles take the rest)")
    runner = NativeDecode(model, 17)
    assert runner.max_rows == min(17, kernel.rows) and NativeDecode.most_rows(model, 2) == min(2, kernel.rows)
    positions = [(1, 60 + i) for i in range(rows)]
    ours, theirs = _Step(model, positions), _Step(model, positions)
    with torch.inference_mode():
        got = ours.native(runner)
        want = theirs.reference(model)
        head = model.lm_head  # the int8 head's rows through int8_gemv, as the module runs them
        if runner.has_lm_head:
            assert torch.equal(_Step(model, positions).logits(runner), head(got))
    assert (got.float() - want.float()).abs().max() <= TOL[torch.bfloat16] * want.float().abs().max()
    assert runner.has_lm_head == (isinstance(head, QuantizedLinear) and head.row_kernel() is not None)


def test_models_the_runner_does_not_serve_say_why() -> None:
    assert NativeDecode.unsupported(_model(torch.float32)) is None
    assert "head_dim 24" in NativeDecode.unsupported(_model(torch.float32, head_dim=24))
    assert "float16" in NativeDecode.unsupported(_model(torch.float16))
    torch_kernels = quantize_weights(_model(torch.bfloat16), "int8", row_kernels=False)
    assert "QuantizedLinear without a row kernel" in NativeDecode.unsupported(torch_kernels)
    with pytest.raises(ValueError, match="cannot serve this model"):
        NativeDecode(torch_kernels, 4)
    with pytest.raises(ValueError, match="max_rows must be at least 1"):
        NativeDecode(_model(torch.float32), 0)
