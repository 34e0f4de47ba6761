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
  by tests/shared_model/test_fuse.py at decode shapes), and the GEMV reads the weight 1.6-2.4x faster than the
  bf16 GEMM path (benchmarks/gemv_probe.py, docs/benchmarks.md §7). Everything else goes to `F.linear` unchanged.
- `set_row_kernels(model, True)` (the compiled step's choice, `shared_model.compiled`) makes that single bf16 row
  run Tandem's `tandem_cpu::bf16_gemv` instead where it is built (`shared_model.cpu_kernels`): fp32 sums in
  another order, so not bit-equal to `F.linear`. It applies to every call of those modules while it is set (the
  compiled decoder's eager fallbacks too); a model never compiled, or whose compiled forward was dropped, keeps
  `torch.mv` and its bit-equality.
- Inference only: the merged parameters stop requiring grad, and the merged projections live outside the module
  tree, where ZeRO never sees them. Training keeps the plain parameters. Apply it after the model has its final
  device and dtype (`Module.to` would copy the parameters out of the merged matrices). Applying it twice does
  nothing more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared_model import cpu_kernels
from shared_model.model import Attention, CausalLM, MergedGateUp, MergedQKV


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
    """Let (or stop) the model's bf16 `ServingLinear`s run one row through `tandem_cpu::bf16_gemv` where it is built
    (see the module docstring); returns how many projections use it now."""
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
    """`nn.Linear` with a GEMV for one bias-free bf16 row on CPU (see the module docstring)."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> ServingLinear:
        """A ServingLinear holding `linear`'s own parameters (no copy); `linear` itself if it is one already."""
        if isinstance(linear, ServingLinear):
            return linear
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        out.weight, out.bias = linear.weight, linear.bias
        return out

    row_kernel = False
    """Whether one bf16 row runs `tandem_cpu::bf16_gemv` instead of `torch.mv` (`set_row_kernels`)."""

    def can_use_row_kernel(self) -> bool:
        w = self.weight
        return (
            self.bias is None and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous()
            and w.shape[1] % 32 == 0 and cpu_kernels.available()
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() == x.shape[-1]:
            if self.row_kernel:
                y = torch.ops.tandem_cpu.bf16_gemv(x.reshape(-1), self.weight)
            else:
                y = torch.mv(self.weight, x.reshape(-1))
            return y.view(*x.shape[:-1], self.out_features)  # [..., out]
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
