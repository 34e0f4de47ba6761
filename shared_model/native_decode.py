"""The decode runner: a decode-only step through an fp32 or bf16 `ServingDecoder`, in one C++ call.

Contract:
- `NativeDecode.unsupported(model)` says why the runner cannot serve `model` here (a phrase), or None: it needs
  Tandem's native library (`tandem_native`), fp32 or bf16 on the CPU, every projection of every layer either a
  bias-free `ServingLinear` that `tandem::row_gemm` takes (contiguous, widths a multiple of 32) or a
  `QuantizedLinear` with a row kernel (`QuantizedLinear.row_kernel`: int8's `int8_gemv`, int4's `int4_gemv`), no
  adapter-wrapped projection, a head size that is a multiple of 16 and one dtype throughout.
- `NativeDecode(model, max_rows)` holds the model's own tensors (the embedding, each layer's norms and merged
  projections, the q/k norms, the RoPE tables, the final norm: no copy; the decoder must not change after it).
  It takes steps of up to `most_rows(model, max_rows)` rows (fewer than `max_rows` where a projection's kernels
  take fewer: a dense one's row table, `tandem::row_gemm` then `tandem::tile_gemm`; a quantized one's row kernel),
  so each projection runs the kernel its module runs for that row count.
  `hidden_states(input_ids, positions, kv_cache, slot_mapping, context_lens, block_tables)`: T tokens (1 <= T <=
  max_rows), each a decode query at its position over its sequence's cached context (context_lens counts the
  token itself), with the KV cache and metadata of `inference_svc.attention.native_cpu.GraphDecode` -> the final-norm
  hidden states [T, hidden], as `ServingDecoder.hidden_states` with that backend; each layer's K/V stored at
  slot_mapping. Everything is checked (ids, positions, slots, lengths, block ids, the cache's shape and dtype)
  before anything is written. The GIL is released while it runs.
  `logits(...)` (same arguments; only where `has_lm_head`): the same step through the LM head -> [T, vocab] in the
  weights' dtype, each row what `model.logits` gives for that row in a call of T rows (the head's kernel for T rows).
  The runner holds the head when `head_unsupported(model, rows)` is None for its rows: the head is a projection the
  runner calls, and its kernel takes that many rows.
- Arithmetic (`tandem_native/csrc/decode_runner.cpp`): the projections are the kernels their modules run for those
  rows and the attention `tandem::paged_attention`'s, so a row's bits do not depend on the other rows of its step
  (a verify item's rows score drafts with a decode row's bits); the norms, RoPE, SiLU-mul and residuals are its
  own, rounded where eager rounds (as the compiled graph does too), the norms' sums in another order than torch's.
  So it matches the compiled step to within its tolerance, not bit for bit.
- Why: a batch-1 decode step through the compiled graph spends about a sixth of its time between the kernels (the
  dispatcher, a fresh output per operator, a handle per graph input, dynamo's wrappers: docs/benchmarks.md §39);
  here the kernels run back to back. Which steps take it is the engine's load-time choice
  (`inference_svc.executor.prepare.choose_decode_runner`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import tandem_native
from shared_model.quantize import QuantizedLinear
from shared_model.serving_model import ServingDecoder, ServingLinear

DTYPES = (torch.float32, torch.bfloat16)
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down_proj")
"""Each layer's projections, in the order the runner takes them."""
Spec = tuple[str, torch.Tensor, torch.Tensor | None, int, int, int, int, int]
"""A projection as the runner takes it: (kernel, weight, scales or None, group, out_features, in_features, row_max,
tile_max); the last two a dense weight's row table (`tandem::row_gemm` up to row_max rows, `tandem::tile_gemm` up to
tile_max), both its row kernel's most rows for a quantized one."""


class NativeDecode:
    """A decoder's decode-only steps in one C++ call (see the module docstring)."""

    def __init__(self, model: ServingDecoder, max_rows: int) -> None:
        why = self.unsupported(model)
        if why is not None:
            raise ValueError(f"the decode runner cannot serve this model: {why}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.max_rows = self.most_rows(model, max_rows)
        first = model.layers[0]
        module: Any = tandem_native.library()
        self._runner = module.DecodeRunner(
            [[ly.input_norm.detach(), ly.post_attention_norm.detach()] for ly in model.layers],
            [[_spec(getattr(ly, name), self.max_rows) for name in PROJECTIONS] for ly in model.layers],
            [None if ly.qk_norm is None else ly.qk_norm.contiguous() for ly in model.layers],
            model.embed_tokens.weight.detach(), model.final_norm.detach(), model.rope_cos, model.rope_sin,
            first.num_heads, first.num_kv_heads, first.head_dim, float(model.eps), float(first.scale), self.max_rows,
            None if self.head_unsupported(model, self.max_rows) else _spec(model.lm_head, self.max_rows),
        )  # fmt: skip
        self.has_lm_head: bool = self._runner.has_lm_head

    @staticmethod
    def unsupported(model: ServingDecoder) -> str | None:
        """Why the runner cannot serve `model` here (a phrase), or None when it can."""
        if not tandem_native.available():
            return "Tandem's native library does not run here"
        dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device.type
        if dtype not in DTYPES or device != "cpu":
            return f"the weights are {dtype} on {device}; it runs fp32 or bf16 on the CPU"
        if model.config.head_dim % 16:
            return f"head_dim {model.config.head_dim} is not a multiple of 16"
        for i, layer in enumerate(model.layers):
            for name in PROJECTIONS:
                why = _projection_unsupported(getattr(layer, name), dtype)
                if why is not None:
                    return f"layer {i}'s {name} {why}"
        return None

    @staticmethod
    def head_unsupported(model: ServingDecoder, rows: int) -> str | None:
        """Why a runner of `rows` rows over `model` cannot hold its LM head (a phrase), or None when it can."""
        head = model.lm_head
        why = _projection_unsupported(head, model.embed_tokens.weight.dtype)
        if why is not None:
            return f"the LM head {why}"
        most = _most_rows(head, rows)
        return None if most >= rows else f"the LM head's kernel takes {most} rows a call, the runner's steps {rows}"

    @staticmethod
    def most_rows(model: ServingDecoder, rows: int) -> int:
        """The most rows a step of the runner takes: `rows`, or fewer where a projection's kernel takes fewer (a
        dense one's row table: `tandem::row_gemm`, then `tandem::tile_gemm`, up to its `gemm_bounds`; a quantized
        one's row kernel: int8's `int8_gemv` rows, int4's `int4_gemv` rows)."""
        for layer in model.layers:
            for name in PROJECTIONS:
                rows = _most_rows(getattr(layer, name), rows)
        return rows

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """[T] ids and positions (int64), the cache [L, 2, num_blocks, block_size, Hkv, D] and the step's metadata
        (slot_mapping [T] int64, context_lens [T] int32, block_tables [T, max_blocks] int32) -> [T, hidden]."""
        return self._runner.hidden_states(input_ids, positions, kv_cache, slot_mapping, context_lens, block_tables)

    def logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """`hidden_states`' step through the LM head -> [T, vocab] in the weights' dtype (needs `has_lm_head`)."""
        return self._runner.logits(input_ids, positions, kv_cache, slot_mapping, context_lens, block_tables)


def _projection_unsupported(linear: nn.Module, dtype: torch.dtype) -> str | None:
    """Why the runner cannot call `linear` in a `dtype` model (a phrase after its name), or None."""
    if isinstance(linear, ServingLinear) and linear.can_use_row_kernel():
        return None if linear.weight.dtype == dtype else f"is {linear.weight.dtype}, the embedding {dtype}"
    if isinstance(linear, QuantizedLinear) and linear.row_kernel() is not None:
        return None if linear.dtype == dtype else f"computes in {linear.dtype}, the embedding is {dtype}"
    return f"is a {type(linear).__name__} without a row kernel the runner calls"


def _most_rows(linear: nn.Module, rows: int) -> int:
    """`rows`, or fewer where `linear`'s kernel takes fewer a call (a quantized row kernel's rows; a dense row
    table's `gemm_bounds`)."""
    if isinstance(linear, QuantizedLinear):
        kernel = linear.row_kernel()
        return rows if kernel is None else min(rows, kernel.rows)
    if isinstance(linear, ServingLinear):
        return min(rows, _dense_bounds(linear, rows)[1])
    return rows


def _dense_bounds(linear: ServingLinear, rows: int) -> tuple[int, int]:
    """(row_max, tile_max) of a dense projection: its compiled row table's `tandem::table_gemm` bounds; without one,
    `row_gemm` for every row the runner takes."""
    bounds = None if linear.row_table is None else linear.row_table.gemm_bounds()
    return bounds if bounds is not None else (rows, rows)


def _spec(linear: nn.Module, rows: int) -> Spec:
    if isinstance(linear, QuantizedLinear):
        kernel = linear.row_kernel()
        assert kernel is not None  # unsupported() said so
        n, k, most = linear.out_features, linear.in_features, kernel.rows
        return kernel.name, kernel.weight, kernel.scales, kernel.group, n, k, most, most
    assert isinstance(linear, ServingLinear)
    row_max, tile_max = _dense_bounds(linear, rows)
    return "row_gemm", linear.weight.detach(), None, 0, linear.out_features, linear.in_features, row_max, tile_max
