"""Weight-only quantization (`shared_model.quantize`): the number formats, each quantized linear against its
dequantized fp64 reference on both of its paths (packed kernel, dequantize-then-GEMM), the model transform against
`fake_quantized`, refusals that name the weight, and the served bytes against the ledger's formula."""

from __future__ import annotations

import pytest
import torch

from shared_model import quantize as qz
from shared_model.attention import CAUSAL
from shared_model.ledger import served_weight_bytes
from shared_model.model import build_model
from tests.conftest import tiny_config

KINDS = ["int8", "int4"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _reference(weight: torch.Tensor, kind: str, dtype: torch.dtype, group: int = 64) -> torch.Tensor:
    """The fp32 matrix a kernel should multiply by, from the codes alone (independent of QuantizedLinear)."""
    stored = qz.compute_dtype(dtype)
    if kind == "int8":
        return qz.dequantize_int8(*qz.quantize_int8(weight), stored)
    return qz.dequantize_int4(*qz.quantize_int4(weight, group), group, stored)


def test_formats_round_within_half_a_step() -> None:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    q8, s8 = qz.quantize_int8(w)
    assert q8.dtype == torch.int8 and int(q8.abs().max()) == 127
    assert ((w - q8.float() * s8[:, None]).abs() <= s8[:, None] / 2 + 1e-7).all()
    q4, s4, z4 = qz.quantize_int4(w, 32)
    assert q4.dtype == torch.uint8 and int(q4.max()) == 15 and int(q4.min()) == 0
    deq = qz.dequantize_int4(q4, s4, z4, 32, torch.float32).view(48, 4, 32)
    assert ((w.view(48, 4, 32) - deq).abs() <= s4[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, qz.PACKED_MAX_ROWS, 9], ids=["decode", "packed-max", "prefill"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_linear_matches_its_dequantized_reference(kind: str, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(192, 128, generator=gen) * 0.05, torch.randn(192, generator=gen) * 0.1
    layer = qz.QuantizedLinear(weight, bias, kind, 64, dtype)
    x = torch.randn(2, rows, 128, generator=gen).to(dtype)  # [B, T, K]: any leading shape
    got = layer(x)
    assert got.shape == (2, rows, 192) and got.dtype == dtype
    _assert_matches_reference(got, x, weight, bias, kind, dtype)


def _assert_matches_reference(got, x, weight, bias, kind: str, dtype: torch.dtype) -> None:
    w = _reference(weight, kind, dtype).double()
    xc = x.to(qz.compute_dtype(dtype)).double()  # activations are rounded to the compute dtype (bf16) first
    want = xc @ w.t() + (0 if bias is None else bias.to(dtype).double())
    # bf16 rounding of the output and, on the dequantize path, of each weight: 2^-8 relative each
    bound = 2**-7 * (xc.abs() @ w.abs().t()) + 2**-8 * want.abs() + 1e-6
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"max |err| {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


def test_int4_cpu_layout_is_recognized_and_unpacks_exactly() -> None:
    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    layer = qz.QuantizedLinear(weight, None, "int4", 64, torch.bfloat16, row_kernels=False)  # torch's layout
    assert layer._int4_block_rows in (64, 32)  # else prefill silently takes the slow path
    codes, scales, zeros = qz.quantize_int4(weight, 64)
    assert torch.equal(qz._unpack_cpu_int4(layer.qweight, 128, 256, layer._int4_block_rows), codes)
    want = qz.dequantize_int4(codes, scales, zeros, 64, torch.bfloat16).to(torch.bfloat16)
    assert torch.equal(layer.dequantize(), want)  # computed in fp32 and rounded once, as the reference


def test_int4_unknown_layout_still_computes_the_same_product() -> None:
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    layer = qz.QuantizedLinear(weight, None, "int4", 64, torch.bfloat16, row_kernels=False)
    x = torch.randn(11, 128, dtype=torch.bfloat16)
    layer._int4_block_rows = 0  # as on a CPU whose packed layout is not one `_unpack_cpu_int4` knows
    _assert_matches_reference(layer(x), x, weight, None, "int4", torch.bfloat16)
    with pytest.raises(qz.QuantizationError, match="layout"):
        layer.dequantize()


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "cfg",
    [tiny_config(), tiny_config(model_type="qwen2", qk_norm=False, attention_bias=True, tie_word_embeddings=True)],
    ids=["qwen3", "qwen2-bias-tied"],
)
def test_quantized_model_matches_fake_quantized_reference(cfg, kind: str, dtype: torch.dtype) -> None:
    model = build_model(cfg, dtype=dtype, seed=0)
    reference = qz.fake_quantized(model, kind)
    model = qz.quantize_weights(model, kind)
    gen = torch.Generator().manual_seed(4)
    for t in (1, 7):  # the packed path and the dequantize path
        ids = torch.randint(0, cfg.vocab_size, (2, t), generator=gen)
        with torch.inference_mode():
            got, want = model(ids, None, CAUSAL).float(), reference(ids, None, CAUSAL).float()
        # random weights give flat logits (std ~0.05): a bf16 compute keeps them within a few hundredths
        assert (got - want).abs().max() < 0.05, f"T={t}: max |Δ| {(got - want).abs().max():.3g}"
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("kind", ["none", *KINDS])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_served_bytes_equal_the_ledger_formula(kind: str, tied: bool, dtype: str) -> None:
    cfg = tiny_config(tie_word_embeddings=tied)
    model = build_model(cfg, dtype=DTYPES[dtype], seed=0)
    served = qz.quantize_weights(model, kind)  # "none": merged only
    assert qz.serving_weight_bytes(served) == served_weight_bytes(cfg, dtype, kind)


def test_served_bytes_follow_the_int4_group_size() -> None:
    cfg, group = tiny_config(), 32
    model = qz.quantize_weights(build_model(cfg, dtype=torch.bfloat16, seed=0), "int4", group_size=group)
    assert qz.serving_weight_bytes(model) == served_weight_bytes(cfg, "bf16", "int4", group)
    assert served_weight_bytes(cfg, "bf16", "int4", group) != served_weight_bytes(cfg, "bf16", "int4")


def test_quantization_frees_the_full_precision_projections() -> None:
    cfg = tiny_config()
    model = qz.quantize_weights(build_model(cfg, dtype=torch.bfloat16, seed=0), "int4")
    layer = model.layers[0]
    assert all(isinstance(m, qz.QuantizedLinear) for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj))
    assert isinstance(model.lm_head, qz.QuantizedLinear) and model.lm_head.kind == "int8"  # the head's policy
    assert model.embed_tokens.weight.dtype == torch.bfloat16  # the embedding stays dense
    assert not any(
        p.dtype == torch.bfloat16 and p.dim() == 2 and p.shape[0] != cfg.vocab_size for p in model.parameters()
    )
    dense = qz.quantize_weights(build_model(cfg, dtype=torch.bfloat16, seed=0), "none")
    assert qz.serving_weight_bytes(model) < 0.6 * qz.serving_weight_bytes(dense)
    with pytest.raises(qz.QuantizationError, match="quantized already"):
        qz.quantize_weights(model, "int8")


@pytest.mark.parametrize(
    ("overrides", "group", "match"),
    [
        ({"intermediate_size": 96}, 64, r"model\.layers\.0\.mlp\.down_proj\.weight: 96 inputs"),
        ({"intermediate_size": 72}, 32, r"model\.layers\.0\.mlp\.gate_proj\.weight: 72 outputs"),
        ({}, 48, "group size must be one of"),
    ],
)
def test_int4_refusals_name_the_weight_and_change_nothing(overrides, group: int, match: str) -> None:
    model = build_model(tiny_config(**overrides), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(qz.QuantizationError, match=match):
        qz.quantize_weights(model, "int4", group_size=group)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)  # not even merged: all or nothing


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_path_named_is_the_path_forward_takes(kind: str, dtype: torch.dtype, monkeypatch) -> None:
    """`QuantizedLinear.path(rows)` (what the prefill group's rule reads through `dequantizes_at`) is the branch
    `forward` runs: at every row count around the kernels' bounds the layer dequantizes its weight exactly where the
    path says 'dequantize'. With torch's kernels (`row_kernels=False`) the table is the same on every machine."""
    layer = qz.QuantizedLinear(torch.randn(64, 128), None, kind, 64, dtype)
    calls: list[int] = []
    dequantize = layer.dequantize
    monkeypatch.setattr(layer, "dequantize", lambda: calls.append(1) or dequantize())
    for rows in sorted({1, 2, 4, 5, 8, 9, 16, 17, 64, 65, 128, 192, 193, 256}):
        calls.clear()
        layer(torch.randn(rows, 128, dtype=dtype))
        assert bool(calls) == (layer.path(rows) == "dequantize"), (rows, layer.path(rows))
    torch_only = qz.QuantizedLinear(torch.randn(64, 128), None, kind, 64, dtype, row_kernels=False)
    many = "dequantize" if kind == "int8" or torch_only._int4_block_rows else "packed_slices"
    want = {1: "packed", qz.PACKED_MAX_ROWS: "packed", qz.PACKED_MAX_ROWS + 1: many, 128: many, 256: many}
    assert {rows: torch_only.path(rows) for rows in want} == want


def test_dequantizes_at_asks_the_layers_projections_not_the_lm_head() -> None:
    """The engine's prefill group asks whether a step's prefill rows dequantize: the layers' projections take them,
    the LM head only the sampled rows."""
    decoder = qz.quantize_weights(build_model(tiny_config(), seed=0), "int8", row_kernels=False)
    assert not qz.dequantizes_at(decoder, qz.PACKED_MAX_ROWS)  # torch's packed kernel
    assert qz.dequantizes_at(decoder, qz.PACKED_MAX_ROWS + 1)
    dense = qz.quantize_weights(build_model(tiny_config(), seed=0), "none")
    assert not qz.dequantizes_at(dense, 256)  # nothing quantized
    dense.lm_head = decoder.lm_head  # a quantized head alone
    assert isinstance(dense.lm_head, qz.QuantizedLinear) and dense.lm_head.path(256) == "dequantize"
    assert not qz.dequantizes_at(dense, 256)
