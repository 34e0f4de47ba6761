"""The serving decoder: the training decoder's own parameters, with merged projections and fewer temporaries.

Contract:
- `fuse_projections(model)` (a `CausalLM`) returns a `ServingDecoder` built from the model's parameters by their
  Hugging Face names: per layer, q/k/v stacked into one `[q + 2 kv, hidden]` matrix and gate/up into one
  `[2 * intermediate, hidden]` matrix, and the `CausalLM`'s own q/k/v and gate/up parameters re-pointed at row
  slices of them (views: no second copy, the state dict's names and values unchanged, so export and parity read
  the same tensors). The embedding, the norms' weights and the LM head are the same Parameters. Given a
  `ServingDecoder`, it returns it unchanged.
- `ServingDecoder.hidden_states(input_ids, positions, attention)` and `logits(hidden)` keep `CausalLM`'s contract
  and its arithmetic op for op: the same dot products (one matmul where there were three, two), q and k heads
  normalized and rotated in one pass, the norm's mean as a sum divided by the width (torch's mean on the CPU, bit
  for bit), RoPE's products and sums over the head's halves, its cos/sin gathered from tables of every position below
  max_position_embeddings built at construction (`rope_half_tables`: `rope_tables`' values, computed once instead of
  per step; positions at or past the tables' end are an index error). So with plain projections its output is
  bit-equal to the `CausalLM`'s on the CPU (tests/shared_model/test_fuse.py), and the exactness tests hold the two
  together.
- Its projections (`qkv`, `o_proj`, `gate_up`, `down_proj` of each layer, `lm_head`) are `ServingLinear`s until
  `shared_model.quantize` swaps in `QuantizedLinear`s. A `ServingLinear` is an `nn.Linear` sharing the same parameters
  that picks its kernel by the row count of a call from its `RowTable` (one literal table per projection, the only place
  a row count chooses anything). Eager serving's table is the training decoder's kernel, `F.linear`, for every call, so
  it keeps that decoder's bits. (`torch.mv` for one bf16 row is not among the kernels: oneDNN's bf16 GEMV and GEMM
  sum in orders that depend on the CPU, and on an AMD Zen 4 they differed for about one weight in eight.)
  `set_row_kernels(decoder, table)` (the compiled step's choice, `shared_model.compiled`, with the table from
  `compiled_row_table`) gives the bias-free fp32 and bf16 projections Tandem's kernels where they are built
  (`tandem_native`): `tandem::row_gemm` (fused multiply-adds; streams the weight fastest for one or two rows) and, for
  bf16 on a CPU with AMX, `tandem::tile_gemm` (the weight read once for every 64 rows), or without AMX but with
  AVX512_BF16, `tandem::dot_gemm` (4 x 4 blocks of weight and activation rows on vdpbf16ps). Each kernel gives a row the
  same bits at any row count (another summation order than `F.linear`'s, and the kernels' orders differ from each
  other). A compiled table of those kernels (`row_gemm` up to some rows, then `tile_gemm` or `dot_gemm`, then
  `F.linear`: `RowTable.gemm_bounds`) runs as one `tandem::table_gemm` call that picks the same kernel by the same row
  count inside the operator, so a compiled graph has no branch on the row count there (one graph for every T >= 2
  instead of one per step of the table: a cold start compiles fewer; `row_bounds()` says where a projection still
  branches in Python). `method()` names what a projection runs, for the serving executor's record.
- Inference only: the merged parameters do not require grad and ZeRO never sees this module; training keeps the
  plain `CausalLM`. Build it after the model has its final device and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import tandem_native
from shared_model.attention import CAUSAL, AttentionBackend
from shared_model.config import ModelConfig
from shared_model.model import CausalLM, DecoderLayer, batched, rope_inv_freq, rope_tables

ROW_KERNEL_MAX_ROWS = 17
"""Rows up to which a compiled step whose verify rows must score drafts exactly as decoding would runs every call
through `tandem::row_gemm`: one sequence's verify of the most drafts the engine allows (16) plus its last token."""
FMA_MAX_ROWS = 2
"""Rows up to which `tandem::row_gemm` runs where `tandem::tile_gemm` takes more: it streams the weight faster for
one or two rows, the tiles from three (docs/benchmarks.md: the row kernels' table)."""
TILE_MAX_ROWS = 192
"""Rows up to which the AMX tile kernels run (`tandem::tile_gemm`, and int8's and int4's in `shared_model.quantize`):
64 rows a pass over the weight, below `F.linear`'s cost (and far below dequantize + GEMM's) to 192 rows, as a step
of decodes beside a short prompt has; from about 256, as a whole prefill chunk, oneDNN's blocked GEMM (`F.linear`)
wins (docs/benchmarks.md: the tiles' pipeline)."""
DOT_MAX_ROWS = 64
"""Rows up to which `tandem::dot_gemm` (AVX512_BF16 dot products, where AMX tiles are not usable) runs: from 3 rows
(`row_gemm` streams one or two faster) to 64 it beat `F.linear` on an AMD Zen 4, and a 64-stream decode step then
runs in the decode runner instead of the graph; from about 96 rows oneDNN's blocked GEMM (`F.linear`) wins
(docs/benchmarks.md §43, §44)."""
_KERNEL_NAMES = {
    "row_gemm": "tandem::row_gemm",
    "tile_gemm": "tandem::tile_gemm",
    "dot_gemm": "tandem::dot_gemm",
    "linear": "F.linear",
    "onednn": "oneDNN matmul",
}


@dataclass(frozen=True)
class RowTable:
    """A projection's kernel by the row count of a call: the first `(most rows, kernel)` step that holds, else
    `more`. Kernels: 'row_gemm', 'tile_gemm', 'dot_gemm' (Tandem's), 'linear' (`F.linear`) and, as `more` only,
    'onednn' (oneDNN's matmul, `mkldnn::_linear_pointwise`, the weight in its plain layout: `compiled_row_table`)."""

    steps: tuple[tuple[int, str], ...] = ()
    more: str = "linear"

    def kernel(self, rows: int) -> str:
        for most, name in self.steps:
            if rows <= most:
                return name
        return self.more

    def gemm_bounds(self) -> tuple[int, int] | None:
        """(row_max, tile_max) of `tandem::table_gemm` when this table is one it runs (row_gemm up to some rows,
        then optionally tile_gemm or dot_gemm, then `F.linear` or oneDNN's matmul: the operator's `onednn`, from
        `more`): the kernel is then chosen inside that one operator, at run time, not by a branch a compiled graph
        traces (one graph for every row count); None for any other table. (The operator runs tile_gemm where AMX
        tiles are usable, else dot_gemm: the rule that names them.)"""
        names = tuple(name for _, name in self.steps)
        runs = names in (("row_gemm",), ("row_gemm", "tile_gemm"), ("row_gemm", "dot_gemm"))
        if not runs or self.more not in ("linear", "onednn"):
            return None
        row_max = self.steps[0][0]
        return row_max, self.steps[1][0] if len(self.steps) > 1 else row_max

    @property
    def largest_step(self) -> int:
        """The most rows any step takes (0 without steps): a compiled step's graphs branch there."""
        return self.steps[-1][0] if self.steps else 0

    def describe(self) -> str:
        """'1-2 rows: tandem::row_gemm; 3-192 rows: tandem::tile_gemm; more: F.linear' (for the load plan)."""
        parts, low = [], 1
        for most, name in self.steps:
            span = f"{low}" if most == low else f"{low}-{most}"
            parts.append(f"{span} row{'s' if most > 1 else ''}: {_KERNEL_NAMES[name]}")
            low = most + 1
        parts.append(f"{'more' if self.steps else 'every row count'}: {_KERNEL_NAMES[self.more]}")
        return "; ".join(parts)


PLAIN_TABLE = RowTable()
"""Eager serving: `F.linear` for every call, the training decoder's kernel and bits."""


def compiled_row_table(
    dtype: torch.dtype, tiles: bool, exact_verify: bool, dot: bool = False, onednn: bool = False
) -> RowTable:
    """The compiled step's table for a bias-free fp32 or bf16 projection on a CPU with Tandem's kernels.

    `exact_verify` (speculative decoding on by default): `row_gemm` up to `ROW_KERNEL_MAX_ROWS` rows, so a verify
    step's rows score their drafts with a decode row's bits. Otherwise bf16 with AMX tiles (`tiles`): `row_gemm` for
    up to `FMA_MAX_ROWS` rows, `tile_gemm` up to `TILE_MAX_ROWS`; bf16 without tiles on a CPU with AVX512_BF16
    (`dot`): `row_gemm` up to `FMA_MAX_ROWS`, `dot_gemm` up to `DOT_MAX_ROWS`; otherwise, or fp32: `row_gemm` up
    to `FMA_MAX_ROWS`. `F.linear` beyond, or for fp32 with `onednn` (`fp32_onednn`'s rule) oneDNN's matmul. (A
    request that asks for speculation on such an engine keeps its output distribution; its verify rows may round
    otherwise than its decode rows.)"""
    more = "onednn" if onednn and dtype == torch.float32 else "linear"
    if exact_verify:
        return RowTable(((ROW_KERNEL_MAX_ROWS, "row_gemm"),), more)
    if dtype == torch.bfloat16 and tiles:
        return RowTable(((FMA_MAX_ROWS, "row_gemm"), (TILE_MAX_ROWS, "tile_gemm")))
    if dtype == torch.bfloat16 and dot:
        return RowTable(((FMA_MAX_ROWS, "row_gemm"), (DOT_MAX_ROWS, "dot_gemm")))
    return RowTable(((FMA_MAX_ROWS, "row_gemm"),), more)


def fp32_onednn(vendor: str) -> bool:
    """Whether a compiled step's many-row fp32 products run through oneDNN's matmul instead of `F.linear` (MKL's
    sgemm in torch's CPU build): on a CPU that is not Intel's (`vendor`, /proc/cpuinfo's vendor_id), where MKL
    takes its generic code path, and where torch carries oneDNN. On an AMD Zen 4 oneDNN ran a 512-row prefill
    chunk's products faster (docs/benchmarks.md §46); on Intel's CPUs MKL keeps them (not measured against)."""
    return vendor != "GenuineIntel" and torch.backends.mkldnn.is_available()


class ServingLinear(nn.Linear):
    """`nn.Linear` whose kernel a `RowTable` picks by the row count of each call (see the module doc)."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> ServingLinear:
        """A ServingLinear holding `linear`'s own parameters (no copy); `linear` itself if it is one already."""
        if isinstance(linear, ServingLinear):
            return linear
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        out.weight, out.bias = linear.weight, linear.bias
        return out

    row_table: RowTable | None = None
    """The compiled step's table (`set_row_kernels`); None: `PLAIN_TABLE`."""

    @property
    def table(self) -> RowTable:
        return self.row_table if self.row_table is not None else PLAIN_TABLE

    def can_use_row_kernel(self) -> bool:
        w = self.weight
        return (
            self.bias is None and w.dtype in (torch.float32, torch.bfloat16) and w.device.type == "cpu"
            and w.is_contiguous() and w.shape[1] % 32 == 0 and tandem_native.available()
        )  # fmt: skip

    def method(self) -> tuple[str, str]:
        """(The method this projection runs, its row-count table in words): what `forward` does, for the load plan."""
        table = self.table
        kernels = [name for _, name in table.steps] + [table.more]
        return "+".join(dict.fromkeys(kernels)), table.describe()

    def row_bounds(self) -> tuple[int, ...]:
        """The row counts at which `forward` branches in Python (a compiled step traces a graph per branch, as for
        `QuantizedLinear.row_bounds`): none where one `tandem::table_gemm` call chooses the kernel at run time."""
        table = self.table
        if self.row_table is not None and table.gemm_bounds() is not None:
            return ()
        return tuple(most for most, _ in table.steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.row_table is not None and x.dtype == self.weight.dtype:
            bounds = self.row_table.gemm_bounds()
            if bounds is not None:  # the kernel by `rows`, chosen in the operator: no branch for a graph to trace
                onednn = self.row_table.more == "onednn"
                x2 = x.reshape(rows, x.shape[-1])  # [rows, in]
                y = torch.ops.tandem.table_gemm(x2, self.weight, *bounds, onednn)  # [rows, out]
                return y.view(*x.shape[:-1], self.out_features)  # [..., out]
        kernel = self.table.kernel(rows)
        if kernel == "linear" or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        if kernel == "onednn":  # a table without table_gemm's steps: oneDNN's matmul from here
            x2 = x.reshape(rows, x.shape[-1])  # [rows, in]
            y = torch.ops.mkldnn._linear_pointwise(x2, self.weight, self.bias, "none", [], "")  # [rows, out]
            return y.view(*x.shape[:-1], self.out_features)  # [..., out]
        op = {"tile_gemm": torch.ops.tandem.tile_gemm, "dot_gemm": torch.ops.tandem.dot_gemm}.get(kernel)
        op = op if op is not None else torch.ops.tandem.row_gemm
        y = op(x.reshape(rows, x.shape[-1]), self.weight)  # [rows, out]
        return y.view(*x.shape[:-1], self.out_features)  # [..., out]


def rms_norm_into(x: torch.Tensor, weight: torch.Tensor, width: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """`shared_model.model.rms_norm` with fewer temporaries: x / rms(x) over the last axis in fp32, times `weight`
    in x's dtype; `width` and `eps` are fp32 0-d tensors (no scalar wrapping per call, and graph constants when
    traced). A sum divided by the width is torch's CPU mean bit for bit."""
    h = x.float()
    ms = torch.sum(h * h, dim=-1, keepdim=True).div_(width)
    return weight * (h * ms.add_(eps).rsqrt_()).to(x.dtype)


ROPE_TABLE_BLOCK = 256
"""Positions per `rope_tables` call while building the serving tables: a call of a step's size, each one's cos/sin
vectorized as a step's own call would be (no chunk of a parallel loop ending mid-vector)."""


def rope_half_tables(config: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position_embeddings, D/2] in `dtype` on the CPU: `rope_tables` of every position the model
    serves, its duplicated half kept once. A gather from them (`rope_lookup`) is the same bits as `rope_tables` for
    those positions, computed once at load instead of in every step (where a compiled step recomputed them in each
    layer's rotation)."""
    inv_freq, half = rope_inv_freq(config), config.head_dim // 2
    cos, sin = [], []
    for start in range(0, config.max_position_embeddings, ROPE_TABLE_BLOCK):
        stop = min(start + ROPE_TABLE_BLOCK, config.max_position_embeddings)
        c, s = rope_tables(torch.arange(start, stop)[None], inv_freq, dtype)  # [1, n, 1, D] each
        cos.append(c[0, :, 0, :half])
        sin.append(s[0, :, 0, :half])
    return torch.cat(cos), torch.cat(sin)


def rope_lookup(
    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] (each below the tables' length) -> cos, sin [B, T, 1, D/2] in `dtype`: `rope_tables`' first
    halves (their second halves are the same values)."""
    return F.embedding(positions, cos).to(dtype)[:, :, None, :], F.embedding(positions, sin).to(dtype)[:, :, None, :]


def rope_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`shared_model.model.apply_rope` over halves: x [B, T, H, D], cos/sin [B, T, 1, D/2] (`rope_lookup`). Its
    products and sums rounded as apply_rope rounds them (x1 c - x2 s is x1 c + (-x2) s), without building the
    rotated copy: one pass for a compiled step."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class ServingLayer(nn.Module):
    """One decoder layer as served: merged q/k/v and gate/up, the attention call left to the backend."""

    def __init__(self, layer: DecoderLayer, config: ModelConfig) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx, self.scale = attn.core.layer_idx, attn.core.scale
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.qk_size = config.q_size + config.kv_size  # the q and k heads, side by side in qkv's output
        self.input_norm = layer.input_layernorm.weight  # [hidden], the same Parameter
        self.post_attention_norm = layer.post_attention_layernorm.weight
        self.qkv: nn.Module = _merge([attn.q_proj, attn.k_proj, attn.v_proj])  # [.., hidden] -> [.., q + 2 kv]
        self.o_proj: nn.Module = ServingLinear.sharing(attn.o_proj)
        self.gate_up: nn.Module = _merge([mlp.gate_proj, mlp.up_proj])  # [.., hidden] -> [.., 2 * intermediate]
        self.down_proj: nn.Module = ServingLinear.sharing(mlp.down_proj)
        qk_norm = None
        if attn.q_norm is not None and attn.k_norm is not None:  # q_norm's weight for each q head, then k_norm's
            q = attn.q_norm.weight.detach().expand(attn.num_heads, -1)
            k = attn.k_norm.weight.detach().expand(attn.num_kv_heads, -1)
            qk_norm = torch.cat([q, k])  # [Hq + Hkv, D]
        self.register_buffer("qk_norm", qk_norm)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend, eps: torch.Tensor,
        widths: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:  # fmt: skip
        # x: [B, T, hidden]; widths: (hidden, head_dim) as fp32 0-d tensors
        b, t, _ = x.shape
        hq, hkv, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(rms_norm_into(x, self.input_norm, widths[0], eps))  # [B, T, q + 2 kv]
        qk = qkv[..., : self.qk_size].view(b, t, hq + hkv, dim)
        if self.qk_norm is not None:
            qk = rms_norm_into(qk, self.qk_norm, widths[1], eps)
        qk = rope_into(qk, cos, sin)
        q, k = qk[:, :, :hq], qk[:, :, hq:]  # [B, T, Hq, D], [B, T, Hkv, D]
        v = qkv[..., self.qk_size :].view(b, t, hkv, dim)
        out = backend(self.layer_idx, q, k, v, self.scale)  # [B, T, Hq, D]
        x = x + self.o_proj(out.reshape(b, t, hq * dim))
        gate, up = self.gate_up(rms_norm_into(x, self.post_attention_norm, widths[0], eps)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class ServingDecoder(nn.Module):
    """The decoder as served (see the module docstring): `hidden_states` and `logits` as `CausalLM`'s."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        c = self.config = model.config
        stack = model.model
        device = stack.embed_tokens.weight.device
        with torch.no_grad():
            self.embed_tokens = stack.embed_tokens  # the same module: its Parameter, tied or not
            self.layers = nn.ModuleList(ServingLayer(layer, c) for layer in stack.layers)
            self.final_norm = stack.norm.weight
            self.lm_head: nn.Module = ServingLinear.sharing(model.lm_head)  # the same Parameter: a tied head stays tied
        self.eps = c.rms_norm_eps
        f32 = {"dtype": torch.float32, "device": device}
        cos, sin = rope_half_tables(c, stack.embed_tokens.weight.dtype)  # [P, D/2] each
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        self.register_buffer("eps_t", torch.tensor(c.rms_norm_eps, **f32), persistent=False)
        self.register_buffer("hidden_width", torch.tensor(float(c.hidden_size), **f32), persistent=False)
        self.register_buffer("head_width", torch.tensor(float(c.head_dim), **f32), persistent=False)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, T, hidden]. input_ids and positions: [B, T] (or [T], read as B=1)."""
        input_ids, positions = batched(input_ids, positions)
        backend = CAUSAL if attention is None else attention
        x = self.embed_tokens(input_ids)  # [B, T, hidden]
        cos, sin = rope_lookup(positions, self.rope_cos, self.rope_sin, x.dtype)  # [B, T, 1, D/2] each
        widths = (self.hidden_width, self.head_width)
        for layer in self.layers:
            x = layer(x, cos, sin, backend, self.eps_t, widths)
        return rms_norm_into(x, self.final_norm, self.hidden_width, self.eps_t)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: [..., hidden] → [..., vocab]."""
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention: AttentionBackend | None = None,
    ) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, positions, attention))

    def projections(self) -> list[nn.Module]:
        """Every projection: each layer's qkv, o_proj, gate_up and down_proj, then the LM head."""
        out: list[nn.Module] = []
        for layer in self.layers:
            out += [layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj]
        return [*out, self.lm_head]


def fuse_projections(model: CausalLM | ServingDecoder) -> ServingDecoder:
    """The serving decoder of `model` (see the module docstring); a `ServingDecoder` is returned unchanged."""
    return model if isinstance(model, ServingDecoder) else ServingDecoder(model)


def set_row_kernels(model: ServingDecoder, table: RowTable | None) -> int:
    """Give the decoder's `ServingLinear`s that can take Tandem's kernels (bias-free fp32/bf16 on a CPU where the
    library is built) `table` as their row-count table, or their eager table back (None); returns how many
    projections run a compiled table now."""
    count = 0
    for linear in model.projections():
        if isinstance(linear, ServingLinear):
            linear.row_table = table if table is not None and linear.can_use_row_kernel() else None
            count += linear.row_table is not None
    return count


def _merge(linears: list[nn.Linear]) -> ServingLinear:
    """One Linear over the stacked weights (and biases) of several sharing an input; theirs become views of it."""
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("cannot merge projections where only some have a bias")
    bias = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None  # type: ignore[union-attr]
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    merged = ServingLinear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    merged.weight = nn.Parameter(weight, requires_grad=False)
    merged.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return merged
