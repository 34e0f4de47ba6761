"""The decoder: one readable file for the Qwen3 / Qwen2 / Llama family.

Contract:
- `CausalLM(config)` holds parameters named exactly as Hugging Face does (`model.layers.0.self_attn.q_proj.weight`,
  `lm_head.weight`…), so a state dict maps 1:1 onto a `config.json` + safetensors folder.
- `forward(input_ids, positions=None, attention=None)` returns logits. Positions are an explicit input (default
  0..T-1 per row). Attention goes through an `AttentionBackend` passed as an argument (default: causal SDPA over
  the given tokens). `hidden_states` and `logits` split the two halves for callers that need logits for only some
  positions (the inference engine).
- This file holds no parallelism, checkpointing or serving code: those are applied from outside. The core
  attention call is its own module (`CoreAttention`) so that checkpointing policies can target it by class.
- One forward, the textbook one, whatever the grad mode or tracing: no fork for serving. Serving builds its own
  decoder from these parameters by their names (`shared_model.serving_model`: merged projections, fewer
  temporaries), and the exactness tests hold the two together bit for bit. A projection is any module mapping
  [..., in] to [..., out] (an `nn.Linear`, or a reference's stand-in); this file does not know which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared_model.attention import CAUSAL, AttentionBackend
from shared_model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last axis in fp32, times `weight` in x's dtype (weight broadcasts: [D] or [H, D])."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, scaled by a learned weight in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32, with Llama 3 scaling applied when configured."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # cpu even under meta init
    inv = 1.0 / (config.rope_theta**exponent)
    s = config.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * torch.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)  # low frequencies: fully scaled
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] int, inv_freq [D/2] fp32 on their device -> cos, sin [B, T, 1, D] in `dtype` (broadcast over
    heads)."""
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]


def batched(input_ids: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions as [B, T] each: [T] is read as B=1, positions default to 0..T-1 per row."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if positions is None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    elif positions.dim() == 1:
        positions = positions[None].expand_as(input_ids)
    if torch.compiler.is_compiling() and positions.dim() == input_ids.dim() == 2:  # unbacked T: the same size
        torch._check(positions.shape[1] == input_ids.shape[1])
    if positions.shape != input_ids.shape:
        raise ValueError(f"positions shape {tuple(positions.shape)} != input_ids {tuple(input_ids.shape)}")
    return input_ids, positions


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit positions. inv_freq stays fp32 and off the state dict, whatever .to() does."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self._inv_freq = rope_inv_freq(config)  # [D/2], a plain attribute: never cast by module.to()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions, self._inv_freq.to(positions.device), dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of x [B, T, H, D] by the position angles (the rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class CoreAttention(nn.Module):
    """scores → softmax → weighted sum, delegated to the backend. No parameters: the part worth recomputing."""

    def __init__(self, layer_idx: int, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        return backend(self.layer_idx, q, k, v, self.scale)


class Attention(nn.Module):
    """Grouped-query self-attention with optional q/k/v bias and per-head QK-norm."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.q_size, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.kv_size, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.q_size, c.hidden_size, bias=c.attention_out_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.core = CoreAttention(layer_idx, c.head_dim**-0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        b, t, _ = x.shape
        hq, hkv, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(b, t, hq, dim)  # [B, T, Hq, D]
        k = self.k_proj(x).view(b, t, hkv, dim)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(b, t, hkv, dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v, backend)  # [B, T, Hq, D]
        return self.o_proj(out.reshape(b, t, hq * dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Embedding, the repeated layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """Decoder-only language model: token ids [B, T] (+ positions) → logits [B, T, vocab]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, T, hidden]. input_ids and positions: [B, T] (or [T], read as B=1)."""
        input_ids, positions = batched(input_ids, positions)
        backend = CAUSAL if attention is None else attention
        x = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, backend)
        return self.model.norm(x)

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

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Normal(0, std) for projections and embeddings, zero biases, unit norms (GPT-2/Llama recipe). A generator
        on another device than the weights (a CPU one for CUDA weights) draws where it lives, so a seed gives the
        same values on every device."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                _normal_(module.weight, std, generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                _normal_(module.weight, std, generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


def _normal_(weight: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    """`weight.normal_(0, std)` drawn from `generator` on the generator's own device."""
    if generator is None or generator.device == weight.device:
        weight.normal_(0.0, std, generator=generator)
        return
    drawn = torch.empty(weight.shape, dtype=weight.dtype, device=generator.device)
    weight.copy_(drawn.normal_(0.0, std, generator=generator))


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, seed: int | None = 0, device: str = "cpu"
) -> CausalLM:
    """A randomly initialised model (deterministic for a given seed)."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    model = CausalLM(config)
    model.init_weights(generator=generator)
    return model.to(device=device, dtype=dtype)
