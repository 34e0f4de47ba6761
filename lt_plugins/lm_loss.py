"""The LM head and next-token loss of a training step in chunks of tokens: the [tokens, vocab] logits never exist
whole (`model.loss_chunk_tokens`).

Contract:
- `chunked_lm_loss(hidden [N, H], weight [V, H], targets [N], chunk_tokens, ignore_index=-100)` returns the mean,
  over the targets that are not `ignore_index`, of −log softmax(hidden @ weightᵀ)[target] as an fp32 scalar: the
  value of `F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=ignore_index)`, with the same
  gradients for `hidden` and `weight`, up to the order of floating-point sums (NaN when every target is ignored,
  as there). Under bf16 autocast, up to rounding too: the weight gradient is summed over the chunks in fp32, where
  the unchunked backward rounds its one product to bf16.
- The head's matmuls run in the dtype `F.linear` would use at the call: autocast's (bf16 under `trainer.autocast`)
  inside an autocast region, else `hidden`'s. The log-sum-exp and the softmax are fp32, as the precision policy
  keeps the unchunked loss.
- When a gradient is wanted (grad mode on, `hidden` or `weight` requiring one), each chunk's logits gradient
  (softmax − one-hot) becomes at once the chunk's rows of d hidden and its share of d weight (of whichever
  requires one: a frozen head, as under LoRA, gets none), while the chunk is in cache; backward only scales them
  by the incoming gradient over the count, in place (`once_differentiable`; a second backward through the same
  loss, `retain_graph=True`, is refused). Held for backward: d hidden [N, H] in
  `hidden`'s dtype and d weight [V, H] in fp32, in place of the unchunked loss's [N, V] fp32 log-softmax
  (`memory_model.head_saved_bytes_per_token`, `loss_weight_grad_bytes`). Without a gradient (validation,
  no_grad) only the loss is computed.
- Bad arguments raise ValueError naming the argument: a chunk below 1, shapes that do not line up.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
"""F.cross_entropy's default: targets equal to it add neither loss nor gradient."""


def chunked_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean next-token NLL of `hidden` [N, H] under the head `weight` [V, H] for `targets` [N] (see the module)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [N, H] and weight [V, H] must share H, got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    grad_on = torch.is_grad_enabled()
    grads = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    return _ChunkedLMLoss.apply(hidden, weight, targets, chunk_tokens, ignore_index, dtype, grads)


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H]
        targets: torch.Tensor,  # [N]
        chunk_tokens: int,
        ignore_index: int,
        dtype: torch.dtype,
        grads: tuple[bool, bool],
    ) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):  # the dtype was chosen by the caller
            w = weight.to(dtype)  # [V, H]
            h = hidden.to(dtype)  # [N, H]
            n = h.shape[0]
            keep = targets != ignore_index  # [N]
            count = keep.sum()
            safe = torch.where(keep, targets, 0)  # [N]: an ignored row gathers column 0, then weighs 0
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_hidden, grad_weight = grads
            d_hidden = torch.empty_like(hidden) if grad_hidden else None  # [N, H]
            d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if grad_weight else None
            for start in range(0, n, chunk_tokens):
                rows = slice(start, min(start + chunk_tokens, n))
                logits = (h[rows] @ w.t()).float()  # [c, V]
                lse = torch.logsumexp(logits, dim=-1)  # [c]
                picked = logits.gather(1, safe[rows, None]).squeeze(1)  # [c]
                total += ((lse - picked) * keep[rows]).sum()
                if not (grad_hidden or grad_weight):
                    continue
                # d loss_sum / d logits = softmax − one-hot, zero on ignored rows: [c, V], in place over the logits
                grad = logits.sub_(lse[:, None]).exp_()
                grad[torch.arange(grad.shape[0], device=h.device), safe[rows]] -= 1.0
                grad.mul_(keep[rows, None])
                grad_c = grad.to(dtype)  # [c, V]
                if d_hidden is not None:
                    d_hidden[rows] = grad_c @ w  # [c, H]
                if d_weight is not None:
                    d_weight += (grad_c.t() @ h[rows]).float()  # [V, H]
        ctx.save_for_backward(d_hidden, d_weight, count)
        ctx.weight_dtype = weight.dtype
        ctx.used = False
        return total / count

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.used:
            raise RuntimeError(
                "chunked_lm_loss: its gradients were scaled in place by a first backward; a second "
                "backward through the same loss (retain_graph=True) is not supported"
            )
        ctx.used = True
        d_hidden, d_weight, count = ctx.saved_tensors
        scale = grad_out.float() / count
        grad_hidden = d_hidden.mul_(scale) if d_hidden is not None else None  # scale as an fp32 scalar
        grad_weight = d_weight.mul_(scale).to(ctx.weight_dtype) if d_weight is not None else None  # no copy in fp32
        return grad_hidden, grad_weight, None, None, None, None, None
