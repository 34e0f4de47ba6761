"""`tandem::tile_gemm_int4` (int4 weights unpacked into bf16 AMX tiles) against the dense product of the dequantized
weight at every row count an int4 layer gives it, its weight bit for bit, a row's bits at any row count of the
call, its refusals, and an int4 layer's routing between `int4_gemv`, the tiles and the dequantized GEMM (eager and
compiled) with the reference (`fake_quantized`'s `DequantizedLinear`) modelling each side. Skipped where this
process cannot use AMX-BF16 tiles (an int4 layer then keeps `int4_gemv` and the dequantized GEMM, tested in
test_int4_gemv.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tandem_native
from shared_model import int4_gemv
from shared_model.ledger import INT4_GROUP_SIZES
from shared_model.quantize import (
    INT4_TILE_MIN_ROWS,
    DequantizedLinear,
    QuantizedLinear,
    activation_rounding,
    dequantize_int4,
    exact_weight_rows,
    int4_gemv_rows,
    int4_tile_kernel,
    quantize_int4,
)
from shared_model.serving_model import TILE_MAX_ROWS

needs_tiles = pytest.mark.skipif(not tandem_native.tiles(), reason="needs AMX-BF16 tiles usable by this process")
CPU = torch.device("cpu")


def _weights(n: int, k: int, group: int, seed: int = 0):
    """(codes [N, K/2] in int4_gemv's layout, scales_and_zeros bf16 [2, N, G], the codes [N, K], scales, zeros)."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, scales, zeros = quantize_int4(weight, group)
    sz = torch.stack([scales, zeros]).to(torch.bfloat16).contiguous()
    return int4_gemv.pack(q, group), sz, q, scales, zeros


SHAPES = [
    (16, 64, 64), (48, 768, 64), (96, 768, 128), (64, 2048, 256), (32, 3072, 32), (36, 384, 32), (20, 768, 64),
    (8, 128, 64), (48, 160, 32),
]  # fmt: skip
"""(N, K, group): one block of 16 rows, the 82M model's shapes, every group size, 96 groups a row (blocks of one
row), then N not a multiple of 16 (blocks of 4 and 8 rows: a last tile of 4, a call of half a tile), and K a
multiple of its group only (5 groups of 32)."""


@needs_tiles
@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_kernel_matches_the_dense_product_of_the_dequantized_weight_at_every_row_count(n, k, group) -> None:
    codes, sz, *_ = _weights(n, k, group)
    w = torch.ops.tandem.int4_dequantize(codes, sz, group).double()  # [N, K]: bf16 values, exact in fp64
    x = torch.randn(TILE_MAX_ROWS + 36, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    full = torch.ops.tandem.tile_gemm_int4(x, codes, sz, group)  # 100 rows: two passes of 64 over each tile
    assert full.shape == (x.shape[0], n) and full.dtype == torch.bfloat16
    for rows in range(1, TILE_MAX_ROWS + 1):
        y = torch.ops.tandem.tile_gemm_int4(x[:rows], codes, sz, group)
        want = x[:rows].double() @ w.t()
        # the output's bf16 rounding (half an ulp: 2^-9 relative) and fp32 sums in another order
        bound = 2**-8 * want.abs() + 1e-5 * (x[:rows].double().abs() @ w.abs().t()) + 1e-30
        err = (y.double() - want).abs()
        assert (err <= bound).all(), f"{rows} rows: max |err| {err.max():.3g}, worst ratio {(err / bound).max():.3g}"
        assert torch.equal(y, full[:rows]), f"{rows} rows: a row's bits depend on the rows beside it"


@needs_tiles
@pytest.mark.parametrize("group", INT4_GROUP_SIZES)
def test_the_tiles_multiply_the_reference_dequantized_weight_bit_for_bit(group: int) -> None:
    """x = the identity: each output is one weight times 1, so y is Wᵀ exactly as the kernel unpacked it; it must be
    `dequantize_int4(..., stored)` (quantize.py's reference) rounded to bf16, and the C++ dequantize's bits."""
    n, k = 48, 4 * group
    codes, sz, q, scales, zeros = _weights(n, k, group, seed=3)
    y = torch.ops.tandem.tile_gemm_int4(torch.eye(k, dtype=torch.bfloat16), codes, sz, group)  # [K, N]
    reference = dequantize_int4(q, scales, zeros, group, torch.bfloat16).to(torch.bfloat16)  # [N, K]
    assert torch.equal(y.t(), reference)
    assert torch.equal(y.t(), torch.ops.tandem.int4_dequantize(codes, sz, group))


@needs_tiles
def test_the_op_refuses_what_it_cannot_run() -> None:
    codes, sz, *_ = _weights(16, 128, 64)
    op = torch.ops.tandem.tile_gemm_int4
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be a bf16"):
        op(x.float(), codes, sz, 64)
    with pytest.raises(RuntimeError, match="scales_and_zeros must be bf16"):
        op(x, codes, sz.float(), 64)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        op(torch.zeros(3, 256, dtype=torch.bfloat16), codes, sz, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(x, codes, sz, 48)
    with pytest.raises(RuntimeError, match="must be a multiple of 8"):  # 2 groups a row: blocks of 8 rows
        op(x, codes[:12], sz[:, :12].contiguous(), 64)
    assert op(x[:0], codes, sz, 64).shape == (0, 16)


@needs_tiles
@pytest.mark.parametrize("compiled", [False, True])
def test_int4_layer_routes_rows_between_gemv_tiles_and_the_dense_gemm(compiled: bool) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 256, generator=g)
    layer = QuantizedLinear(weight, None, "int4", 64, torch.bfloat16)
    bound = INT4_TILE_MIN_ROWS - 1
    assert layer._row_kernel and layer._tile_kernel and int4_tile_kernel(64, torch.bfloat16, CPU)
    assert int4_gemv_rows(64, torch.bfloat16, CPU) == bound
    assert layer.method() == (
        "int4_gemv+tile_gemm_int4",
        f"1-{bound} rows: tandem::int4_gemv (int8 activations); {bound + 1}-{TILE_MAX_ROWS} rows: "
        "tandem::tile_gemm_int4; more: C++ dequantize + GEMM",
    )
    assert layer.row_bounds() == (bound, TILE_MAX_ROWS)
    # the reference: activations rounded up to the bound, the weight exact up to it and rounded to bf16 above
    rounding = activation_rounding("int4", 256, 64, CPU, dtype=torch.bfloat16)
    exact = exact_weight_rows("int4", (96, 256), 64, CPU, dtype=torch.bfloat16)
    assert rounding == (64, bound) and exact == bound
    ref = DequantizedLinear(dequantize_int4(*quantize_int4(weight, 64), 64, torch.bfloat16), None, torch.bfloat16,
                            rounding, exact)  # fmt: skip
    torch._dynamo.reset()  # earlier tests' graphs of QuantizedLinear.forward count towards its recompile limit
    fn = torch.compile(layer, fullgraph=True) if compiled else layer  # fullgraph: the custom op does not break it
    codes, sz = layer.qweight, layer.scales_and_zeros
    for rows in (1, bound, bound + 1, 16, 17, TILE_MAX_ROWS, TILE_MAX_ROWS + 1):  # each side of each bound
        x = torch.randn(rows, 256, generator=g, dtype=torch.bfloat16)
        y = fn(x)
        if rows <= bound:
            kernel = torch.ops.tandem.int4_gemv(x, codes, sz, 64)
        elif rows <= TILE_MAX_ROWS:
            kernel = torch.ops.tandem.tile_gemm_int4(x, codes, sz, 64)
        else:
            kernel = F.linear(x, layer.dequantize())
        assert torch.equal(y, kernel), rows  # the bound picks the kernel
        expected = ref(x).float()
        assert (y.float() - expected).abs().max() <= 1e-2 * expected.abs().max(), rows


def test_without_tiles_or_in_fp16_int4_keeps_its_gemv_up_to_16_rows() -> None:
    """The tiles take bf16 only: an fp16 layer (and any layer where AMX is absent) keeps `int4_gemv` for
    1-`int4_gemv.MAX_ROWS` rows and its reference says so."""
    assert not int4_tile_kernel(64, torch.float16, CPU)
    layer = QuantizedLinear(torch.randn(32, 128), None, "int4", 64, torch.float16)
    assert not layer._tile_kernel and "tile_gemm_int4" not in layer.method()[1]
    if layer._row_kernel:
        assert layer.row_bounds() == (int4_gemv.MAX_ROWS,)
        assert exact_weight_rows("int4", (32, 128), 64, CPU, dtype=torch.float16) == int4_gemv.MAX_ROWS
    off = QuantizedLinear(torch.randn(32, 128), None, "int4", 64, torch.bfloat16, row_kernels=False)
    assert not off._tile_kernel and off.method()[0] == "int4_packed"
