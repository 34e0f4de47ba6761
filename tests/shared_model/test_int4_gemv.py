"""The VNNI int4 GEMV against its plain-torch reference, its layout, and its use by an int4 layer (eager and
compiled) with the reference modelling its activation rounding. Skipped where the CPU lacks AVX-512 VNNI (torch's
int4 kernel then runs, tested elsewhere)."""

from __future__ import annotations

import pytest
import torch

import tandem_native
from shared_model import int4_gemv
from shared_model.quantize import (
    INT4_TILE_MIN_ROWS,
    PACKED_MAX_ROWS,
    DequantizedLinear,
    QuantizedLinear,
    activation_rounding,
    dequantize_int4,
    exact_weight_rows,
    int4_gemv_rows,
    quantize_int4,
)

needs_kernel = pytest.mark.skipif(not tandem_native.available(), reason="needs AVX-512 VNNI and a C++ compiler")


def _weights(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight [N, K], codes [N, K/2] in the kernel's layout, scales_and_zeros [N, 2, G] fp32)."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, scales, zeros = quantize_int4(weight, group)
    return weight, int4_gemv.pack(q, group), torch.stack([scales, zeros]).contiguous()


def test_pack_puts_each_row_and_group_in_its_own_lane_and_unpack_inverts_it() -> None:
    q = torch.randint(0, 16, (16, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    codes = int4_gemv.pack(q, 64)
    assert codes.shape == (16, 64) and codes.dtype == torch.uint8
    assert torch.equal(int4_gemv.unpack(codes, 64), q)
    # 2 groups a row: blocks of 8 rows, one tile of 16 lanes, 8 steps of 64 bytes (one codes row each). Block 1,
    # step 1, lane 3 (row 8 + 1, group 1), byte 2: inputs 64 + 4 + 2 (low nibble) and 64 + 32 + 4 + 2 (high)
    assert int(codes[8 + 1, 3 * 4 + 2]) == int(q[9, 70]) | int(q[9, 102]) << 4
    assert int4_gemv.block_rows(12) == 4 and int4_gemv.block_rows(32) == 1  # 768 and 2048 inputs in groups of 64
    with pytest.raises(ValueError, match="not a multiple of 8"):
        int4_gemv.pack(q[:12], 64)


def test_dequantize_matches_the_quantize_module() -> None:
    _, codes, sz = _weights(32, 256, 64)
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(0))
    expected = dequantize_int4(*quantize_int4(weight, 64), 64, torch.float32)
    assert torch.equal(int4_gemv.dequantize(codes, sz, 64), expected)


SHAPES = [
    (16, 64, 64, 1), (48, 768, 64, 1), (96, 768, 128, 3), (2304, 768, 64, 4), (64, 2048, 256, 2), (18, 512, 64, 2),
    (32, 3072, 32, 3), (16, 11008, 64, 1), (2304, 768, 64, 16), (96, 768, 128, 13), (64, 2048, 256, 7),
]  # fmt: skip
"""(N, K, group, rows): one block, the 82M model's shapes, several group sizes, blocks of 2 rows (8 groups a row),
groups of 32, Llama-2-7B's down projection (172 groups a row: blocks of 4 rows, 43 tiles), and calls of more rows
than a pass multiplies at once (4): a 16-stream decode (the most, `MAX_ROWS`), remainders of 1 and 3."""


@needs_kernel
@pytest.mark.parametrize(("n", "k", "group", "rows"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_its_reference(n: int, k: int, group: int, rows: int, dtype: torch.dtype) -> None:
    _, codes, sz = _weights(n, k, group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    sz_stored = sz.to(dtype)  # the layer stores them in its compute dtype; the kernel reads them as stored
    y = int4_gemv.int4_gemv(x, codes, sz_stored, group)
    assert y.shape == (rows, n) and y.dtype == dtype
    ref = int4_gemv.reference(x, codes, sz_stored, group)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
    assert (y.float() - ref).abs().max() <= tol * ref.abs().max()
    exact = x.float() @ int4_gemv.dequantize(codes, sz_stored, group).t()  # without the activation rounding
    assert (y.float() - exact).abs().max() <= 0.03 * exact.abs().max()
    for r in {0, rows // 2, rows - 1}:  # a row's bits do not depend on the other rows of the call
        assert torch.equal(y[r], int4_gemv.int4_gemv(x[r : r + 1], codes, sz_stored, group)[0]), r


@needs_kernel
@pytest.mark.parametrize(("n", "k", "group", "rows"), SHAPES)
def test_the_cpp_dequantize_is_bitwise_the_reference_rounded_to_the_stored_dtype(n, k, group, rows) -> None:
    del rows
    _, codes, sz = _weights(n, k, group)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        stored = sz.to(dtype)
        w = torch.ops.tandem.int4_dequantize(codes, stored, group)  # what a prefill chunk multiplies by
        assert w.dtype == dtype and torch.equal(w, int4_gemv.dequantize(codes, stored, group).to(dtype))


@needs_kernel
def test_nonfinite_rows_give_nan_and_tiny_groups_count_as_zero() -> None:
    _, codes, sz = _weights(16, 128, 64)
    x = torch.randn(2, 128)
    x[1, 70] = float("nan")
    y = int4_gemv.int4_gemv(x, codes, sz, 64)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()  # the row alone, never finite garbage
    tiny = torch.zeros(1, 128)
    tiny[0, :64] = 1e-39  # subnormal: its scale has no reciprocal
    tiny[0, 64:] = torch.randn(64)
    y, ref = int4_gemv.int4_gemv(tiny, codes, sz, 64), int4_gemv.reference(tiny, codes, sz, 64)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()


@needs_kernel
def test_the_op_refuses_what_it_cannot_run() -> None:
    _, codes, sz = _weights(16, 128, 64)
    op = torch.ops.tandem.int4_gemv
    with pytest.raises(RuntimeError, match="M in 1"):
        op(torch.zeros(int4_gemv.MAX_ROWS + 1, 128), codes, sz, 64)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op(torch.zeros(1, 256), codes, sz, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.zeros(1, 128), codes, sz, 48)
    with pytest.raises(RuntimeError, match="scales_and_zeros must be"):
        op(torch.zeros(1, 128), codes, sz[:, :, :1].contiguous(), 64)
    with pytest.raises(RuntimeError, match="must be a multiple of 8"):  # 2 groups a row: blocks of 8 rows
        op(torch.zeros(1, 128), codes[:12], sz[:, :12].contiguous(), 64)
    with pytest.raises(RuntimeError, match="must be a multiple of 8"):
        torch.ops.tandem.int4_dequantize(codes[:12], sz[:, :12].contiguous(), 64)
    assert int4_gemv.available(32)


def test_int4_layers_keep_torchs_kernel_when_turned_off() -> None:
    """`row_kernels=False` (serving's `--int4-kernel torch` or `--cpu-kernels off`): torch's kernel and layout, and
    a reference without the activation rounding; the method the load plan records says so."""
    layer = QuantizedLinear(torch.randn(32, 128), None, "int4", 64, torch.bfloat16, row_kernels=False)
    assert not layer._row_kernel and activation_rounding("int4", 128, 64, torch.device("cpu"), False) == (0, 0)
    assert layer.method()[0] == "int4_packed"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("compiled", [False, True])
def test_int4_layer_runs_decode_batches_through_the_kernel(compiled: bool, dtype: torch.dtype) -> None:
    """Up to `int4_gemv_rows` rows (16; fewer in bf16 where the AMX tiles take over, test_int4_tiles.py): the
    kernel, with the reference rounding the activations there and the weight above."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 256, generator=g)
    layer = QuantizedLinear(weight, None, "int4", 64, dtype)
    assert layer._row_kernel and layer.qweight.shape == (96, 128)  # only the kernel's layout is kept
    gemv_rows = int4_gemv_rows(64, dtype, weight.device)
    tiles = dtype == torch.bfloat16 and tandem_native.tiles()
    assert gemv_rows == (INT4_TILE_MIN_ROWS - 1 if tiles else int4_gemv.MAX_ROWS)
    assert layer.method()[0] == ("int4_gemv" if gemv_rows == int4_gemv.MAX_ROWS else "int4_gemv+tile_gemm_int4")
    rounding = activation_rounding("int4", 256, 64, weight.device, dtype=dtype)
    exact = exact_weight_rows("int4", (96, 256), 64, weight.device, dtype=dtype)
    assert rounding == (64, gemv_rows) and exact == gemv_rows
    ref = DequantizedLinear(dequantize_int4(*quantize_int4(weight, 64), 64, dtype), None, dtype, rounding, exact)
    torch._dynamo.reset()  # earlier tests' graphs of QuantizedLinear.forward count towards its recompile limit
    fn = torch.compile(layer, fullgraph=True) if compiled else layer  # fullgraph: the custom op does not break it
    for rows in (1, 3, PACKED_MAX_ROWS, 9, int4_gemv.MAX_ROWS, int4_gemv.MAX_ROWS + 1):
        x = torch.randn(rows, 256, generator=g, dtype=dtype)
        y, expected = fn(x).float(), ref(x).float()
        assert (y - expected).abs().max() <= 1e-2 * expected.abs().max(), rows
        if rows <= gemv_rows:
            assert torch.equal(fn(x), torch.ops.tandem.int4_gemv(x, layer.qweight, layer.scales_and_zeros, 64))
    assert torch.equal(layer.dequantize().float(), ref.weight.to(dtype).float())
