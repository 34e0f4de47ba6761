"""An int4 layer's kernels at each row count, measured: where `quantize.INT4_TILE_MIN_ROWS` should sit on this CPU.

For the projections of `--layers` layers of a Qwen3 of `--hidden` / `--intermediate` (merged q/k/v with `--kv-heads`
heads of 64, o, merged gate/up, down; int4 in groups of `--group`), times per row count, median of `--rounds`
interleaved rounds (every kernel sees the same machine load): `tandem::int4_gemv` (1-16 rows), `tandem::tile_gemm_int4`
(AMX tiles), the C++ dequantize + `F.linear` (what more rows run), and bf16 `tandem::tile_gemm` on the dequantized
weights (the dense model's own kernel, for reference). Prints ms for all the projections of one step and the kernel
`QuantizedLinear` picks at each row count. Needs AMX-BF16 (else it says so and exits 1). Figures: docs/benchmarks.md,
"int4 on the AMX tiles".

    PYTHONPATH=$PWD .venv/bin/python benchmarks/int4_tiles.py [--threads 2] [--row-counts 1,2,4,5,8,12,16,17,32,64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import tandem_native
from shared_model import int4_gemv
from shared_model.quantize import QuantizedLinear


def _ms(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def _time_row_count(
    xs: dict[int, torch.Tensor], layers: list[QuantizedLinear], dense: list[torch.Tensor], g: int, rounds: int
) -> dict[str, float]:
    """Median ms of each kernel over all the projections, for activation rows `xs` (by input width)."""
    rows = next(iter(xs.values())).shape[0]
    kernels: dict[str, Callable[[], object]] = {
        "tiles": lambda: [torch.ops.tandem.tile_gemm_int4(xs[m.in_features], m.qweight, m.scales_and_zeros, g)
                          for m in layers],
        "dequant": lambda: [F.linear(xs[m.in_features], m.dequantize()) for m in layers],
        "bf16": lambda: [torch.ops.tandem.tile_gemm(xs[w.shape[1]], w) for w in dense],
    }  # fmt: skip
    if rows <= int4_gemv.MAX_ROWS:
        kernels["gemv"] = lambda: [torch.ops.tandem.int4_gemv(xs[m.in_features], m.qweight, m.scales_and_zeros, g)
                                   for m in layers]  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for fn in kernels.values():
        fn()  # warm
    for _ in range(rounds):
        for name, fn in kernels.items():
            times[name].append(_ms(fn, 2))
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--row-counts", default="1,2,4,5,8,12,16,17,24,32,48,64")
    args = p.parse_args(argv)
    if not tandem_native.tiles():
        print("this process cannot use AMX-BF16 tiles (or the native kernels): nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    h, i = args.hidden, args.intermediate
    shapes = [(h + 2 * 64 * args.kv_heads, h), (h, h), (2 * i, h), (h, i)] * args.layers  # [N, K]
    layers = [QuantizedLinear(torch.randn(n, k, generator=gen) * 0.02, None, "int4", args.group, torch.bfloat16)
              for n, k in shapes]  # fmt: skip
    dense = [m.dequantize() for m in layers]  # bf16 [N, K]
    g = args.group
    print(f"{len(layers)} int4 projections ({args.layers} layers, hidden {h}, intermediate {i}, groups of {g}), "
          f"{args.threads} threads; the layer's table: {layers[0].method()[1]}")  # fmt: skip
    print("rows | int4_gemv | tile_gemm_int4 | dequantize + F.linear | bf16 tile_gemm | the layer runs")
    for rows in (int(r) for r in args.row_counts.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {k for _, k in shapes}}
        med = _time_row_count(xs, layers, dense, g, args.rounds)
        cells = [f"{med[c]:.2f}" if c in med else "-" for c in ("gemv", "tiles", "dequant", "bf16")]
        picked = (
            "int4_gemv" if rows <= layers[0]._gemv_rows else "tile_gemm_int4" if rows <= 64 else "dequantize + GEMM"
        )
        print(f"{rows} | " + " | ".join(cells) + f" | {picked}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
