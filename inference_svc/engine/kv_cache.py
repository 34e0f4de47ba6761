"""The paged K/V cache: its storage, its scales, and the choice of the stored dtype (`--kv-cache-dtype`).

Contract:
- `KVCache` is the one owner of the cache state: `data: [L, 2, num_blocks, block_size, Hkv, D]` (K at index 0,
  V at 1) in the stored dtype, and for fp8/int8 `scales: [L, 2, num_blocks, Hkv]` fp32 (None otherwise).
  `layer(i)` gives the block views `(k_cache, v_cache)`, `layer_scales(i)` their scales `(k_scales, v_scales)`
  (None, None when unscaled); both are made once. `zero_blocks` zeroes data and scales of some blocks; `nbytes`
  counts both, and equals `num_blocks × shared_model.ledger.kv_bytes_per_block` (the bytes the engine budgets).
- `resolve_kv_dtype(name, compute_dtype)` maps `EngineConfig.kv_cache_dtype` to a torch dtype: 'auto' is the
  model's compute dtype (what the engine did before the option existed); `ledger_dtype_name` gives the name the
  ledger's formulas take ('fp32', 'bf16', 'fp16', 'fp8', 'int8').
- Readers compute in fp32 whenever the stored dtype is not the compute dtype; the format of the scaled dtypes
  (and their error bounds) is `inference_svc.attention.kv_quant`.

Why per-(block, kv head) scales, set at write time (power-of-two running max, see `kv_quant`):
- no calibration and no clipping: each block's scale follows the largest |K| or |V| written to it, per head, and
  a block whose scale must grow rescales its earlier tokens by an exact power of two;
- small: one fp32 per (layer, K|V, block, head) is 4 / block_size bytes per token and head (0.25 B at the default
  16 tokens) against D bytes of data, so the pool holds 2D / (D + 0.25) × as many tokens as bf16 (1.97× at
  D = 16, 1.99× at D = 128). Per-(token, head) scales would cost 2-4 B per token and head: with fp16 scales
  2D / (D + 2) is 1.78× at D = 16 and still short of 1.9× below D = 38.
- what it gives up: a block shares one scale per head across its tokens, so a token far smaller than its block's
  largest gets fewer significant int8 levels (fp8 keeps its 3 mantissa bits at any magnitude above 2^-6 · s).
"""

from __future__ import annotations

import torch

from inference_svc.attention.kv_quant import as_bytes, is_scaled
from inference_svc.engine.config import KV_CACHE_DTYPES

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}
_LEDGER_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def resolve_kv_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The stored dtype of `--kv-cache-dtype name` for a model computing in `compute_dtype`."""
    if name == "auto":
        return compute_dtype
    if name not in _TORCH_DTYPES:
        raise ValueError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return _TORCH_DTYPES[name]


def ledger_dtype_name(dtype: torch.dtype) -> str:
    """The ledger's name of a stored K/V dtype ('fp32', 'bf16', 'fp16', 'fp8', 'int8')."""
    return _LEDGER_NAMES[dtype]


class KVCache:
    """All layers' paged K/V (and their scales when the stored dtype is fp8 or int8); see the module docstring."""

    def __init__(self, data: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        if is_scaled(data.dtype) != (scales is not None):
            raise ValueError(f"KVCache: a {data.dtype} cache {'needs' if scales is None else 'has no'} scales")
        self.data = data  # [L, 2, num_blocks, block_size, Hkv, D]
        self.scales = scales  # [L, 2, num_blocks, Hkv] fp32, or None
        self._layers = [(data[i, 0], data[i, 1]) for i in range(data.shape[0])]
        self._scales = [(None, None) if scales is None else (scales[i, 0], scales[i, 1]) for i in range(data.shape[0])]

    @classmethod
    def allocate(
        cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device
    ) -> KVCache:
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        scales = None
        if is_scaled(dtype):
            scales = torch.zeros((num_layers, 2, num_blocks, num_kv_heads), dtype=torch.float32, device=device)
        return cls(torch.zeros(shape, dtype=dtype, device=device), scales)

    @property
    def dtype(self) -> torch.dtype:
        """The stored dtype."""
        return self.data.dtype

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def layer_scales(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer i's `(k_scales, v_scales)`, each `[num_blocks, Hkv]` fp32, or (None, None)."""
        return self._scales[i]

    @torch.inference_mode()
    def zero_blocks(self, index: torch.Tensor) -> None:
        """Zero the K, V (and scales) of the blocks in `index` (int64 `[n]`) in every layer."""
        as_bytes(self.data).index_fill_(2, index, 0)  # data: [L, 2, num_blocks, block_size, Hkv, D]; 0 is 0.0
        if self.scales is not None:
            self.scales.index_fill_(2, index, 0.0)  # scales: [L, 2, num_blocks, Hkv]

    @property
    def nbytes(self) -> int:
        scale_bytes = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + scale_bytes
