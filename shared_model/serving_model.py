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
  for bit), RoPE's products and sum written in place. So with plain projections its output is bit-equal to the
  `CausalLM`'s on the CPU (tests/shared_model/test_fuse.py), and the exactness tests hold the two together.
- Its projections (`qkv`, `o_proj`, `gate_up`, `down_proj` of each layer, `lm_head`) are `ServingLinear`s until
  `shared_model.quantize` swaps in `QuantizedLinear`s. A `ServingLinear` is an `nn.Linear` sharing the same
  parameters whose bias-free bf16 product of a single CPU row (a batch-1 decode step) runs `torch.mv` instead of
  `F.linear` (the same bits, tested at decode shapes). `set_row_kernels(decoder, True)` (the compiled step's
  choice, `shared_model.compiled`) makes up to `ROW_KERNEL_MAX_ROWS` bias-free fp32 or bf16 rows run Tandem's
  `tandem::row_gemm` where it is built (`tandem_native`): one read of the weight for all the rows, each row's
  arithmetic the same at any row count (a verify row scores its token exactly as a decode step would), another
  summation order than `F.linear`'s. `method()` names what a projection runs, for the serving executor's record.
- Inference only: the merged parameters do not require grad and ZeRO never sees this module; training keeps the
  plain `CausalLM`. Build it after the model has its final device and dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tandem_native
from shared_model.attention import CAUSAL, AttentionBackend
from shared_model.config import ModelConfig
from shared_model.model import CausalLM, DecoderLayer, batched, rope_inv_freq, rope_tables

ROW_KERNEL_MAX_ROWS = 17
"""Rows of one call (all the rows of a step, every sequence's) up to which the row kernel runs: one sequence's verify
of the most drafts the engine allows (16) plus its last token (docs/benchmarks.md: the row-count probe). A step of
more rows (several verify items, or decodes beside a prefill chunk) runs `F.linear` for all of them."""


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


def rms_norm_into(x: torch.Tensor, weight: torch.Tensor, width: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """`shared_model.model.rms_norm` with fewer temporaries: x / rms(x) over the last axis in fp32, times `weight`
    in x's dtype; `width` and `eps` are fp32 0-d tensors (no scalar wrapping per call, and graph constants when
    traced). A sum divided by the width is torch's CPU mean bit for bit."""
    h = x.float()
    ms = torch.sum(h * h, dim=-1, keepdim=True).div_(width)
    return weight * (h * ms.add_(eps).rsqrt_()).to(x.dtype)


def rope_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`shared_model.model.apply_rope`'s products and sum, written in place: x [B, T, H, D] (a fresh tensor)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(rotated.mul_(sin))


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
        self.register_buffer("inv_freq", rope_inv_freq(c).to(device), persistent=False)  # [D/2] fp32
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
        cos, sin = rope_tables(positions, self.inv_freq, x.dtype)  # [B, T, 1, D] each
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


def set_row_kernels(model: ServingDecoder, on: bool) -> int:
    """Let (or stop) the decoder's `ServingLinear`s run up to `ROW_KERNEL_MAX_ROWS` rows through `tandem::row_gemm`
    where it is built and takes their dtype (see the module docstring); returns how many projections use it now."""
    count = 0
    for linear in model.projections():
        if isinstance(linear, ServingLinear):
            linear.row_kernel = on and linear.can_use_row_kernel()
            count += linear.row_kernel
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
