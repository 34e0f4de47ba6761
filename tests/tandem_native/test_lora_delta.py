"""`tandem::lora_delta_` (tandem_native/csrc/lora.cpp), the fused LoRA delta of a served step: against a float64
reference at several row counts, ranks and slot mixes (base rows, width-0 slots, a merged projection's
block-diagonal Bᵀ) in fp32, bf16 and fp16; base rows keep their bits; each row's bits do not depend on the other
rows of the call or on threads; bad operands are refused naming what is wrong."""

from __future__ import annotations

import pytest
import torch

import tandem_native
from tandem_native import loader

pytestmark = pytest.mark.skipif(
    not tandem_native.available(), reason=f"the native library does not run here: {loader.unsupported()}"
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _op():
    return tandem_native.library().lora_delta_


def _operands(rows: int, slot_list: list[int], widths: list[int], width: int, d_in: int, d_out: int, dtype, seed=0):
    """x [T, in], y [T, out] (the 'base output'), a [S, W, in], bt [S, W, out] with rows past each width zero
    (as LoraSlots keeps them), int32 slots [T] and widths [S]."""
    g = torch.Generator().manual_seed(seed)
    s = len(widths)
    x = torch.randn(rows, d_in, generator=g).to(dtype)
    y = torch.randn(rows, d_out, generator=g).to(dtype)
    a = (torch.randn(s, width, d_in, generator=g) / d_in**0.5).to(dtype)
    bt = (torch.randn(s, width, d_out, generator=g) * 0.1).to(dtype)
    for i, w in enumerate(widths):
        a[i, w:] = 0
        bt[i, w:] = 0
    slots = torch.tensor(slot_list, dtype=torch.int32)
    return y, x, a, bt, slots, torch.tensor(widths, dtype=torch.int32)


def _reference(y, x, a, bt, slots, widths) -> tuple[torch.Tensor, torch.Tensor]:
    """(y + each adapter row's delta, and each element's magnitude |y| + |x||A|ᵀ|Bᵀ|), in float64."""
    ref, mag = y.double().clone(), y.double().abs()
    for t, s in enumerate(slots.tolist()):
        if s < 0 or widths[s] == 0:
            continue
        w = int(widths[s])
        av, bv, xv = a[s, :w].double(), bt[s, :w].double(), x[t].double()
        ref[t] += (av @ xv) @ bv
        mag[t] += (av.abs() @ xv.abs()) @ bv.abs()
    return ref, mag


def _check_against_reference(y0, x, a, bt, slots, widths) -> torch.Tensor:
    y = y0.clone()
    _op()(y, x, a, bt, slots, widths)
    ref, mag = _reference(y0, x, a, bt, slots, widths)
    rounding = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[y.dtype]
    err = (y.double() - ref).abs()
    # fp32 accumulation (a few ulp of fp32 over each magnitude), plus one rounding to y's dtype
    bound = 1e-6 * mag + rounding * ref.abs() + 1e-30
    assert (err <= bound).all(), f"max error {err.max():.3g}, over bound at {(err > bound).nonzero()[:4].tolist()}"
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("slot_list", "widths", "width", "d_in", "d_out"),
    [
        ([0], [16], 16, 512, 512),  # one stream, rank 16
        ([1, -1, 0, 1, 1, 0, -1, 2, 1, 1], [8, 16, 0], 16, 64, 96),  # a mix: base rows, a width-0 slot
        ([2, 0, 1, 2, 3, 3, 3, 0, 1, 2, 0, 3, 1, 1, 2, 0], [4, 12, 5, 1], 12, 72, 40),  # 16 rows, 4 adapters
        ([0, 0, 0, 0, 0, 0, 0, 0, 0], [7], 8, 33, 17),  # tails everywhere: in, out and w not multiples of 16 / 4
        ([-1, -1, -1], [4], 4, 32, 32),  # no adapter row at all
    ],
)
def test_matches_a_float64_reference(dtype, slot_list, widths, width, d_in, d_out) -> None:
    operands = _operands(len(slot_list), slot_list, widths, width, d_in, d_out, dtype, seed=len(slot_list) + d_in)
    _check_against_reference(*operands)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_a_merged_projection_with_a_block_diagonal_bt(dtype) -> None:
    """q/k/v merged: an adapter of rank 8 on q and v only, laid out as LoraSlots does (A's rows for q then v; Bᵀ
    block-diagonal: q's rows write q's columns, v's rows v's): each part's output gets its own delta, k none."""
    g = torch.Generator().manual_seed(5)
    d_in, parts, r = 64, (64, 32, 32), 8
    x = torch.randn(6, d_in, generator=g).to(dtype)
    y0 = torch.randn(6, sum(parts), generator=g).to(dtype)
    aq, av = torch.randn(r, d_in, generator=g), torch.randn(r, d_in, generator=g)
    bq, bv = torch.randn(parts[0], r, generator=g), torch.randn(parts[2], r, generator=g)
    a = torch.zeros(2, 3 * r, d_in)
    bt = torch.zeros(2, 3 * r, sum(parts))
    a[1, :r], a[1, r : 2 * r] = aq, av
    bt[1, :r, : parts[0]] = bq.t() * 0.5
    bt[1, r : 2 * r, parts[0] + parts[1] :] = bv.t() * 0.5
    slots = torch.tensor([1, -1, 1, 0, 1, 1], dtype=torch.int32)
    widths = torch.tensor([0, 2 * r], dtype=torch.int32)
    y = _check_against_reference(y0, x, a.to(dtype), bt.to(dtype), slots, widths)
    k = slice(parts[0], parts[0] + parts[1])
    assert torch.equal(y[:, k], y0[:, k])  # k is not adapted: its columns keep their bits
    delta_q = (x.double() @ aq.to(dtype).double().t()) @ bq.to(dtype).double().t() * 0.5
    assert torch.allclose(y[0, : parts[0]].double(), y0[0, : parts[0]].double() + delta_q[0], rtol=0.02, atol=0.05)


@pytest.mark.parametrize("dtype", DTYPES)
def test_base_rows_and_width_0_slots_keep_their_bits(dtype) -> None:
    y0, x, a, bt, slots, widths = _operands(5, [-1, 0, 1, -1, 0], [8, 0], 8, 48, 40, dtype)
    y0[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])  # bits only a write would change
    y0[3, 5] = float("-inf")
    y = y0.clone()
    _op()(y, x, a, bt, slots, widths)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for t in (0, 2, 3):  # base rows and the rows of slot 1 (width 0): not written at all
        assert torch.equal(y[t].view(bits), y0[t].view(bits)), t
    assert not torch.equal(y[1], y0[1]) and not torch.equal(y[4], y0[4])  # the adapter rows did change


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_alone_as_in_any_batch(dtype) -> None:
    """Batch invariance: each row of a mixed call equals the row alone, in another batch order, and in a call large
    enough to split over two threads."""
    rows = 64
    slot_list = [(t * 7) % 5 - 1 for t in range(rows)]  # -1..3: base rows and four adapters, interleaved
    y0, x, a, bt, slots, widths = _operands(rows, slot_list, [16, 48, 32, 8], 48, 512, 1536, dtype, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # 64 rows x up to 48 x 2048 multiply-adds: above the kernel's threading bar
        together = y0.clone()
        _op()(together, x, a, bt, slots, widths)
        torch.set_num_threads(1)
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
        shuffled = y0[perm].clone()
        _op()(shuffled, x[perm], a, bt, slots[perm], widths)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(shuffled, together[perm])
    for t in range(0, rows, 5):
        alone = y0[t : t + 1].clone()
        _op()(alone, x[t : t + 1], a, bt, slots[t : t + 1], widths)
        assert torch.equal(alone[0], together[t]), t


def test_the_dispatcher_op_is_the_same_kernel_and_takes_any_leading_shape() -> None:
    """`torch.ops.tandem.lora_delta_` (schema and fake kernel checked by torch's opcheck) gives the module entry's
    bits; y and x may be [B, T, ...] as a decoder layer passes them."""
    y0, x, a, bt, slots, widths = _operands(6, [0, -1, 1, 1, 0, -1], [16, 4], 16, 64, 80, torch.float32)
    direct = y0.clone()
    _op()(direct, x, a, bt, slots, widths)
    via = y0.clone().view(2, 3, 80)
    torch.ops.tandem.lora_delta_(via, x.view(2, 3, 64), a, bt, slots, widths)
    assert torch.equal(via.view(6, 80), direct)
    args = (y0.clone(), x, a, bt, slots, widths)
    torch.library.opcheck(torch.ops.tandem.lora_delta_.default, args, test_utils=("test_schema", "test_faketensor"))


def test_bad_operands_are_refused_naming_what_is_wrong() -> None:
    y, x, a, bt, slots, widths = _operands(3, [0, -1, 1], [4, 8], 8, 32, 48, torch.float32)
    op = _op()

    def refused(match: str, **change) -> None:
        args = {"y": y.clone(), "x": x, "a": a, "bt": bt, "row_slots": slots, "widths": widths} | change
        before = args["y"].clone()
        with pytest.raises(RuntimeError, match=match):
            op(*args.values())
        assert torch.equal(args["y"], before)  # nothing written before the refusal

    refused(r"row_slots\[2\] = 2 is outside \[-1, 2\)", row_slots=torch.tensor([0, -1, 2], dtype=torch.int32))
    refused(r"row_slots\[0\] = -2 is outside", row_slots=torch.tensor([-2, -1, 1], dtype=torch.int32))
    refused(r"row_slots must be int32 \[T\] with T = 3", row_slots=slots.long())
    refused(r"row_slots must be int32 \[T\] with T = 3", row_slots=slots[:2])
    refused(r"widths\[1\] = 9 is outside \[0, 8\]", widths=torch.tensor([4, 9], dtype=torch.int32))
    refused(r"widths must be int32 \[S\] with S = 2", widths=widths[:1])
    refused(r"x must be \[\.\.\., in\] with in = 32", x=x[:, :16])
    refused(r"y must be \[\.\.\., out\] with out = 48", y=y[:, :40].clone())
    refused(r"x .* and y .* must have the same rows", x=x[:2])
    refused(r"x, a and bt must have y's dtype", x=x.bfloat16())
    refused(r"y must be fp32, bf16 or fp16", y=y.double(), x=x.double(), a=a.double(), bt=bt.double())
    refused(r"a .* and bt .* must have the same slots S and width W", bt=bt[:, :4].contiguous())
    refused(r"a must be \[S, W, in\]", a=a[0])
    refused(r"y must be contiguous", y=torch.zeros(48, 3).t())
    refused(r"a and bt must be contiguous", a=a.transpose(1, 2).contiguous().transpose(1, 2))
