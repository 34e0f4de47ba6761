"""Attention for serving: one interface, its implementations, and the per-step backend the engine runs.

- `interface`: `AttentionOps`, the `typing.Protocol` every implementation satisfies.
- `paged`: `AttentionMetadata` (one step, as tensors) and `PagedAttention`, the one backend over any ops.
- `torch_ops`: the CPU path (plain torch, and Tandem's C++ decode kernels where they run).
- `native_cpu`: the C++ decode kernels (`tandem_native`) and the compiled graph's in-C++ attention operator.
- `triton`: the Triton kernels and their launch policy; `triton_ops`: their `AttentionOps`, and the reference's.
- `reference`: the plain-torch ground truth; `kv_quant`: the fp8/int8 K/V format all of them share.
"""
