"""Batch-1 matrix-vector kernels on CPU: what torch offers for each weight format, in GB/s of weight bytes read.

Times one activation row against `--matrices` weight matrices of `--rows` x `--cols` (more than the caches hold
with the defaults' 12 x 4096 x 768 in fp32), best of `--rounds` interleaved rounds so that every kernel sees the
same machine load, for: `shared_model.int8_gemv` (the VNNI kernel an int8 layer runs for one row, where the CPU
has it), `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` (through `QuantizedLinear`'s own
packing) with bf16 activations, `F.linear` in fp32 and bf16, `torch.mv` in bf16 (what `ServingLinear` ran
for one bf16 row eagerly until §44) and `tandem::row_gemm` in fp32 and bf16 (what it runs compiled). `--row-counts`
adds F.linear against row_gemm at a few rows (verify steps, decode batches). The figures: docs/benchmarks.md §15.

    .venv/bin/python benchmarks/gemv_probe.py [--threads 2] [--rows 4096 --cols 768 --matrices 12] [--row-counts 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import tandem_native
from shared_model import int4_gemv, int8_gemv
from shared_model.quantize import QuantizedLinear


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=768)
    p.add_argument("--matrices", type=int, default=12)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--row-counts", default="", help="also time F.linear and row_gemm at these row counts: 2,5,8,16")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, k, count = args.rows, args.cols, args.matrices
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=gen) * 0.05 for _ in range(count)]
    x32 = torch.randn(1, k, generator=gen)
    x16 = x32.bfloat16()
    int8 = [QuantizedLinear(w, None, "int8", 64, torch.bfloat16) for w in dense]
    int4 = [QuantizedLinear(w, None, "int4", 64, torch.bfloat16, row_kernels=False) for w in dense]
    int4_vnni = [QuantizedLinear(w, None, "int4", 64, torch.bfloat16) for w in dense] if int4_gemv.available(64) else []
    assert all(q._row_kernel for q in int4_vnni)
    bf16 = [w.bfloat16() for w in dense]
    cases: dict[str, tuple[Callable[[], object], float]] = {
        "_weight_int8pack_mm, bf16 x": (lambda: [q._packed(x16) for q in int8], n * k),
        **(
            {
                "tandem::int8_gemv (VNNI), int8 x": (
                    lambda: [int8_gemv.int8_gemv(x32[0], q.qweight, q.scales) for q in int8],
                    n * k,
                )
            }
            if int8_gemv.available() and int8_gemv.activation_group(k)
            else {}
        ),
        "_weight_int4pack_mm_for_cpu, bf16 x": (lambda: [q._packed(x16) for q in int4], n * k / 2),
        **({"tandem::int4_gemv (VNNI), int8 x": (lambda: [q(x16) for q in int4_vnni], n * k / 2)} if int4_vnni else {}),
        "F.linear fp32": (lambda: [F.linear(x32, w) for w in dense], n * k * 4),
        "F.linear bf16": (lambda: [F.linear(x16, w) for w in bf16], n * k * 2),
        "torch.mv bf16": (lambda: [torch.mv(w, x16[0]) for w in bf16], n * k * 2),
    }
    if (
        tandem_native.available()
    ):  # what a compiled step runs for a few rows (shared_model.serving_model.set_row_kernels)
        cases["tandem::row_gemm fp32"] = (lambda: [torch.ops.tandem.row_gemm(x32, w) for w in dense], n * k * 4)
        cases["tandem::row_gemm bf16"] = (lambda: [torch.ops.tandem.row_gemm(x16, w) for w in bf16], n * k * 2)
    best = _best_times({name: run for name, (run, _) in cases.items()}, args.rounds)
    print(f"{count} matrices of {n} x {k}, one activation row, {args.threads} threads (best of {args.rounds} rounds)")
    for name, (_, nbytes) in cases.items():
        print(f"  {name:38s} {best[name] * 1e3:7.2f} ms   {count * nbytes / best[name] / 1e9:5.1f} GB/s")
    for m in [int(r) for r in args.row_counts.split(",") if r] if tandem_native.available() else []:
        times = _best_times(_row_count_cases(torch.randn(m, k, generator=gen), dense, bf16), args.rounds)
        print(f"{m:3d} rows: " + "   ".join(f"{name} {t * 1e3:6.2f} ms" for name, t in times.items()))
    return 0


def _row_count_cases(
    x32: torch.Tensor, dense: list[torch.Tensor], bf16: list[torch.Tensor]
) -> dict[str, Callable[[], object]]:
    """F.linear against Tandem's row kernel for the rows of `x32` [M, K], in fp32 and in bf16."""
    x16, row_gemm = x32.bfloat16(), torch.ops.tandem.row_gemm
    return {
        "fp32 F.linear": lambda: [F.linear(x32, w) for w in dense],
        "fp32 row_gemm": lambda: [row_gemm(x32, w) for w in dense],
        "bf16 F.linear": lambda: [F.linear(x16, w) for w in bf16],
        "bf16 row_gemm": lambda: [row_gemm(x16, w) for w in bf16],
    }


def _best_times(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best seconds per call of each case over `rounds` interleaved rounds of 20 calls."""
    best = dict.fromkeys(cases, float("inf"))
    with torch.inference_mode():
        for _ in range(rounds):
            for name, run in cases.items():
                run()
                t0 = time.perf_counter()
                for _ in range(20):
                    run()
                best[name] = min(best[name], (time.perf_counter() - t0) / 20)
    return best


if __name__ == "__main__":
    sys.exit(main())
