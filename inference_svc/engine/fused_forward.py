"""The engine's forward pass: the shared decoder's arithmetic over merged projections, with fewer, larger ops.

Contract:
- `FusedForward(model, max_positions)` merges each layer's q/k/v weights into one `[q + 2 kv, hidden]` matrix and
  gate/up into one `[2 * intermediate, hidden]` matrix, and re-points the model's own parameters at row slices of
  them (views: no second copy of the weights; the model computes exactly what it did before).
- `hidden_states(input_ids [T], positions [T], backend)` returns the final-norm hidden states `[T, hidden]`: the
  same values, operation for operation, as `CausalLM.hidden_states` (each output row of a merged matmul is the same
  dot product; RMSNorm via `F.rms_norm` in fp32; RoPE cos/sin gathered from a table computed with the decoder's own
  `RotaryEmbedding`). Bit-equal to the decoder
  on the configurations checked (fp32, bf16; with and without QK-norm, q/k/v bias, Llama 3 RoPE scaling).
- Holds no per-step state; reads the model's weights, never writes them after construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared_model.attention import AttentionBackend
from shared_model.model import CausalLM


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q + 2 kv, hidden]
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [Hq + Hkv, head_dim]: q_norm's weight per q head, then k_norm's per kv head
    o_proj: torch.Tensor  # [hidden, q]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


def _merge(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several Linears sharing an input; each Linear's parameters become views of it."""
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    bias = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None
    if any(has_bias) and bias is None:
        raise ValueError("cannot merge projections where only some have a bias")
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return weight, bias


def _qk_norm_weight(q_norm: nn.Module | None, k_norm: nn.Module | None, hq: int, hkv: int) -> torch.Tensor | None:
    if q_norm is None or k_norm is None:
        return None
    return torch.cat([q_norm.weight.detach().expand(hq, -1), k_norm.weight.detach().expand(hkv, -1)])


class FusedForward:
    """Forward over merged projections (see the module docstring). Build once per model."""

    def __init__(self, model: CausalLM, max_positions: int) -> None:
        c = model.config
        self.config = c
        self.eps = c.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.splits = [c.q_size, c.kv_size, c.kv_size]
        self.intermediate = c.intermediate_size
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        self.scale = c.head_dim**-0.5
        layers = []
        with torch.no_grad():
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                qkv, qkv_bias = _merge([a.q_proj, a.k_proj, a.v_proj])
                gate_up, _ = _merge([m.gate_proj, m.up_proj])
                layers.append(
                    _Layer(
                        input_norm=layer.input_layernorm.weight,
                        qkv=qkv,
                        qkv_bias=qkv_bias,
                        qk_norm=_qk_norm_weight(a.q_norm, a.k_norm, c.num_heads, c.num_kv_heads),
                        o_proj=a.o_proj.weight,
                        o_bias=a.o_proj.bias,
                        post_norm=layer.post_attention_layernorm.weight,
                        gate_up=gate_up,
                        down=m.down_proj.weight,
                    )
                )
            self.layers = layers
            positions = torch.arange(max_positions, device=self.embed.device)[None]  # [1, P]
            cos, sin = model.model.rotary_emb(positions, self.embed.dtype)  # [1, P, 1, D]
            self.cos, self.sin = cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous()  # [P, D]
        dev = self.embed.device
        self._eps = torch.tensor(self.eps, dtype=torch.float32, device=dev)
        self._widths = {n: torch.tensor(float(n), device=dev) for n in (c.hidden_size, c.head_dim)}

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm in fp32, scaled in the input dtype: `shared_model.model.RMSNorm`'s ops, in place where possible."""
        h = x.float()
        width = self._widths[h.shape[-1]]  # the width and eps as fp32 0-d tensors: no scalar wrapping per call
        ms = torch.sum(h * h, dim=-1, keepdim=True).div_(width)  # = h.pow(2).mean(-1): a sum, then one division
        h = h * ms.add_(self._eps).rsqrt_()
        return weight * h.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated by cos, sin [T, 1, D] (rotate-half, as `shared_model.model.apply_rope`)."""
        half = self.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        out = x * cos
        return out.add_(rotated.mul_(sin))

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 → final-norm hidden states [T, hidden]."""
        t = input_ids.shape[0]
        hq, hkv, dim = self.num_heads, self.num_kv_heads, self.head_dim
        cos = self.cos.index_select(0, positions)[:, None]  # [T, 1, D]
        sin = self.sin.index_select(0, positions)[:, None]
        x = F.embedding(input_ids, self.embed)  # [T, hidden] (the residual stream)
        qk_size = (hq + hkv) * dim
        for i, lw in enumerate(self.layers):
            qkv = F.linear(self._norm(x, lw.input_norm), lw.qkv, lw.qkv_bias)  # [T, q + 2 kv]
            qk = qkv[:, :qk_size].view(t, hq + hkv, dim)  # q and k heads side by side: one norm, one rotation
            if lw.qk_norm is not None:
                qk = self._norm(qk, lw.qk_norm)
            qk = self._rope(qk, cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, qk_size:].view(t, hkv, dim)
            out = backend(i, q[None], k[None], v[None], self.scale)[0]  # [T, Hq, D]
            x = x + F.linear(out.reshape(t, hq * dim), lw.o_proj, lw.o_bias)
            gate, up = F.linear(self._norm(x, lw.post_norm), lw.gate_up).split(self.intermediate, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lw.down)
        return self._norm(x, self.final_norm)
