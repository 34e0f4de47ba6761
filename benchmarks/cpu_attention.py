"""The CPU decode attention kernel (`tandem_native` `decode_attention`, what `tandem::paged_attention` runs in a
compiled step) against the machine's memory bandwidth, measured in the same run.

A decode step reads every running sequence's cached K and V once per layer. This times the kernel for `--seqs`
sequences at each of `--contexts` tokens (blocks scattered over a pool, as the engine's allocator leaves them), two
ways: "cold", cycling over `--layers` layer caches of one pool with a sweep of `--sweep-mib` MiB (a step's weights)
between steps, as a served step meets its cache; and "hot", one layer's cache again and again (what a micro-benchmark
without the sweep would report). Prints ms per layer call, GB/s of K/V bytes read and their share of the bandwidth
of a torch sum over 1 GiB with the same threads (docs/benchmarks.md §31).

    .venv/bin/python benchmarks/cpu_attention.py [--threads 2] [--seqs 1,16,64] [--contexts 128,256,1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_peer import memory_bandwidth

import tandem_native

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def case(seqs: int, context: int, args: argparse.Namespace, g: torch.Generator):
    """(pool [layers, 2, blocks, block, Hkv, D], block tables [seqs, width] int32, context lens, q [seqs, Hq, D])."""
    bs, dtype = args.block_size, DTYPES[args.dtype]
    width = -(-context // bs)
    blocks = max(seqs * width * 2, 64)  # half the pool in use: tables point all over it
    pool = torch.randn(args.layers, 2, blocks, bs, args.kv_heads, args.head_dim, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[: seqs * width].to(torch.int32).view(seqs, width).contiguous()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    q = torch.randn(seqs, args.heads, args.head_dim, generator=g).to(dtype)
    return pool, tables, lens, q


def time_calls(lib, pool, tables, lens, q, scale: float, cold: bool, sweep: torch.Tensor, reps: int) -> float:
    """Median ms per layer call over `reps` steps (cold: every layer in turn, then the sweep; hot: layer 0 only)."""
    layers = pool.shape[0] if cold else 1
    per_step = []
    for _ in range(reps):
        if cold:
            sweep.sum()
        total = 0.0
        for layer in range(layers):
            t = time.perf_counter()
            lib.decode_attention(q, pool[layer, 0], pool[layer, 1], lens, tables, scale)
            total += time.perf_counter() - t
        per_step.append(total / layers * 1e3)
    return statistics.median(per_step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seqs", default="1,16,64")
    p.add_argument("--contexts", default="128,256,1024")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--sweep-mib", type=int, default=160, help="bytes read between cold steps (a step's weights)")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args()
    lib = tandem_native.library()
    if lib is None:
        sys.exit(f"the native kernels are not available here: {tandem_native.status()[1]}")
    torch.set_num_threads(args.threads)
    bandwidth = memory_bandwidth(args.threads)
    sweep = torch.ones(args.sweep_mib << 18, dtype=torch.float32)
    print(f"threads {args.threads}, {args.dtype}, Hq {args.heads} / Hkv {args.kv_heads} x {args.head_dim}, "
          f"torch sum bandwidth {bandwidth:.1f} GB/s")  # fmt: skip
    print("| seqs | context | cold ms/layer | cold GB/s | share of bandwidth | hot ms/layer | hot GB/s |")
    print("| --: | --: | --: | --: | --: | --: | --: |")
    g = torch.Generator().manual_seed(0)
    scale = args.head_dim**-0.5
    for seqs in (int(s) for s in args.seqs.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            pool, tables, lens, q = case(seqs, context, args, g)
            time_calls(lib, pool, tables, lens, q, scale, True, sweep, 1)  # threads woken, pages touched
            cold = time_calls(lib, pool, tables, lens, q, scale, True, sweep, args.reps)
            hot = time_calls(lib, pool, tables, lens, q, scale, False, sweep, args.reps * 4)
            kv_bytes = 2 * seqs * context * args.kv_heads * args.head_dim * pool.element_size()
            cold_gbs, hot_gbs = kv_bytes / cold / 1e6, kv_bytes / hot / 1e6
            print(f"| {seqs} | {context} | {cold:.3f} | {cold_gbs:.1f} | {cold_gbs / bandwidth:.0%} | {hot:.3f} | "
                  f"{hot_gbs:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
