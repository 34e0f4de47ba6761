"""Paged-KV attention kernels for the inference engine: Triton implementations and a plain-torch reference.

Contract (shared by `inference_svc.attention.triton` and `inference_svc.attention.reference`, same signatures):
- KV cache, one pair per layer: k_cache, v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous,
  in the stored dtype (the model's, another float, or fp8/int8 with `k_scales, v_scales` `[num_blocks, Hkv]` fp32
  passed by keyword to every op: `kv_quant`). Token slot = block_id * block_size + offset_in_block.
- Block tables: int32 `[num_seqs, max_blocks_per_seq]`, padded past each sequence's last block (never read).
- `store_kv(k, v, k_cache, v_cache, slot_mapping)`: k, v `[T, Hkv, D]`, slot_mapping `[T]` int64 (< 0: skip).
- `prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale) -> [T, Hq, D]`:
  packed causal chunks; query j of sequence s is at position context_lens[s] - q_len_s + j.
- `decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale, num_splits=None) -> [S, Hq, D]`.

The Triton functions are imported eagerly (each module shares its function's name, so the package attribute must
be bound to the function); where Triton is not installed they are absent and `triton_backend.triton_available()`
says why, while `inference_svc.attention.reference` still works. On a machine without CUDA the Triton kernels run
only in Triton's interpreter (``TRITON_INTERPRET=1``, read at each kernel's first launch).
"""

from __future__ import annotations

__all__ = ["decode_attention", "prefill_attention", "store_kv"]

IMPORT_ERROR: ImportError | None = None
"""Why the Triton functions are missing (Triton not installed), or None."""

try:
    from inference_svc.attention.triton.kv_write import store_kv
    from inference_svc.attention.triton.paged_decode import decode_attention
    from inference_svc.attention.triton.prefill_attention import prefill_attention
except ImportError as exc:  # pragma: no cover - only where triton is not installed
    IMPORT_ERROR = exc
