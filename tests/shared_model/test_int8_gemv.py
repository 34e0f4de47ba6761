"""The VNNI int8 GEMV against its plain-torch reference, the rule for where it runs, and its use by an int8 layer
(eager and compiled). Skipped where the CPU lacks AVX-512 VNNI (torch's int8 kernel then runs, tested elsewhere)."""

from __future__ import annotations

import pytest
import torch

import tandem_native
from shared_model import int8_gemv
from shared_model.quantize import (
    DequantizedLinear,
    QuantizedLinear,
    dequantize_int8,
    int8_gemv_rows,
    quantize_int8,
)

needs_kernel = pytest.mark.skipif(not int8_gemv.available(), reason="needs AVX-512 VNNI and a C++ compiler")


def test_activation_group_is_the_largest_dividing_block() -> None:
    assert [int8_gemv.activation_group(k) for k in (768, 2048, 896, 320, 64, 96)] == [256, 256, 128, 64, 64, None]


def test_quantize_activation_rounds_each_group_to_127_steps() -> None:
    x = torch.cat([torch.linspace(-3, 3, 64), torch.zeros(64)])
    xq = int8_gemv.quantize_activation(x, 64)
    step = 3 / 127
    assert torch.allclose(xq[:64] / step, torch.round(xq[:64] / step), atol=1e-4)  # on the group's grid
    assert (xq[:64] - x[:64]).abs().max() <= step / 2 + 1e-6
    assert torch.equal(xq[64:], torch.zeros(64))  # an all-zero group stays zero (no division by zero)


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(13, 64), (8, 128), (1283, 768), (96, 2048), (64, 896)])
def test_kernel_matches_its_reference(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(k, generator=g) * torch.rand(k, generator=g) * 4  # groups of different ranges
    x[: min(64, k)] = 0.0  # one all-zero group
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, generator=g) / 100
    y, ref = int8_gemv.int8_gemv(x, q, scales), int8_gemv.reference(x, q, scales)
    assert y.dtype == torch.float32 and y.shape == (n,)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()  # the same products, summed in another order
    exact = (q.float() @ x) * scales
    assert (y - exact).abs().max() <= 0.02 * exact.abs().max()  # and close to the unrounded activation


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_activations_and_scales_are_read_in_place_with_one_rounding(dtype: torch.dtype) -> None:
    """x and scales in a 16-bit float: exactly the fp32 computation over their (exact) fp32 values, rounded once."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, generator=g).to(dtype)
    q = torch.randint(-127, 128, (40, 256), dtype=torch.int8, generator=g)
    scales = (torch.rand(40, generator=g) / 100).to(dtype)
    y = torch.ops.tandem.int8_gemv(x, q, scales, 128)
    assert y.dtype == dtype
    assert torch.equal(y, torch.ops.tandem.int8_gemv(x.float(), q, scales.float(), 128).to(dtype))
    mixed = torch.ops.tandem.int8_gemv(x.float(), q, scales, 128)  # fp32 x, 16-bit scales
    assert torch.equal(mixed, torch.ops.tandem.int8_gemv(x.float(), q, scales.float(), 128))


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(13, 64), (1283, 768), (64, 896)])
def test_rows_match_the_reference_and_each_row_keeps_its_bits_at_any_row_count(n: int, k: int) -> None:
    """[M, K] rows (an odd count: pairs of rows and a last one alone) against the reference, and each row's result
    the same bits as its own one-row call: a row's output does not depend on the others in the step."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(7, k, generator=g) * torch.rand(7, k, generator=g) * 4  # [7, K], groups of different ranges
    x[2, :64] = 0.0  # one all-zero group
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, generator=g) / 100
    y, ref = int8_gemv.int8_gemv(x, q, scales), int8_gemv.reference(x, q, scales)
    assert y.dtype == torch.float32 and y.shape == ref.shape == (7, n)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    for m in range(7):
        assert torch.equal(y[m], int8_gemv.int8_gemv(x[m], q, scales))  # [K] alone
        assert torch.equal(y[m : m + 1], int8_gemv.int8_gemv(x[m : m + 1], q, scales))  # [1, K]
    assert torch.equal(y[1:4], int8_gemv.int8_gemv(x[1:4], q, scales))


@needs_kernel
@pytest.mark.parametrize("compiled", [False, True])
def test_int8_layer_runs_its_decode_rows_through_the_kernel(compiled: bool) -> None:
    """One row everywhere, and up to `int8_gemv.MAX_ROWS` where no AMX tiles take two and more: those calls round
    the activations as the reference models them; a row's bits do not depend on how many rows share the call."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 256, generator=g)
    layer = QuantizedLinear(weight, None, "int8", 64, torch.bfloat16)
    assert layer._row_kernel
    most = int8_gemv_rows(torch.bfloat16, torch.device("cpu"))
    assert layer.row_kernel().rows == most == (1 if tandem_native.tiles() else int8_gemv.MAX_ROWS)
    ref = DequantizedLinear(
        dequantize_int8(*quantize_int8(weight), torch.bfloat16),
        None,
        torch.bfloat16,
        (int8_gemv.activation_group(256) or 0, most),
    )
    torch._dynamo.reset()  # earlier tests' graphs of QuantizedLinear.forward count towards its recompile limit
    fn = torch.compile(layer, fullgraph=True) if compiled else layer  # fullgraph: the custom op does not break it
    x = torch.randn(5, 256, generator=g, dtype=torch.bfloat16)
    y = fn(x[:1])
    assert y.dtype == torch.bfloat16 and y.shape == (1, 96)

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:  # bf16 outputs and weights: 1 % of the largest
        return (got.float() - want.float()).abs().max().item() <= 1e-2 * want.float().abs().max().item()

    assert close(y, ref(x[:1]))
    five = fn(x)  # the kernel's rows (activations rounded) or, with tiles, the tiles' (not rounded)
    assert close(five, ref(x))
    if most >= 5:
        assert torch.equal(five[:1], y) and torch.equal(fn(x[1:3]), five[1:3])


@needs_kernel
def test_non_finite_rows_give_nan_and_tiny_groups_count_as_zero() -> None:
    q = torch.randint(-127, 128, (16, 128), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    scales = torch.rand(16)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(128)
        x[70] = bad
        assert torch.isnan(int8_gemv.int8_gemv(x, q, scales)).all()  # never finite garbage for the sampler
        assert torch.isnan(int8_gemv.reference(x, q, scales)).all()
    tiny = torch.cat([torch.full((64,), 1e-39), torch.randn(64)])  # the first group's scale is subnormal
    y, ref = int8_gemv.int8_gemv(tiny, q, scales), int8_gemv.reference(tiny, q, scales)
    assert torch.isfinite(ref).all() and (y - ref).abs().max() <= 1e-5 * ref.abs().max()


@needs_kernel
def test_the_op_refuses_what_it_cannot_run() -> None:
    q = torch.zeros(8, 96, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="not available here"):  # 96 inputs: no group of 64 divides it
        int8_gemv.int8_gemv(torch.zeros(96), q, torch.ones(8))
    with pytest.raises(RuntimeError, match="shapes do not match"):
        tandem_native.library().int8_gemv(torch.zeros(64), torch.zeros(8, 128, dtype=torch.int8), torch.ones(8), 64)


@pytest.mark.skipif(not tandem_native.tiles(), reason="needs a CPU with AMX-BF16 tiles this process may use")
@pytest.mark.parametrize("compiled", [False, True])
def test_int8_layer_runs_2_to_64_rows_on_the_tiles_with_torchs_packed_maths(compiled: bool) -> None:
    """A decode batch of an int8 layer reads the int8 bytes once on AMX tiles (not a dequantized copy of the weight
    per call): the same maths as `_weight_int8pack_mm` (codes times bf16 activations, the row scale once), and each
    row's bits do not depend on how many rows share the call."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 256, generator=g)
    layer = QuantizedLinear(weight, None, "int8", 64, torch.bfloat16)
    assert layer._tile_kernel and layer.method()[0] == "int8_gemv+tile_gemm_int8"
    torch._dynamo.reset()  # earlier tests' graphs of QuantizedLinear.forward count towards its recompile limit
    fn = torch.compile(layer, fullgraph=True) if compiled else layer
    x = torch.randn(65, 256, generator=g, dtype=torch.bfloat16)
    exact = (x.double() @ layer.qweight.double().t()) * layer.scales.double()  # [65, 96]
    tiles = fn(x[:64])  # one call of 64 rows
    assert (tiles.double() - exact[:64]).abs().max() <= 2**-7 * exact.abs().max()
    packed = torch.ops.aten._weight_int8pack_mm(x[:64], layer.qweight, layer.scales)
    assert (tiles.double() - packed.double()).abs().max() <= 2**-7 * exact.abs().max()
    for lo, hi in ((0, 2), (5, 21), (40, 64)):  # any row count from 2 to 64: the same bits per row
        assert torch.equal(fn(x[lo:hi]), tiles[lo:hi])
    beyond = layer(x)  # 65 rows: dequantize + GEMM
    assert (beyond.double() - exact).abs().max() <= 2**-7 * exact.abs().max()
