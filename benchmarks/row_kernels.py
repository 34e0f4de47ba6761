"""The projections' row-count table, measured: every kernel a compiled step can run, at each row count, per matrix.

A step of R rows (R streams decoding, a verify step's drafts, a prefill chunk) runs each projection once with R
activation rows. This times, for `--matrices` weight matrices of `--rows` x `--cols` (more than the caches hold with
the defaults), median of `--rounds` interleaved rounds so that every kernel sees the same machine load:
bf16 `tandem::row_gemm` (fused multiply-adds), `tandem::tile_gemm` (AMX tiles, where this CPU has them),
`tandem::dot_gemm` (AVX512_BF16 dot products, where it has those), `F.linear`
and oneDNN's prepacked linear (the weight reordered once, for reference); int8 `tandem::tile_gemm_int8`,
`tandem::int8_gemv` (VNNI, activations rounded to int8), torch's `_weight_int8pack_mm` and dequantize + `F.linear`
(what an int8 layer ran past 4 rows before the tiles and `int8_gemv`'s rows). Prints ms per matrix and each kernel's
ratio to `F.linear`, and which kernel `serving_model.compiled_row_table` (and an int8 layer) picks at each row count,
so the bounds can be checked on the machine of the day (docs/benchmarks.md: the row kernels' table, §43).

    .venv/bin/python benchmarks/row_kernels.py [--threads 2] [--row-counts 1,2,3,4,8,16,32,64,128]
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
from shared_model import int8_gemv
from shared_model.quantize import int8_gemv_rows, quantize_int8
from shared_model.serving_model import TILE_MAX_ROWS, compiled_row_table


def _ms(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def _time_row_count(
    x: torch.Tensor, dense: list, packed: list, int8: list, tiles: bool, rounds: int
) -> dict[str, float]:
    """Median ms per matrix of each kernel for the activation rows `x`, over interleaved rounds."""
    group = int8_gemv.activation_group(x.shape[1])
    kernels: dict[str, Callable[[], object]] = {
        "row_gemm": lambda: [torch.ops.tandem.row_gemm(x, w) for w in dense],
        "F.linear": lambda: [F.linear(x, w) for w in dense],
        "packed": lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in packed],
        "int8 packed": lambda: [torch.ops.aten._weight_int8pack_mm(x, q, s) for q, s in int8],
        "int8_gemv": lambda: [torch.ops.tandem.int8_gemv(x, q, s, group) for q, s in int8],
        "int8 dequant": lambda: [F.linear(x, q.to(torch.bfloat16).mul_(s[:, None])) for q, s in int8],
    }
    if tandem_native.dot_bf16():
        kernels["dot_gemm"] = lambda: [torch.ops.tandem.dot_gemm(x, w) for w in dense]
    if tiles:
        kernels["tile_gemm"] = lambda: [torch.ops.tandem.tile_gemm(x, w) for w in dense]
        kernels["int8 tiles"] = lambda: [torch.ops.tandem.tile_gemm_int8(x, q, s) for q, s in int8]
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for fn in kernels.values():
        fn()  # warm
    for _ in range(rounds):
        for name, fn in kernels.items():
            times[name].append(_ms(fn, 3) / len(dense))
    return {name: statistics.median(v) for name, v in times.items()}


def _cell(med: dict[str, float], name: str) -> str:
    """'ms (speed-up over F.linear)' or '-' where the kernel does not run here."""
    return f"{med[name]:.3f} ({med['F.linear'] / med[name]:.2f}x)" if name in med else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=768)
    p.add_argument("--matrices", type=int, default=12)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--row-counts", default="1,2,3,4,8,16,32,64,128")
    args = p.parse_args(argv)
    if not tandem_native.available():
        print("Tandem's native kernels do not run here: nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    tiles = tandem_native.tiles()
    gen = torch.Generator().manual_seed(0)
    n, k = args.rows, args.cols
    dense = [(torch.randn(n, k, generator=gen) * 0.02).bfloat16() for _ in range(args.matrices)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in dense]
    int8 = [quantize_int8(w.float()) for w in dense]
    int8 = [(q, s.bfloat16()) for q, s in int8]
    table = compiled_row_table(torch.bfloat16, tiles=tiles, exact_verify=False, dot=tandem_native.dot_bf16())
    int8_rows = int8_gemv_rows(torch.bfloat16, torch.device("cpu"))
    print(f"{args.matrices} x [{n}, {k}] bf16 weights, {args.threads} threads, AMX tiles: {tiles}")
    print(f"compiled row table: {table.describe()}")
    print(
        "rows | row_gemm | tile_gemm | dot_gemm | F.linear | oneDNN packed | int8 tiles | int8_gemv | int8 packed "
        "| int8 dequant+GEMM | table | int8 table"
    )
    for rows in (int(r) for r in args.row_counts.split(",")):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        med = _time_row_count(x, dense, packed, int8, tiles, args.rounds)
        names = ("row_gemm", "tile_gemm", "dot_gemm", "F.linear", "packed", "int8 tiles", "int8_gemv", "int8 packed")
        cells = [_cell(med, c) for c in names]
        int8_kernel = "int8_gemv" if rows <= int8_rows else "tiles" if tiles and rows <= TILE_MAX_ROWS else "dequant"
        print(f"{rows} | " + " | ".join(cells) + f" | {_cell(med, 'int8 dequant')} | {table.kernel(rows)} | "
              f"{int8_kernel}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
