"""Merged projections: a load-time transform of the one decoder, for serving.

Contract:
- `fuse_projections(model)` merges, in every layer, the q/k/v weights (and biases) into one `[q + 2 kv, hidden]`
  matrix and gate/up into one `[2 * intermediate, hidden]` matrix, each held by an `nn.Linear` outside the module
  tree (`MergedQKV.proj`, `MergedGateUp.proj`), and re-points the model's own parameters at row slices of them
  (views: no second copy of the weights, the Hugging Face names and the state dict unchanged, so export and parity
  read the same tensors). The decoder's forward (`shared_model.model`) then runs one matmul where it ran three
  (two), and normalizes and rotates the q and k heads in one pass: the same dot products and elementwise ops, so
  its output is bit-equal to the unmerged model's.
- Every projection it leaves (the merged ones, o_proj, down_proj, the LM head) is a `ServingLinear`: an
  `nn.Linear` sharing the same parameters (the state dict is unchanged) whose bias-free bf16 product of a single
  row on CPU, a batch-1 decode step, runs `torch.mv` instead of `F.linear`. There they return the same bits (checked
  by tests/shared_model/test_fuse.py at decode shapes); the GEMV read the weight 1.6-2.4x faster than the bf16
  GEMM path when chosen (benchmarks/gemv_probe.py, docs/benchmarks.md §7), but 0.5x as fast in one probe on
  2026-12-02 (6.6 against 12.3 GB/s): not re-measured since. Everything else goes to `F.linear` unchanged.
- `set_row_kernels(model, True)` (the compiled step's choice, `shared_model.compiled`) makes up to
  `ROW_KERNEL_MAX_ROWS` bias-free fp32 or bf16 rows on CPU (decode steps, verify steps, small decode batches) run
  Tandem's `tandem::row_gemm` instead where it is built (`tandem_native`): it reads the weight once
  for all the rows, faster than torch's GEMV and GEMM at these row counts, and computes each row's outputs with the
  same arithmetic whatever the row count, so a row's result is bitwise the same alone as among others (a verify
  step's rows score their tokens exactly as plain decode steps would). Its fp32 sums run in another order than
  `F.linear`'s, so it is not bit-equal to it. It applies to every call of those modules while it is set (the
  compiled decoder's eager fallbacks too); a model never compiled, or whose compiled forward was dropped, keeps
  `torch.mv` / `F.linear` and their bit-equality.
- Inference only: the merged parameters stop requiring grad, and the merged projections live outside the module
  tree, where ZeRO never sees them. Training keeps the plain parameters. Apply it after the model has its final
  device and dtype (`Module.to` would copy the parameters out of the merged matrices). Applying it twice does
  nothing more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tandem_native
from shared_model.model import Attention, CausalLM, MergedGateUp, MergedQKV

ROW_KERNEL_MAX_ROWS = 17
"""Rows of one call (all the rows of a step, every sequence's) up to which the row kernel runs: one sequence's verify
of the most drafts the engine allows (16) plus its last token. On 3072 x 768 matrices, 2 threads, it ran 1.0-1.6x
as fast as `F.linear` in fp32 and 1.3-1.7x in bf16 up to 8 rows, and even with it at 16-17 (benchmarks/gemv_probe.py
--row-counts, docs/benchmarks.md §7). A step of more rows (several verify items, or decodes beside a prefill
chunk) runs `F.linear` for all of them, which rounds otherwise."""


def fuse_projections(model: CausalLM) -> CausalLM:
    """Merge q/k/v and gate/up in place (see the module docstring); returns `model`."""
    c = model.config
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.merged is None:
                proj = _merge([attn.q_proj, attn.k_proj, attn.v_proj])
                attn.merged = MergedQKV(proj, _qk_norm_weight(attn), c.q_size + c.kv_size)
            if mlp.merged_gate_up is None:
                mlp.merged_gate_up = MergedGateUp(_merge([mlp.gate_proj, mlp.up_proj]))
            attn.o_proj, mlp.down_proj = ServingLinear.sharing(attn.o_proj), ServingLinear.sharing(mlp.down_proj)
        model.lm_head = ServingLinear.sharing(model.lm_head)  # the same Parameter: a tied head stays tied
    return model


def set_row_kernels(model: CausalLM, on: bool) -> int:
    """Let (or stop) the model's `ServingLinear`s run up to `ROW_KERNEL_MAX_ROWS` rows through `tandem::row_gemm`
    where it is built and takes their dtype (see the module docstring); returns how many projections use it now."""
    linears = [model.lm_head]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears += [attn.o_proj, mlp.down_proj]
        linears += [m.proj for m in (attn.merged, mlp.merged_gate_up) if m is not None]
    count = 0
    for linear in linears:
        if isinstance(linear, ServingLinear):
            linear.row_kernel = on and linear.can_use_row_kernel()
            count += linear.row_kernel
    return count


class ServingLinear(nn.Linear):
    """`nn.Linear` with a GEMV for one bias-free bf16 row on CPU, and optionally the row kernel (see the module doc)."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> ServingLinear:
        """A ServingLinear holding `linear`'s own parameters (no copy); `linear` itself if it is one already."""
        if isinstance(linear, ServingLinear):
            return linear
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        out.weight, out.bias = linear.weight, linear.bias
        return out

    row_kernel = False
    """Whether up to `ROW_KERNEL_MAX_ROWS` rows run `tandem::row_gemm` (`set_row_kernels`)."""

    def can_use_row_kernel(self) -> bool:
        w = self.weight
        return (
            self.bias is None and w.dtype in (torch.float32, torch.bfloat16) and w.device.type == "cpu"
            and w.is_contiguous() and w.shape[1] % 32 == 0 and tandem_native.available()
        )  # fmt: skip

    def method(self) -> tuple[str, str]:
        """(The method this projection runs, its row-count table in words): what `forward` does, for the load plan."""
        if self.row_kernel:
            n = ROW_KERNEL_MAX_ROWS
            return "row_gemm", f"1-{n} rows: tandem::row_gemm (the same bits at any row count); more: F.linear"
        w = self.weight
        if self.bias is None and w.dtype == torch.bfloat16 and w.device.type == "cpu":
            return "mv+linear", "1 bf16 row: torch.mv (bit-equal to F.linear); more: F.linear"
        return "linear", "F.linear at every row count"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.row_kernel and x.dtype == self.weight.dtype and rows <= ROW_KERNEL_MAX_ROWS:
            y = torch.ops.tandem.row_gemm(x.reshape(rows, x.shape[-1]), self.weight)  # [rows, out]
            return y.view(*x.shape[:-1], self.out_features)  # [..., out]
        if self.bias is None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and rows == 1:
            return torch.mv(self.weight, x.reshape(-1)).view(*x.shape[:-1], self.out_features)  # [..., out]
        return F.linear(x, self.weight, self.bias)


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


def _qk_norm_weight(attn: Attention) -> torch.Tensor | None:
    """q_norm's weight for each q head, then k_norm's for each kv head: `[Hq + Hkv, D]`, one norm for both."""
    if attn.q_norm is None or attn.k_norm is None:
        return None
    q = attn.q_norm.weight.detach().expand(attn.num_heads, -1)
    k = attn.k_norm.weight.detach().expand(attn.num_kv_heads, -1)
    return torch.cat([q, k])
