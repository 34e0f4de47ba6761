"""The decode runner: a decode-only step of a few rows through a dense fp32 or bf16 `ServingDecoder`, in one C++ call.

Contract:
- `NativeDecode.unsupported(model)` says why the runner cannot serve `model` here (a phrase), or None: it needs
  Tandem's native library (`tandem_native`), fp32 or bf16 weights on the CPU, every projection of every layer a
  bias-free `ServingLinear` that `tandem::row_gemm` takes (contiguous, widths a multiple of 32: no quantized or
  adapter-wrapped projection), a head size that is a multiple of 16 and one dtype throughout.
- `NativeDecode(model, max_rows)` holds the model's own tensors (the embedding, each layer's norms and merged
  projections, the q/k norms, the RoPE tables, the final norm: no copy; the decoder must not change after it).
  `hidden_states(input_ids, positions, kv_cache, slot_mapping, context_lens, block_tables)`: T tokens (1 <= T <=
  max_rows), each a decode query at its position over its sequence's cached context (context_lens counts the
  token itself), with the KV cache and metadata of `inference_svc.attention.native_cpu.GraphDecode` -> the final-norm
  hidden states [T, hidden], as `ServingDecoder.hidden_states` with that backend; each layer's K/V stored at
  slot_mapping. Everything is checked (ids, positions, slots, lengths, block ids, the cache's shape and dtype)
  before anything is written. The GIL is released while it runs.
- Arithmetic (`tandem_native/csrc/decode_runner.cpp`): the projections are `tandem::row_gemm`'s and the attention
  `tandem::paged_attention`'s kernels, so a row's bits do not depend on the other rows of its step (a verify
  item's rows score drafts with a decode row's bits); the norms, RoPE, SiLU-mul and residuals are its own, with
  torch's rounding points for the norms and one rounding per fused op elsewhere, as inductor's kernels; the norms'
  sums run in another order than torch's. So it matches the compiled step to within its tolerance, not bit for bit.
- Why: a batch-1 decode step through the compiled graph spends about a sixth of its time between the kernels (the
  dispatcher, a fresh output per operator, a handle per graph input, dynamo's wrappers: docs/benchmarks.md §39);
  here the kernels run back to back. Which steps take it is the engine's load-time choice
  (`inference_svc.executor.prepare.choose_decode_runner`).
"""

from __future__ import annotations

from typing import Any

import torch

import tandem_native
from shared_model.serving_model import ServingDecoder, ServingLinear

DTYPES = (torch.float32, torch.bfloat16)


class NativeDecode:
    """A dense decoder's short decode-only steps in one C++ call (see the module docstring)."""

    def __init__(self, model: ServingDecoder, max_rows: int) -> None:
        why = self.unsupported(model)
        if why is not None:
            raise ValueError(f"the decode runner cannot serve this model: {why}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        first = model.layers[0]
        layers = [
            [ly.input_norm, ly.qkv.weight, ly.o_proj.weight, ly.post_attention_norm, ly.gate_up.weight,
             ly.down_proj.weight]
            for ly in model.layers
        ]  # fmt: skip
        module: Any = tandem_native.library()
        self._runner = module.DecodeRunner(
            [[w.detach() for w in layer] for layer in layers],
            [None if ly.qk_norm is None else ly.qk_norm.contiguous() for ly in model.layers],
            model.embed_tokens.weight.detach(), model.final_norm.detach(), model.rope_cos, model.rope_sin,
            first.num_heads, first.num_kv_heads, first.head_dim, float(model.eps), float(first.scale), max_rows,
        )  # fmt: skip
        self.max_rows = max_rows

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
            for name in ("qkv", "o_proj", "gate_up", "down_proj"):
                linear = getattr(layer, name)
                if not isinstance(linear, ServingLinear) or not linear.can_use_row_kernel():
                    return f"layer {i}'s {name} is a {type(linear).__name__} that tandem::row_gemm does not run"
                if linear.weight.dtype != dtype:
                    return f"layer {i}'s {name} is {linear.weight.dtype}, the embedding {dtype}"
        return None

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
