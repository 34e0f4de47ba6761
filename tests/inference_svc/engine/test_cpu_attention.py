"""The C++ paged decode kernel of the CPU path against the fp64 reference, on scattered blocks, ragged lengths and
grouped heads; its refusals; and that the torch ops use it (and keep the torch path for scaled caches)."""

from __future__ import annotations

import pytest
import torch

from inference_svc.attention import native_cpu as cpu_attention
from inference_svc.attention import reference
from inference_svc.attention.torch_ops import torch_ops

native = cpu_attention.extension()
needs_kernel = pytest.mark.skipif(native is None, reason="needs AVX-512 and a C++ compiler")


def _case(dtype: torch.dtype, lens: list[int], hq: int = 12, hkv: int = 4, d: int = 64, bs: int = 16, seed: int = 0):
    """A cache of 64 blocks with every sequence's blocks scattered over it (never consecutive), and its queries."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(64, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(64, bs, hkv, d, generator=g).to(dtype)
    order = torch.randperm(64, generator=g).tolist()
    width = max(-(-n // bs) for n in lens)
    tables = torch.zeros(len(lens), width + 1, dtype=torch.int32)  # one padding column past the longest
    for i, n in enumerate(lens):
        blocks = [order.pop() for _ in range(-(-n // bs))]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g)
    return q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), tables


DTYPES = [
    (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.bfloat16, 1e-2),
    (torch.float16, torch.float16, 2e-3),
    (torch.bfloat16, torch.float32, 1e-2),  # a bf16 model over an fp32 cache (--kv-cache-dtype fp32)
]
"""(q dtype, cache dtype, tolerance relative to the largest output)."""


@needs_kernel
@pytest.mark.parametrize(("q_dtype", "cache_dtype", "tol"), DTYPES)
@pytest.mark.parametrize("lens", [[1], [37], [16, 300, 5, 64], [129, 2]])
def test_decode_matches_the_reference(q_dtype, cache_dtype, tol: float, lens: list[int]) -> None:
    q, k_cache, v_cache, ctx, tables = _case(cache_dtype, lens)
    q = q.to(q_dtype)
    out = native.decode_attention(q, k_cache, v_cache, ctx, tables, 0.125)
    assert out.shape == q.shape and out.dtype == q_dtype
    want = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), ctx, tables, 0.125)
    assert (out.double() - want).abs().max() <= tol * max(want.abs().max().item(), 1.0)
    one = native.decode_attention(q[-1:].contiguous(), k_cache, v_cache, ctx[-1:], tables[-1:].contiguous(), 0.125)
    assert torch.equal(one, out[-1:])  # a sequence's result does not depend on the batch


@needs_kernel
@pytest.mark.parametrize(("q_dtype", "cache_dtype", "tol"), DTYPES[:2])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(2, 2, 16), (8, 1, 32), (6, 2, 80), (4, 4, 96), (16, 2, 128)])
def test_every_head_size_and_group_the_kernel_blocks(q_dtype, cache_dtype, tol: float, hq: int, hkv: int,
                                                      d: int) -> None:  # fmt: skip
    """The kernel keeps up to four query rows by four 16-wide chunks of the head in registers: head sizes of 1, 2,
    5 (4 + 1), 6 (4 + 2) and 8 chunks and groups of 1, 3, 4 and 8 rows take every block shape and its remainders."""
    q, k_cache, v_cache, ctx, tables = _case(cache_dtype, [1, 17, 300, 33], hq=hq, hkv=hkv, d=d)
    q = q.to(q_dtype)
    out = native.decode_attention(q, k_cache, v_cache, ctx, tables, d**-0.5)
    want = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), ctx, tables, d**-0.5)
    assert (out.double() - want).abs().max() <= tol * max(want.abs().max().item(), 1.0)
    for i in range(len(ctx)):
        alone = native.decode_attention(q[i : i + 1], k_cache, v_cache, ctx[i : i + 1], tables[i : i + 1], d**-0.5)
        assert torch.equal(alone, out[i : i + 1]), f"row {i}"


@needs_kernel
@pytest.mark.parametrize(("q_dtype", "cache_dtype", "tol"), DTYPES)
def test_queries_of_one_sequence_share_its_reads_and_keep_their_own_context(q_dtype, cache_dtype, tol) -> None:
    """Verify rows: consecutive queries over one block table with lengths growing by one (a run, scored together)
    beside a plain decode, a run that crosses a block boundary, and two rows that are not a run (same table,
    lengths not consecutive). Each row matches the reference over its own context, and equals, bit for bit, the
    kernel on that row alone (a run computes exactly what its rows would one by one)."""
    q, k_cache, v_cache, _, base = _case(cache_dtype, [300, 40, 90])
    rows = [(0, n) for n in range(291, 296)] + [(1, 40)] + [(2, n) for n in range(30, 36)] + [(0, 100), (0, 102)]
    ctx = torch.tensor([n for _, n in rows], dtype=torch.int32)
    tables = base[[t for t, _ in rows]].contiguous()
    q = torch.randn(len(rows), q.shape[1], q.shape[2], generator=torch.Generator().manual_seed(1)).to(q_dtype)
    out = native.decode_attention(q, k_cache, v_cache, ctx, tables, 0.125)
    want = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), ctx, tables, 0.125)
    assert (out.double() - want).abs().max() <= tol * max(want.abs().max().item(), 1.0)
    for i in range(len(rows)):
        alone = native.decode_attention(q[i : i + 1], k_cache, v_cache, ctx[i : i + 1], tables[i : i + 1], 0.125)
        assert torch.equal(alone, out[i : i + 1]), f"row {i}"


@needs_kernel
def test_decode_refuses_reads_outside_the_cache() -> None:
    q, k_cache, v_cache, ctx, tables = _case(torch.float32, [20])
    bad = tables.clone()
    bad[0, 1] = 64  # one past the last block
    with pytest.raises(RuntimeError, match="block id out of range"):
        native.decode_attention(q, k_cache, v_cache, ctx, bad, 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        native.decode_attention(q, k_cache, v_cache, torch.tensor([10_000], dtype=torch.int32), tables, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        native.decode_attention(q[:, :10].contiguous(), k_cache, v_cache, ctx, tables, 0.125)


@needs_kernel
def test_torch_ops_store_and_decode_through_the_kernel() -> None:
    q, k_cache, v_cache, ctx, tables = _case(torch.float32, [16, 40])
    ops = torch_ops()
    k, v = torch.randn(2, 4, 64), torch.randn(2, 4, 64)
    slots = torch.tensor([int(tables[0, 0]) * 16 + 15, int(tables[1, 2]) * 16 + 7])  # each sequence's last token
    ops.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 4, 64)[slots], k) and torch.equal(v_cache.view(-1, 4, 64)[slots], v)
    out = ops.decode_attention(q, k_cache, v_cache, ctx, tables, 0.125)
    assert torch.equal(out, native.decode_attention(q, k_cache, v_cache, ctx, tables, 0.125))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_in_one_call_is_the_store_then_the_attention_bit_for_bit(dtype: torch.dtype) -> None:
    q, k_cache, v_cache, ctx, tables = _case(dtype, [16, 40])
    q = q.to(dtype)
    qkv = torch.randn(2, 12 + 4 + 4, 64).to(dtype)  # K and V as strided views of a merged projection, as served
    k, v = qkv[:, 12:16], qkv[:, 16:]
    slots = torch.tensor([int(tables[0, 0]) * 16 + 15, int(tables[1, 2]) * 16 + 7])
    caches = k_cache.clone(), v_cache.clone()
    out = torch_ops().decode_step(q[None], k[None], v[None], *caches, slots, ctx, tables, 0.125)
    native.store_kv(k, v, k_cache, v_cache, slots)
    want = native.decode_attention(q, k_cache, v_cache, ctx, tables, 0.125)
    assert out is not None and out.shape == (1, *q.shape) and torch.equal(out[0], want)
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)
    fp8 = torch.zeros(64, 16, 4, 64, dtype=torch.float8_e4m3fn)  # a cache dtype the kernel does not read: None
    assert torch_ops().decode_step(q[None], k[None], v[None], fp8, fp8.clone(), slots, ctx, tables, 0.125) is None


@needs_kernel
def test_store_writes_strided_rows_casts_and_refuses_slots_outside_the_cache() -> None:
    """K and V arrive as views of the merged q/k/v projection's output (rows strided past q); they are copied row by
    row into a cache of their dtype, cast (through torch) into another, and a slot past the cache is refused."""
    _, k_cache, v_cache, _, _ = _case(torch.float32, [16])
    qkv = torch.randn(3, 8 + 4 + 4, 64)  # [T, q heads + k heads + v heads, D]
    k, v = qkv[:, 8:12], qkv[:, 12:]  # non-contiguous [T, 4, 64] views
    slots = torch.tensor([3, 17, 1000])
    native.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 4, 64)[slots], k) and torch.equal(v_cache.view(-1, 4, 64)[slots], v)
    bf16 = k_cache.bfloat16(), v_cache.bfloat16()
    native.store_kv(2 * k, 2 * v, *bf16, slots)
    assert torch.equal(bf16[0].view(-1, 4, 64)[slots], (2 * k).bfloat16())
    assert torch.equal(bf16[1].view(-1, 4, 64)[slots], (2 * v).bfloat16())
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="out of range"):
        native.store_kv(3 * k, v, k_cache, v_cache, torch.tensor([0, 1, k_cache.shape[0] * 16]))
    assert torch.equal(k_cache, before)  # nothing written


def test_head_sizes_the_kernel_does_not_take_run_the_torch_ops() -> None:
    q, k_cache, v_cache, ctx, tables = _case(torch.float32, [16, 40], d=24)  # 24: not a multiple of 16
    out = torch_ops().decode_attention(q, k_cache, v_cache, ctx, tables, 0.2)
    want = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), ctx, tables, 0.2)
    assert (out.double() - want).abs().max() <= 1e-5


def _meta(slots: list[int], lens: list[int], tables: torch.Tensor, prefill_tokens: int = 0):
    """A step of decode queries at `slots`, then one prefill chunk of `prefill_tokens` (none: a decode-only step)."""
    from inference_svc.attention.paged import AttentionMetadata

    chunks = 1 if prefill_tokens else 0
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots + [0] * prefill_tokens), num_decode_tokens=len(slots),
        decode_context_lens=torch.tensor(lens, dtype=torch.int32), decode_block_tables=tables,
        cu_seqlens_q=torch.tensor([0, prefill_tokens][: chunks + 1], dtype=torch.int32),
        prefill_context_lens=torch.full((chunks,), prefill_tokens, dtype=torch.int32),
        prefill_block_tables=torch.zeros(chunks, 1, dtype=torch.int32),
    )  # fmt: skip


@needs_kernel
def test_graph_decode_serves_only_caches_its_kernel_reads() -> None:
    from inference_svc.engine.kv_cache import KVCache

    cpu = torch.device("cpu")
    assert cpu_attention.GraphDecode.serves(KVCache.allocate(2, 4, 16, 2, 16, torch.bfloat16, cpu))
    assert not cpu_attention.GraphDecode.serves(KVCache.allocate(2, 4, 16, 2, 16, torch.int8, cpu))  # scaled
    assert not cpu_attention.GraphDecode.serves(KVCache.allocate(2, 4, 16, 2, 24, torch.float32, cpu))


@needs_kernel
def test_graph_decode_is_the_decode_step_over_its_layer_of_the_cache_it_is_given() -> None:
    """The graph's operator takes the whole cache and the step's metadata as arguments (the cache declared written
    in place, no handle): a layer's call is `decode_step` over that layer, bit for bit; it refuses a layer outside
    the cache; a step with prefill tokens is not a decode-only step."""
    from inference_svc.engine.kv_cache import KVCache

    cache = KVCache.allocate(2, 64, 16, 4, 64, torch.float32, torch.device("cpu"))
    q, k_cache, v_cache, ctx, tables = _case(torch.float32, [16, 40])
    cache.data[1, 0].copy_(k_cache)
    cache.data[1, 1].copy_(v_cache)
    k, v = torch.randn(2, 4, 64), torch.randn(2, 4, 64)
    slots = [int(tables[0, 0]) * 16 + 15, int(tables[1, 2]) * 16 + 7]
    assert not cpu_attention.GraphDecode.covers(_meta(slots, ctx.tolist(), tables, prefill_tokens=3))
    meta = _meta(slots, ctx.tolist(), tables)
    assert cpu_attention.GraphDecode.covers(meta)
    graph = cpu_attention.GraphDecode(cache, meta)
    assert graph.kv_cache is cache.data  # the one cache, not a copy or a binding
    out = graph(1, q[None], k[None], v[None], 0.125)
    with pytest.raises(RuntimeError, match="layer 2 out of range"):
        graph(2, q[None], k[None], v[None], 0.125)
    want = native.decode_step(q[None], k[None], v[None], k_cache, v_cache, torch.tensor(slots), ctx, tables, 0.125)
    assert torch.equal(out, want)
    assert torch.equal(cache.data[1, 0], k_cache) and torch.equal(cache.data[1, 1], v_cache)  # stored the same
    assert not cache.data[0].any()  # layer 0 untouched
    schema = torch.ops.tandem.paged_attention.default._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["kv_cache"] and "handle" not in str(schema)
    for fn in ("bind_caches", "unbind", "begin_decode", "end_decode", "graph_calls"):  # no registry to bind into
        assert not hasattr(native, fn), fn


@needs_kernel
def test_store_refuses_rows_of_another_shape_on_its_casting_path() -> None:
    k_cache, v_cache = torch.zeros(4, 16, 4, 64, dtype=torch.bfloat16), torch.zeros(4, 16, 4, 64, dtype=torch.bfloat16)
    rows = torch.randn(2, 2, 128)  # fp32 into a bf16 cache (the casting path): as many elements, other heads
    with pytest.raises(RuntimeError, match=r"must be \[T, Hkv, D\]"):
        native.store_kv(rows, rows, k_cache, v_cache, torch.tensor([1, 2]))
    assert not k_cache.any() and not v_cache.any()
    native.store_kv(rows.view(1, 2, 4, 64), rows.view(1, 2, 4, 64), k_cache, v_cache, torch.tensor([1, 2]))
    assert torch.equal(k_cache.view(-1, 4, 64)[1:3], rows.view(2, 4, 64).to(torch.bfloat16))
