"""Weight-only quantization at load time, for serving: int8 per output channel, int4 in groups along the input.

Contract:
- `quantize_weights(model, kind, group_size)` (kind "int8" or "int4") builds the serving decoder first
  (`shared_model.serving_model`: merged projections), then swaps in a `QuantizedLinear` for every projection of
  every layer (merged q/k/v, o_proj, merged gate/up, down_proj) and returns it. Policy for the rest:
  - the LM head is int8 per channel under both kinds: it is the one matrix every sampled token reads in full, and
    the error of its logits is what sampling sees, so it gets the finer format (llama.cpp keeps it finer too);
  - the token embedding stays in the model's dtype: a step gathers B of its rows, so quantizing it would save
    memory and no time. With tied embeddings the LM head gets its own int8 copy beside it;
  - norms and biases stay in the model's dtype.
  The serving decoder then holds no full-precision copy of a quantized weight (the training model's q/k/v and
  gate/up views of the merged matrices go with that model). A quantized model serves; it does not train or
  export (its state dict is not a bundle's).
- Number formats, the same in the kernels, `dequantize` and `fake_quantized` (the reference the tests compare
  against):
  - int8: per output row, s = max|w| / 127, q = round(w / s) in [-127, 127], w ≈ q·s.
  - int4: per row and group of `group_size` inputs, s = (max - min) / 15, q = round((w - min) / s) in [0, 15],
    w ≈ (q - 8)·s + z with z = min + 8·s (torch's tinygemm convention). 4 bits plus a scale and a zero in the
    model's dtype per group: 4.5 bits per weight at group 64 in bf16, as llama.cpp's Q4_0.
  Scales and zeros are stored in the activation dtype (the kernels take them so); `dequantize` applies the same
  rounding, so it is exactly the matrix the kernel multiplies by, up to the kernel's accumulation order.
- `QuantizedLinear(x)` = x @ Wᵀ (+ bias) for x [..., in], computed in bf16 (or fp16 when the model is fp16) and
  returned in x's dtype: torch's CPU kernels are vectorized for 16-bit activations only (fp32 activations take a
  scalar path, several times slower), and the weight's rounding dominates the activation's anyway.
  - Up to `int8_gemv_rows` rows of int8 on a CPU with AVX-512 VNNI (decode steps; `int8_row_kernel`):
    `shared_model.int8_gemv`, which also rounds each activation row to int8, in groups of up to 256 inputs with
    one scale each, and multiplies bytes by bytes, as llama.cpp's Q8_0 does. So on such CPUs those outputs of an
    int8 layer carry the activation's rounding too (at most half a step of max|x_g| / 127 per input); its
    reference (`fake_quantized`) applies the same rounding. One row where AMX tiles take the rest (below), else up
    to `int8_gemv.MAX_ROWS`.
  - From 2 up to `serving_model.TILE_MAX_ROWS` rows of int8 in bf16 on a CPU with AMX tiles (`int8_tile_kernel`):
    `tandem::tile_gemm_int8`, which widens the codes to bf16 on their way into the tiles (exactly) and scales each
    fp32 sum once: torch's `_weight_int8pack_mm` maths, with the weight read once for all the rows.
  - Up to `int4_gemv.MAX_ROWS` rows of int4 on such a CPU, with any of the group sizes (`int4_row_kernel`):
    `shared_model.int4_gemv`, which rounds each row to int8 in the weight's groups and multiplies the 4-bit codes
    by those bytes on `vpdpbusd`, as llama.cpp's Q4_0 does. Such a layer keeps only that kernel's layout (codes
    `[N, K/2]`, scales and zeros `[2, N, G]`), the same bytes as torch's; its reference models the rounding too.
  - From `INT4_TILE_MIN_ROWS` up to `TILE_MAX_ROWS` rows of int4 in bf16 on a CPU with AMX tiles as well
    (`int4_tile_kernel`; `int4_gemv` then takes the calls below `INT4_TILE_MIN_ROWS`): `tandem::tile_gemm_int4`,
    which unpacks each 16 weight rows of that layout into bf16 in L1/L2, each weight (q - 8)·s + z rounded to bf16
    exactly as the dequantized path's weight (`int4_dequantize`), and multiplies them on the tiles: the codes are
    read once for all the rows, and the activations are not rounded. `int4_gemv_rows` says where the split is.
  - Otherwise up to `PACKED_MAX_ROWS` rows (decode steps): torch's packed weight-only kernels, which read the
    quantized bytes and nothing else: `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` on CPU,
    `_weight_int4pack_mm` on CUDA. Their cost grows with every row, so
  - more rows (prefill chunks): the matrix is dequantized into the compute dtype for this call and multiplied by
    the dense GEMM. For int4 in the row kernel's layout that is `int4_gemv`'s C++ `int4_dequantize`; otherwise,
    for int4 on CPU, it unpacks torch's packed layout, which `QuantizedLinear` checks against the
    codes when it is built; where the layout is not the one expected (another CPU capability), it runs the packed
    kernel in slices of `PACKED_MAX_ROWS` rows instead: the same result, slower.
  - Where a device has no packed int8 kernel (some CUDA builds), every call dequantizes: correct, slower.
- `row_kernels=False` (`quantize_weights`, `QuantizedLinear`, `fake_quantized`): torch's kernels and layouts only,
  even where Tandem's row kernels run (`int4_row_kernels=False`: for the int4 layers alone); the caller's choice
  (serving: `inference_svc.executor.prepare`).
  `QuantizedLinear.method()` names the method a layer runs and its row-count table, for that record.
- `dequantizes_at(model, rows)`: whether a call of that many rows to any quantized projection of the decoder's
  layers dequantizes its weight (`QuantizedLinear.path`, the branch `forward` takes; the LM head is called with the
  sampled rows only); the engine's prefill group reads it.
- `serving_weight_bytes(model)` is what the weights occupy as served: every distinct tensor storage reachable
  from the model, the merged projections' included (shared storage counted once).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import tandem_native
from shared_model import int4_gemv, int8_gemv
from shared_model.ledger import DEFAULT_GROUP_SIZE, INT4_GROUP_SIZES, QUANTIZATIONS
from shared_model.model import CausalLM
from shared_model.serving_model import TILE_MAX_ROWS, ServingDecoder, fuse_projections

PACKED_MAX_ROWS = 4
"""Rows up to which torch's packed kernels beat dequantize-then-GEMM: their time grows with every row, the GEMM's
hardly (docs/benchmarks-archive.md, "Figures moved out of docstrings"). Where the AMX tiles run, int8 takes them
from 2 rows instead."""
INT4_TILE_MIN_ROWS = 9
"""Rows from which an int4 layer in bf16 on a CPU with AMX tiles runs `tandem::tile_gemm_int4` rather than
`int4_gemv` (a rule from the CPU's features: AMX-BF16 and AVX-512 VNNI; the bound measured on such a machine,
docs/benchmarks.md, "int4 on the AMX tiles"): `int4_gemv` streams 0.5 bytes a weight and wins for a few rows; from
here on it re-reads the codes for every 4 rows and the tiles, which read them once, are faster."""
_INT4_ROWS_MULTIPLE = 16  # the CPU packing tiles output rows by 16


class QuantizationError(ValueError):
    """A weight cannot be quantized as asked; the message names the weight and the rule it breaks."""


# ------------------------------------------------------------------------------------ number formats
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q int8 [N, K], scales fp32 [N]) with weight ≈ q · scales[:, None]."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [N]; all-zero rows stay 0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q uint8 [N, K] in 0..15, scales fp32 [N, K/g], zeros fp32 [N, K/g]),
    with weight ≈ (q - 8) · scale + zero in each group of `group_size` inputs."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group_size, group_size)  # [N, G, g]
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, G]
    scales = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scales, lo + 8 * scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 [N, K] matrix the int8 kernel multiplies by, its scales rounded to `dtype` as stored."""
    return q.float() * scales.to(dtype).float()[:, None]


def dequantize_int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The fp32 [N, K] matrix the int4 kernel multiplies by, scales and zeros rounded to `dtype` as stored."""
    n, k = q.shape
    s, z = scales.to(dtype).float()[..., None], zeros.to(dtype).float()[..., None]  # [N, G, 1]
    return ((q.float().reshape(n, k // group_size, group_size) - 8) * s + z).reshape(n, k)


def check_quantizable(name: str, weight: torch.Tensor, kind: str, group_size: int) -> None:
    """Raise `QuantizationError` naming `name` when `weight` [N, K] cannot take `kind` at `group_size`."""
    if kind not in ("int8", "int4"):
        raise QuantizationError(f"quantization must be one of {QUANTIZATIONS}, got {kind!r}")
    if kind == "int4":
        n, k = weight.shape
        if group_size not in INT4_GROUP_SIZES:
            raise QuantizationError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        if k % group_size:
            raise QuantizationError(f"{name}: {k} inputs are not a multiple of the int4 group size {group_size}")
        if n % _INT4_ROWS_MULTIPLE:
            raise QuantizationError(f"{name}: {n} outputs are not a multiple of {_INT4_ROWS_MULTIPLE} (int4 packing)")


def compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The activation dtype of quantized matmuls (and of their stored scales) for a model in `model_dtype`."""
    return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def int8_row_kernel(in_features: int, device: torch.device) -> bool:
    """Whether an int8 layer of `in_features` inputs on `device` runs its calls of up to `int8_gemv_rows` activation
    rows through `shared_model.int8_gemv` (activations rounded to int8 in groups), which its reference then models
    too."""
    return device.type == "cpu" and int8_gemv.activation_group(in_features) is not None and int8_gemv.available()


def int8_tile_kernel(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an int8 layer of `shape` ([N, K]) computing in `dtype` on `device` runs 2..`TILE_MAX_ROWS` rows on
    `tandem::tile_gemm_int8` (bf16 on a CPU with AMX tiles; N a multiple of 16, K of 32)."""
    n, k = shape
    return dtype == torch.bfloat16 and device.type == "cpu" and n % 16 == 0 and k % 32 == 0 and tandem_native.tiles()


def int4_row_kernel(group_size: int, device: torch.device) -> bool:
    """Whether an int4 layer in groups of `group_size` on `device` runs up to `int4_gemv.MAX_ROWS` activation rows
    through `shared_model.int4_gemv` (activations rounded to int8 in the weight's groups), stored in its layout."""
    return device.type == "cpu" and int4_gemv.available(group_size)


def int4_tile_kernel(group_size: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an int4 layer in groups of `group_size` computing in `dtype` on `device` (with the row kernels on)
    runs `INT4_TILE_MIN_ROWS`..`TILE_MAX_ROWS` rows on `tandem::tile_gemm_int4`: bf16 on a CPU where `int4_gemv`
    runs and the AMX tiles too."""
    return dtype == torch.bfloat16 and int4_row_kernel(group_size, device) and tandem_native.tiles()


def int8_gemv_rows(dtype: torch.dtype, device: torch.device) -> int:
    """The most rows a call of an int8 layer with the row kernel (`int8_row_kernel`) runs through `int8_gemv`: one
    where AMX tiles can take two and more (bf16 on such a CPU), else `int8_gemv.MAX_ROWS`."""
    tiles = dtype == torch.bfloat16 and device.type == "cpu" and tandem_native.tiles()
    return 1 if tiles else int8_gemv.MAX_ROWS


def int4_gemv_rows(group_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """The most rows a call of such an int4 layer (row kernels on, `int4_row_kernel`) runs through `int4_gemv`."""
    return INT4_TILE_MIN_ROWS - 1 if int4_tile_kernel(group_size, dtype, device) else int4_gemv.MAX_ROWS


def activation_rounding(
    kind: str,
    in_features: int,
    group_size: int,
    device: torch.device,
    row_kernels: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[int, int]:
    """(inputs per activation scale, most rows) of the calls whose activations a `kind` layer computing in `dtype`
    rounds to int8 on `device` (its row kernel's); (0, 0) where no row kernel runs (or `row_kernels` is False)."""
    if not row_kernels:
        return 0, 0
    if kind == "int8" and int8_row_kernel(in_features, device):
        return int8_gemv.activation_group(in_features) or 0, int8_gemv_rows(dtype, device)
    if kind == "int4" and int4_row_kernel(group_size, device):
        return group_size, int4_gemv_rows(group_size, dtype, device)
    return 0, 0


def exact_weight_rows(
    kind: str,
    shape: tuple[int, int],
    group_size: int,
    device: torch.device,
    row_kernels: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """The most rows of a call whose product a `kind` layer of `shape` ([N, K]) computing in `dtype` on `device`
    takes with its weight as dequantized in fp32 (the packed and row kernels, and int8's tiles, which scale each
    fp32 sum); calls of more rows multiply the weight rounded to `dtype` (the dequantized path, and int4's tiles,
    which round each weight to bf16 as it does)."""
    if kind == "int8":
        if row_kernels and int8_tile_kernel(shape, dtype, device):
            return TILE_MAX_ROWS
        gemv = row_kernels and int8_row_kernel(shape[1], device)
        return max(PACKED_MAX_ROWS, int8_gemv_rows(dtype, device) if gemv else 0)
    if row_kernels and int4_row_kernel(group_size, device):
        return int4_gemv_rows(group_size, dtype, device)
    return PACKED_MAX_ROWS


def _has_kernel(op: str, device: torch.device) -> bool:
    key = "CUDA" if device.type == "cuda" else device.type.upper()
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)


# ------------------------------------------------------------------------------------ the module
class RowKernel(NamedTuple):
    """A `QuantizedLinear`'s row kernel and its operator's arguments (`QuantizedLinear.row_kernel`)."""

    name: str
    """'int8_gemv' or 'int4_gemv' (`torch.ops.tandem.<name>`)."""
    rows: int
    """Calls of 1 to this many rows run it."""
    weight: torch.Tensor
    """int8 [N, K], or int4 codes in the kernel's blocked layout [N, K / 2]."""
    scales: torch.Tensor
    """int8: [N]; int4: scales and zeros [2, N, K / group]."""
    group: int
    """The operator's group argument (int8: its activation groups; int4: the weight's groups)."""


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored int8 (per row) or int4 (per group); see the module docstring."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kind: str,
        group_size: int,
        dtype: torch.dtype,
        row_kernels: bool = True,
    ) -> None:
        """`row_kernels=False`: torch's kernels and layouts only, even where Tandem's row kernels run."""
        super().__init__()
        check_quantizable("weight", weight, kind, group_size)
        self.kind, self.group_size = kind, group_size
        self.dtype = compute_dtype(dtype)
        self.out_features, self.in_features = weight.shape
        device = weight.device
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self._int4_block_rows = 0  # int4 on CPU: rows per block of torch's packed layout, 0 when not recognized
        self._row_kernel = False  # a VNNI CPU: int8's and int4's calls of few rows run Tandem's kernels
        self._tile_kernel = False  # bf16 on an AMX CPU: int8's 2.., int4's INT4_TILE_MIN_ROWS.. up to TILE_MAX_ROWS
        self._gemv_rows = 0  # with the row kernel: the most rows of a call to tandem::int8_gemv / int4_gemv
        if kind == "int8":
            q, scales = quantize_int8(weight)
            self.register_buffer("qweight", q)  # [N, K] int8
            self.register_buffer("scales", scales.to(self.dtype))  # [N]
            self._packed_kernel = _has_kernel("_weight_int8pack_mm", device)
            self._row_kernel = row_kernels and int8_row_kernel(self.in_features, device)
            self._tile_kernel = row_kernels and int8_tile_kernel(q.shape, self.dtype, device)
            self._group = int8_gemv.activation_group(self.in_features) or 0  # the kernel's activation groups
            if self._row_kernel:
                self._gemv_rows = int8_gemv_rows(self.dtype, device)
        else:
            q, scales, zeros = quantize_int4(weight, group_size)
            # [G, N, 2]: each group's scale and zero for every output row, as torch's kernels take them
            sz = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()
            self._row_kernel = row_kernels and int4_row_kernel(group_size, device)
            self._tile_kernel = row_kernels and int4_tile_kernel(group_size, self.dtype, device)
            if self._row_kernel:  # Tandem's layout only: [N, K/2] codes, [2, N, G] scales and zeros
                self._gemv_rows = int4_gemv_rows(group_size, self.dtype, device)
                packed = int4_gemv.pack(q, group_size)
                sz = torch.stack([scales, zeros]).contiguous()  # [2, N, G]
            elif device.type == "cuda":  # tinygemm: bf16 only; two codes per byte, high nibble first
                self.dtype = torch.bfloat16
                pairs = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()
                packed = torch.ops.aten._convert_weight_to_int4pack(pairs, 8)
            else:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
                self._int4_block_rows = _cpu_int4_layout(packed, q)
            self.register_buffer("qweight", packed)
            self.register_buffer("scales_and_zeros", sz.to(self.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        path = self.path(x2.shape[0])
        if path == "int8_gemv":
            y = torch.ops.tandem.int8_gemv(x2, self.qweight, self.scales, self._group)  # [M, N]
        elif path == "int4_gemv":
            y = torch.ops.tandem.int4_gemv(x2, self.qweight, self.scales_and_zeros, self.group_size)  # [M, N]
        elif path == "tiles":
            if self.kind == "int8":
                y = torch.ops.tandem.tile_gemm_int8(x2, self.qweight, self.scales)  # [M, N]
            else:
                y = torch.ops.tandem.tile_gemm_int4(x2, self.qweight, self.scales_and_zeros, self.group_size)  # [M, N]
        elif path == "packed":
            y = self._packed(x2)
        elif path == "dequantize":
            y = F.linear(x2, self.dequantize())
        else:  # int4 in a packed layout this module cannot unpack: the packed kernel, a few rows at a time
            y = torch.cat([self._packed(rows) for rows in x2.split(PACKED_MAX_ROWS)])
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)  # [..., N]

    def path(self, rows: int) -> str:
        """`forward`'s path for a call of `rows` rows: 'int8_gemv' or 'int4_gemv' (Tandem's row kernels), 'tiles'
        (AMX), 'packed' (torch's packed kernels), 'dequantize' (the whole weight dequantized for this call, then the
        dense GEMM) or 'packed_slices' (int4 in a layout this module cannot unpack)."""
        if self._row_kernel and rows <= self._gemv_rows:
            return f"{self.kind}_gemv"
        if self._tile_kernel and rows <= TILE_MAX_ROWS:
            return "tiles"
        if rows <= PACKED_MAX_ROWS and not (self._row_kernel and self.kind == "int4"):  # no torch layout then
            return "packed"
        if self.kind == "int8" or self._int4_block_rows or self._row_kernel or self.qweight.device.type == "cuda":
            return "dequantize"
        return "packed_slices"

    def row_kernel(self) -> RowKernel | None:
        """Tandem's kernel that `forward` runs for calls of the fewest rows, with its arguments: `int8_gemv` and
        `int4_gemv` for up to their row kernel's rows; None where it runs none there (torch's kernels, tiles
        from the first row, or a bias). The decode runner (`shared_model.native_decode`) calls it for those rows."""
        if not self._row_kernel or self.bias is not None:
            return None
        if self.kind == "int8":
            return RowKernel("int8_gemv", self._gemv_rows, self.qweight, self.scales, self._group)
        if not self._gemv_rows:
            return None
        return RowKernel("int4_gemv", self._gemv_rows, self.qweight, self.scales_and_zeros, self.group_size)

    def method(self) -> tuple[str, str]:
        """(The method this layer runs, its row-count table in words): what `forward` does, for the load plan."""
        m = PACKED_MAX_ROWS
        cuda = self.qweight.device.type == "cuda"
        if self.kind == "int8":
            if self._row_kernel and self._tile_kernel:
                table = (
                    f"1 row: tandem::int8_gemv (int8 activations); 2-{TILE_MAX_ROWS} rows: tandem::tile_gemm_int8; "
                    "more: dequantize + GEMM"
                )
                return "int8_gemv+tile_gemm_int8", table
            if self._tile_kernel:
                return "int8_tiles", f"1-{TILE_MAX_ROWS} rows: tandem::tile_gemm_int8; more: dequantize + GEMM"
            if self._row_kernel:
                table = f"{_span(1, self._gemv_rows)}: tandem::int8_gemv (int8 activations); more: dequantize + GEMM"
                return "int8_gemv", table
            if not self._packed_kernel:
                return "int8_dequantize", "every call: dequantize + GEMM (no packed int8 kernel for this device)"
            return "int8_packed", f"1-{m} rows: _weight_int8pack_mm; more: dequantize + GEMM"
        if self._row_kernel and self._tile_kernel:
            gemv = f"{_span(1, self._gemv_rows)}: tandem::int4_gemv (int8 activations); " if self._gemv_rows else ""
            tiles = f"{_span(self._gemv_rows + 1, TILE_MAX_ROWS)}: tandem::tile_gemm_int4"
            name = "int4_gemv+tile_gemm_int4" if self._gemv_rows else "int4_tiles"
            return name, f"{gemv}{tiles}; more: C++ dequantize + GEMM"
        if self._row_kernel:
            rows = self._gemv_rows
            return "int4_gemv", f"1-{rows} rows: tandem::int4_gemv (int8 activations); more: C++ dequantize + GEMM"
        if cuda:
            return "int4_tinygemm", f"1-{m} rows: _weight_int4pack_mm; more: dequantize + GEMM"
        if self._int4_block_rows:
            return "int4_packed", f"1-{m} rows: _weight_int4pack_mm_for_cpu; more: unpack + GEMM"
        return "int4_packed", f"every call: _weight_int4pack_mm_for_cpu in slices of {m} rows (layout not unpackable)"

    def row_bounds(self) -> tuple[int, ...]:
        """The largest row count of each of `forward`'s branches but the last (a compiled step traces a graph per
        branch, so its warm-up runs each side of each bound)."""
        if self.kind == "int8":
            if self._tile_kernel:
                return (1, TILE_MAX_ROWS) if self._row_kernel else (TILE_MAX_ROWS,)
            return (self._gemv_rows,) if self._row_kernel else (PACKED_MAX_ROWS,)
        if self._tile_kernel:
            return (self._gemv_rows, TILE_MAX_ROWS) if self._gemv_rows else (TILE_MAX_ROWS,)
        return (self._gemv_rows,) if self._row_kernel else (PACKED_MAX_ROWS,)

    def _packed(self, x2: torch.Tensor) -> torch.Tensor:
        if self.kind == "int8":
            if self._packed_kernel:
                return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
            return F.linear(x2, self.qweight.to(self.dtype)) * self.scales  # the row scale factors out
        if self.qweight.device.type == "cuda":
            return torch.ops.aten._weight_int4pack_mm(x2, self.qweight, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales_and_zeros)

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] in the compute dtype, as the kernels see it (a new tensor each call)."""
        if self.kind == "int8":
            return self.qweight.to(self.dtype).mul_(self.scales[:, None])
        n, k, g = self.out_features, self.in_features, self.group_size
        if self._row_kernel:  # Tandem's layout, in C++: int4_gemv.dequantize's fp32 values, rounded to the dtype
            return torch.ops.tandem.int4_dequantize(self.qweight, self.scales_and_zeros, g)
        if self.qweight.device.type == "cuda":  # tinygemm's tiled layout: let the kernel multiply the identity
            eye = torch.eye(k, dtype=self.dtype, device=self.qweight.device)
            return torch.ops.aten._weight_int4pack_mm(eye, self.qweight, g, self.scales_and_zeros).t()
        if not self._int4_block_rows:
            raise QuantizationError("this int4 weight's packed layout is not one this module can unpack")
        codes = _unpack_cpu_int4(self.qweight, n, k, self._int4_block_rows).float()  # [N, K], 0..15
        sz = self.scales_and_zeros.float()
        scales, zeros = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]  # [N, G, 1]
        # in fp32 as the kernel does, rounded once: q·s and the offset z - 8·s nearly cancel
        weight = codes.view(n, k // g, g).sub_(8).mul_(scales).add_(zeros)
        return weight.view(n, k).to(self.dtype)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.kind == "int4" else ""
        return f"in={self.in_features}, out={self.out_features}, {self.kind}{group}, dtype={self.dtype}"


def _span(low: int, high: int) -> str:
    """'1 row', '9-192 rows': a row-count span for `method`'s table."""
    return f"{low} row{'s' if low > 1 else ''}" if low == high else f"{low}-{high} rows"


def _unpack_cpu_int4(packed: torch.Tensor, n: int, k: int, block_rows: int) -> torch.Tensor:
    """Codes [N, K] (uint8, 0..15) from `_convert_weight_to_int4pack_for_cpu`'s layout: per block of `block_rows`
    output rows and per input k, block_rows/2 bytes whose low nibbles hold the block's first half of rows and
    whose high nibbles the second half (64 rows with AVX-512, 32 with AVX2)."""
    blocks = packed.view(n // block_rows, k, block_rows // 2)
    codes = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # [N / B, K, B]
    return codes.transpose(1, 2).reshape(n, k)


def _cpu_int4_layout(packed: torch.Tensor, codes: torch.Tensor) -> int:
    """The block size of torch's packed int4 layout, found by unpacking and comparing with the codes; 0 if
    neither known layout reproduces them (then nothing unpacks it)."""
    n, k = codes.shape
    for block_rows in (64, 32):
        if n % block_rows == 0 and torch.equal(_unpack_cpu_int4(packed, n, k, block_rows), codes):
            return block_rows
    return 0


# ------------------------------------------------------------------------------------ the model transform
def quantize_weights(
    model: CausalLM | ServingDecoder,
    kind: str,
    group_size: int = DEFAULT_GROUP_SIZE,
    row_kernels: bool = True,
    int4_row_kernels: bool = True,
) -> ServingDecoder:
    """The serving decoder of `model` (`fuse_projections`) with its projections quantized in place (see the module
    docstring). "none": merged only. `row_kernels=False`: torch's kernels and layouts only (the LM head's int8
    too); `int4_row_kernels=False`: the same for the int4 layers alone (torch's packed int4 kernel and layout; the
    LM head keeps its int8 kernel). Every weight is checked before any is changed: a refused model is untouched."""
    if kind != "none":
        _check_model(model, kind, group_size)
    decoder = fuse_projections(model)
    if kind == "none":
        return decoder
    dtype = decoder.embed_tokens.weight.dtype
    layer_row_kernels = row_kernels and (kind != "int4" or int4_row_kernels)
    with torch.no_grad():
        for layer in decoder.layers:
            for name in ("qkv", "o_proj", "gate_up", "down_proj"):
                setattr(layer, name, _quantized(getattr(layer, name), kind, group_size, dtype, layer_row_kernels))
        decoder.lm_head = _quantized(decoder.lm_head, "int8", group_size, dtype, row_kernels)
    return decoder


def _quantized(linear: nn.Module, kind: str, group_size: int, dtype: torch.dtype, row_kernels: bool) -> QuantizedLinear:
    assert isinstance(linear, nn.Linear), f"expected an nn.Linear to quantize, got {type(linear).__name__}"
    return QuantizedLinear(linear.weight, linear.bias, kind, group_size, dtype, row_kernels)


def _check_model(model: CausalLM | ServingDecoder, kind: str, group_size: int) -> None:
    """Every weight that `kind` would take, checked before any is changed (all or nothing), named as the Hugging Face
    parameter (a serving decoder's merged projections: by the parameters merged into them)."""
    if isinstance(model, ServingDecoder):
        if any(isinstance(m, QuantizedLinear) for m in model.projections()):
            raise QuantizationError("the model is quantized already")
        for i, layer in enumerate(model.layers):
            for name, m in (
                ("self_attn.{q,k,v}_proj (merged)", layer.qkv), ("self_attn.o_proj", layer.o_proj),
                ("mlp.{gate,up}_proj (merged)", layer.gate_up), ("mlp.down_proj", layer.down_proj),
            ):  # fmt: skip
                check_quantizable(f"model.layers.{i}.{name}.weight", m.weight, kind, group_size)
        return
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name, m in (
            ("q_proj", attn.q_proj), ("k_proj", attn.k_proj), ("v_proj", attn.v_proj), ("o_proj", attn.o_proj),
            ("gate_proj", mlp.gate_proj), ("up_proj", mlp.up_proj), ("down_proj", mlp.down_proj),
        ):  # fmt: skip
            prefix = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            check_quantizable(f"model.layers.{i}.{prefix}.{name}.weight", m.weight, kind, group_size)


class DequantizedLinear(nn.Module):
    """The reference of a `QuantizedLinear`: its dequantized weight in fp32, applied with the same roundings (the
    input and output rounded to the compute dtype; past `exact_rows` rows (`exact_weight_rows`: the dequantized
    path's calls and int4's tiles') the weight too, as those multiply it in that dtype; with `rounding` from
    `activation_rounding`, the activations of the calls a row kernel runs) around a plain fp32 matmul. Only the
    order of the sums differs."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        compute: torch.dtype,
        rounding: tuple[int, int] = (0, 0),
        exact_rows: int = PACKED_MAX_ROWS,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)  # [N, K]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.compute = compute
        # (group, most rows): calls of at most that many rows get their activations rounded to int8 in groups, as
        # the row kernels do (`activation_rounding`); (0, 0): never
        self.act_group, self.act_rows = rounding
        self.exact_rows = exact_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        exact = rows <= self.exact_rows  # the packed and row kernels' (and int8 tiles') weights are not rounded
        weight = self.weight if exact else self.weight.to(self.compute).float()
        xc = x.to(self.compute).float()
        if self.act_group and rows <= self.act_rows:  # groups never span rows
            xc = int8_gemv.quantize_activation(xc.reshape(-1), self.act_group).view(xc.shape)
        y = F.linear(xc, weight).to(self.compute)
        return (y if self.bias is None else y + self.bias).to(x.dtype)


def fake_quantized(
    model: CausalLM,
    kind: str,
    group_size: int = DEFAULT_GROUP_SIZE,
    row_kernels: bool = True,
    int4_row_kernels: bool = True,
) -> CausalLM:
    """A copy of `model` (plain, unmerged) whose quantized projections are `DequantizedLinear`s holding the
    same codes' values: the reference that `quantize_weights`' kernels are checked against (the codes of a row do
    not depend on the rows merged beside it, so the unmerged copy quantizes to the same values)."""
    ref = copy.deepcopy(model)
    if kind == "none":
        return ref
    _check_model(ref, kind, group_size)
    stored = compute_dtype(ref.model.embed_tokens.weight.dtype)  # scales, zeros and activations are rounded to this

    def reference(linear: nn.Linear, as_kind: str) -> DequantizedLinear:
        allowed = row_kernels and (as_kind != "int4" or int4_row_kernels)
        device = linear.weight.device
        rounding = activation_rounding(as_kind, linear.in_features, group_size, device, allowed, stored)
        exact = exact_weight_rows(as_kind, tuple(linear.weight.shape), group_size, device, allowed, stored)
        if as_kind == "int8":
            w = dequantize_int8(*quantize_int8(linear.weight), stored)
            return DequantizedLinear(w, linear.bias, stored, rounding, exact)
        w = dequantize_int4(*quantize_int4(linear.weight, group_size), group_size, stored)
        return DequantizedLinear(w, linear.bias, stored, rounding, exact)

    with torch.no_grad():
        for layer in ref.model.layers:
            a, m = layer.self_attn, layer.mlp
            for owner, name in (
                (a, "q_proj"), (a, "k_proj"), (a, "v_proj"), (a, "o_proj"),
                (m, "gate_proj"), (m, "up_proj"), (m, "down_proj"),
            ):  # fmt: skip
                setattr(owner, name, reference(getattr(owner, name), kind))
        ref.lm_head = reference(ref.lm_head, "int8")  # its own tensor: untied from the embedding
    return ref


def serving_weight_bytes(model: ServingDecoder) -> int:
    """Bytes of every distinct storage the model's weights occupy as served (see the module docstring): its
    parameters and persistent buffers (quantized codes, scales, the merged q/k norm weights)."""
    tensors = model.state_dict(keep_vars=True).values()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def dequantizes_at(model: ServingDecoder, rows: int) -> bool:
    """Whether a call of `rows` rows to any of the decoder layers' quantized projections dequantizes the layer's
    whole weight for that call (`QuantizedLinear.path`): a cost paid once per call whatever its rows, so per step.
    Not the LM head: a step calls it with the rows it samples only."""
    layers = [m for m in model.projections() if m is not model.lm_head]
    return any(isinstance(m, QuantizedLinear) and m.path(rows) == "dequantize" for m in layers)
