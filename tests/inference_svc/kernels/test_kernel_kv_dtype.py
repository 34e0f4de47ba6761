"""The Triton kernels over caches stored in another dtype (`--kv-cache-dtype`): int8 and fp8 e4m3 with their
per-(block, kv head) scales, and fp16 under fp32 queries.

- `store_kv` must write exactly what the torch path (`kv_quant.store_scaled`) writes, byte for byte, scales
  included, through chunked writes of several sequences and decode writes that grow a block's scale (and so
  rescale its earlier tokens).
- decode and prefill must be within FlashAttention's tolerance (2 × the same-precision torch error + floor) of
  the fp64 truth over the same stored (dequantized) values. Unassigned blocks hold NaN scales: a kernel that reads
  through a block table's padding fails. q in fp32 and fp16 (Triton 3.9's interpreter does bf16 arithmetic wrongly).
- Triton 3.9's interpreter loads torch.float8_e4m3fn exactly (fp8 → fp32), so fp8 reads run here; but its
  fp32 → float8e4nv conversion loses the carry when rounding up to the next power of two (1.97 → 1.0 and
  124.76 → 64, where torch and CUDA give 2.0 and 128), so the fp8 *store* is checked only compiled on CUDA and
  skips under the interpreter with that reason (`test_the_interpreter_fp8_rounding_limitation` pins it: when a
  Triton release fixes it, that test fails and the skip can go).
"""

from __future__ import annotations

import pytest
import torch

from inference_svc.attention import reference
from inference_svc.attention import triton as kernels
from inference_svc.attention.kv_quant import as_bytes, dequantize, store_scaled
from inference_svc.attention.triton import configs

FP8 = torch.float8_e4m3fn
BLOCK = 16


def _fp8_supported(device: str) -> None:
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 e4m3 conversions need compute capability 8.9+ in Triton")


def _writes(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(slots, values) of one engine-like history: a prefill step of two sequences (A over blocks 3, 1 from
    position 0; B in block 5 from 0), then decode steps of A and B whose values grow (their blocks rescale), then
    a chunk that fills A's block 1 to the end and starts block 6."""
    g = torch.Generator().manual_seed(0)
    a = [3 * BLOCK + p for p in range(BLOCK)] + [1 * BLOCK + p for p in range(5)]
    b = [5 * BLOCK + p for p in range(7)]
    steps = [a + b, [1 * BLOCK + 5, 5 * BLOCK + 7], [1 * BLOCK + 6, 5 * BLOCK + 8]]
    steps.append([1 * BLOCK + p for p in range(7, BLOCK)] + [6 * BLOCK + p for p in range(3)])
    growth = [1.0, 4.0, 40.0, 0.5]
    return [
        (torch.tensor(s, device=device), (torch.randn(len(s), 2, 16, generator=g) * m).to(device))
        for s, m in zip(steps, growth, strict=True)
    ]


INTERPRETER_FP8_STORE = (
    "Triton 3.9's interpreter rounds fp32 -> float8e4nv wrongly at a carry into the exponent (1.97 -> 1.0, "
    "124.76 -> 64; torch and CUDA: 2.0, 128): the fp8 store is checked compiled on CUDA only"
)


def test_the_interpreter_fp8_rounding_limitation(device) -> None:
    """Pins the reason of the skip below: the interpreter's conversion, not the kernel, is what differs."""
    if not configs.interpret_mode():
        pytest.skip("compiled mode: the fp8 store is checked directly")
    cache = torch.zeros(1, BLOCK, 1, 16, dtype=FP8)
    scales = torch.zeros(1, 1)
    x = torch.full((1, 1, 16), 1.97 * 2.0**-6)  # with the scale 2^-6 (amax / 448 ≤ 2^-6): 1.97 · 2^-6 / 2^-6
    x[0, 0, 0] = 448 * 2.0**-6
    kernels.store_kv(x, x, cache, cache.clone(), torch.tensor([0]), k_scales=scales, v_scales=scales.clone())
    assert scales.item() == 2.0**-6
    assert cache[0, 0, 0, 1].float().item() == 1.0  # torch: x.to(float8_e4m3fn) is 2.0
    assert torch.tensor(1.97).to(FP8).float().item() == 2.0


@pytest.mark.parametrize("dtype", [torch.int8, FP8], ids=["int8", "fp8"])
def test_store_kv_writes_what_the_torch_path_writes(device, dtype) -> None:
    if dtype == FP8:
        _fp8_supported(device)
        if configs.interpret_mode():
            pytest.skip(INTERPRETER_FP8_STORE)
    shape = (8, BLOCK, 2, 16)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    k_scales, v_scales = torch.zeros(8, 2, device=device), torch.zeros(8, 2, device=device)
    k_ref, v_ref, ks_ref, vs_ref = k_cache.clone(), v_cache.clone(), k_scales.clone(), v_scales.clone()
    for i, (slots, x) in enumerate(_writes(device)):
        kernels.store_kv(x, -x, k_cache, v_cache, slots, k_scales=k_scales, v_scales=v_scales)
        store_scaled(x, k_ref, ks_ref, slots)
        store_scaled(-x, v_ref, vs_ref, slots)
        assert torch.equal(k_scales, ks_ref) and torch.equal(v_scales, vs_ref), f"write {i}: scales"
        assert torch.equal(as_bytes(k_cache), as_bytes(k_ref)), f"write {i}: keys"
        assert torch.equal(as_bytes(v_cache), as_bytes(v_ref)), f"write {i}: values"
    assert bool((k_scales[1] > k_scales[3]).all()), "block 1 grew (its earlier tokens were rescaled)"


def test_store_kv_casts_into_a_cache_of_another_float_dtype(device) -> None:
    g = torch.Generator().manual_seed(2)
    k = torch.randn(5, 2, 16, generator=g).to(device)
    slots = torch.tensor([3, 17, 18, 40, 2], device=device)
    caches = [torch.zeros(4, BLOCK, 2, 16, dtype=torch.float16, device=device) for _ in range(4)]
    kernels.store_kv(k, 2 * k, caches[0], caches[1], slots)
    reference.store_kv(k, 2 * k, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def _scaled_case(context_lens: list[int], hq: int, dtype: torch.dtype, q_dtype: torch.dtype, seed: int, device: str):
    """q, caches stored as `dtype` (scaled for int8/fp8) over scattered blocks, block tables; unassigned blocks
    have NaN scales (int8/fp8) or NaN values (fp16)."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-c // BLOCK) for c in context_lens]
    pool = 2 * sum(n_blocks) + 2
    order = (torch.randperm(pool - 1, generator=g) + 1).tolist()  # block 0 is never assigned
    tables = torch.zeros(len(context_lens), max(n_blocks) + 1, dtype=torch.int32)
    caches = [torch.zeros(pool, BLOCK, 2, 16, dtype=dtype, device=device) for _ in range(2)]
    scaled = dtype in (torch.int8, FP8)
    scales = [torch.full((pool, 2), float("nan"), device=device) for _ in range(2)] if scaled else [None, None]
    if not scaled:
        for c in caches:
            c.fill_(float("nan"))
    for s, (ctx, nb) in enumerate(zip(context_lens, n_blocks, strict=True)):
        blocks = [order.pop() for _ in range(nb)]
        tables[s, :nb] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)], device=device)
        for c, sc in zip(caches, scales, strict=True):
            x = torch.randn(ctx, 2, 16, generator=g).to(device)
            if scaled:
                sc[blocks] = 0.0  # assigned: written from scratch (a NaN scale would stay NaN under max)
                store_scaled(x, c, sc, slots)
            else:
                c.view(-1, 2, 16)[slots] = x.to(dtype)
    q = torch.randn(sum(context_lens), hq, 16, generator=g).to(q_dtype).to(device)
    return q, caches, scales, tables.to(device), torch.tensor(context_lens, dtype=torch.int32, device=device)


def _truth_caches(caches: list[torch.Tensor], scales: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The stored values in fp64 (NaN where nothing was written through a NaN scale)."""
    return [
        (c.double() if s is None else dequantize(c, s[:, None, :, None]).double())
        for c, s in zip(caches, scales, strict=True)
    ]


CASES = [
    pytest.param(torch.int8, torch.float32, id="int8-q32"),
    pytest.param(torch.int8, torch.float16, id="int8-q16"),
    pytest.param(FP8, torch.float32, id="fp8-q32"),
    pytest.param(FP8, torch.float16, id="fp8-q16"),
    pytest.param(torch.float16, torch.float32, id="fp16cache-q32"),
]


@pytest.mark.parametrize(("dtype", "q_dtype"), CASES)
def test_decode_over_a_stored_cache_matches_the_reference(device, within_tolerance, dtype, q_dtype) -> None:
    if dtype == FP8:
        _fp8_supported(device)
    lens = [1, 19, 40]
    q, (kc, vc), (ks, vs), tables, ctx = _scaled_case(lens, 4, dtype, q_dtype, seed=3, device=device)
    q = q[: len(lens)]
    args = (ctx, tables, 16**-0.5)
    for splits in (1, 2):
        out = kernels.decode_attention(q, kc, vc, *args, num_splits=splits, k_scales=ks, v_scales=vs)
        assert out.dtype == q_dtype
        tk, tv = _truth_caches([kc, vc], [ks, vs])
        truth = reference.decode_attention(q.double(), tk, tv, *args)
        same = reference.decode_attention(q, kc, vc, *args, k_scales=ks, v_scales=vs)
        within_tolerance(out, truth, same, f"decode {dtype} splits={splits}")


@pytest.mark.parametrize(("dtype", "q_dtype"), CASES)
def test_prefill_over_a_stored_cache_matches_the_reference(device, within_tolerance, dtype, q_dtype) -> None:
    if dtype == FP8:
        _fp8_supported(device)
    lens = [5, 30]  # the second: an 11-token cached prefix, then a 19-token chunk
    q_lens = [5, 19]
    q, (kc, vc), (ks, vs), tables, ctx = _scaled_case(lens, 4, dtype, q_dtype, seed=4, device=device)
    q = q[: sum(q_lens)]
    cu = torch.tensor([0, 5, 24], dtype=torch.int32, device=device)
    args = (cu, ctx, tables, 16**-0.5)
    out = kernels.prefill_attention(q, kc, vc, *args, k_scales=ks, v_scales=vs)
    assert out.dtype == q_dtype
    tk, tv = _truth_caches([kc, vc], [ks, vs])
    truth = reference.prefill_attention(q.double(), tk, tv, *args)
    same = reference.prefill_attention(q, kc, vc, *args, k_scales=ks, v_scales=vs)
    within_tolerance(out, truth, same, f"prefill {dtype}")


def test_a_scaled_cache_without_scales_is_refused(device) -> None:
    q = torch.zeros(1, 2, 16, device=device)
    cache = torch.zeros(2, BLOCK, 2, 16, dtype=torch.int8, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="fp8 or int8"):
        kernels.decode_attention(q, cache, cache, one, torch.zeros(1, 1, dtype=torch.int32, device=device), 1.0)
