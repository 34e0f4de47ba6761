"""GPU check of the Triton attention kernels: correctness on CUDA, then throughput against baselines of the same run.

Sections (each writes its part of one JSON file, printed as it goes):
1. correctness: bf16 and fp16 prefill / decode (split-KV on and off) / store_kv against `kernels.reference`, with
   FlashAttention's tolerance (error vs fp64 ≤ 2 × the torch same-precision error + a floor).
2. prefill: causal TFLOP/s (4·B·H·N²·D / 2) of `prefill_attention` over the paged cache vs torch SDPA's flash
   backend on the same shapes (contiguous K/V), and as a percentage of the H200's 989 TFLOP/s dense bf16.
   Goal: ≥ 80% of SDPA-flash at N ≥ 2k.
3. decode: achieved GB/s (bytes of K and V read) of `decode_attention`, split-KV on (chosen from the lengths) and
   off, batch 1-64 × context 1k-32k, vs a large device-to-device copy measured in this run (read + write bytes).
   Goal: ≥ 60% of copy bandwidth at long context.
4. engine: `Engine.from_bundle` on the `small` preset (random weights) with the Triton backend, and the torch
   backend as baseline: TTFT, time per output token and throughput at 1 and 64 concurrent requests. Imported
   lazily; skipped with the reason when the engine is unavailable.

Usage: python benchmarks/gpu_kernels.py [--out results.json] [--quick] [--sections correctness,prefill,...]
`--smoke` runs every section at toy sizes on CPU in Triton's interpreter (set TRITON_INTERPRET=1 first): it checks
the script's own plumbing, not performance. Without CUDA and without --smoke the script exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

H200_BF16_DENSE_TFLOPS = 989.0
SECTIONS = ("correctness", "prefill", "decode", "engine")
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


# ------------------------------------------------------------------------------------------------ helpers


def bench_ms(fn: Callable[[], Any], smoke: bool) -> float:
    """Median milliseconds of fn: triton.testing.do_bench on CUDA (L2 flushed between runs); one wall-clock
    run in smoke mode."""
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def paged_inputs(
    context_lens: list[int],
    q_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> dict[str, Any]:
    """q, a paged K/V cache holding every sequence's context in randomly permuted blocks, and the metadata."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n_blocks = [math.ceil(c / block_size) for c in context_lens]
    total = sum(n_blocks) + 1
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(context_lens), max(n_blocks), dtype=torch.int32)
    for s, nb in enumerate(n_blocks):
        tables[s, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
    shape = (total, block_size, hkv, d)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    q = torch.randn(sum(q_lens), hq, d, device=device, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "cu": cu,
        "lens": torch.tensor(context_lens, dtype=torch.int32, device=device),
        "tables": tables.to(device),
        "scale": d**-0.5,
    }


def tolerance(out: torch.Tensor, truth: torch.Tensor, same: torch.Tensor) -> dict[str, Any]:
    err = (out.double() - truth).abs().max().item()
    base = (same.double() - truth).abs().max().item()
    bound = 2 * base + FLOOR[out.dtype]
    return {"err": err, "torch_err": base, "bound": bound, "ok": bool(err <= bound and math.isfinite(err))}


# ------------------------------------------------------------------------------------------------ sections


def run_correctness(device: str, smoke: bool, autotune: bool) -> list[dict[str, Any]]:
    from inference_svc.attention import reference
    from inference_svc.attention import triton as kernels

    dtypes = [torch.float16] if smoke else [torch.float16, torch.bfloat16]
    rows = []
    shapes = (
        [([300, 17], [300, 5], 4, 2, 80, 16)]
        if smoke
        else [
            ([1000, 77, 2049], [1000, 13, 512], 32, 8, 128, 16),
            ([600, 4100], [600, 1], 12, 4, 64, 32),
            ([257], [257], 16, 2, 96, 16),
            ([700], [350], 8, 8, 256, 32),
        ]
    )
    for dtype in dtypes:
        for ctx, ql, hq, hkv, d, bs in shapes:
            x = paged_inputs(ctx, ql, hq, hkv, d, bs, dtype, device)
            meta = (x["cu"], x["lens"], x["tables"], x["scale"])
            k64, v64 = x["k_cache"].double(), x["v_cache"].double()
            out = kernels.prefill_attention(x["q"], x["k_cache"], x["v_cache"], *meta, autotune=autotune)
            truth = reference.prefill_attention(x["q"].double(), k64, v64, *meta)
            same = reference.prefill_attention(x["q"], x["k_cache"], x["v_cache"], *meta)
            rows.append(
                {"op": "prefill", "dtype": str(dtype), "shape": [ctx, ql, hq, hkv, d, bs]} | tolerance(out, truth, same)
            )

            qd = torch.randn(len(ctx), hq, d, device=device, dtype=dtype)
            dmeta = (x["lens"], x["tables"], x["scale"])
            truth = reference.decode_attention(qd.double(), k64, v64, *dmeta)
            same = reference.decode_attention(qd, x["k_cache"], x["v_cache"], *dmeta)
            for splits in (1, None, 8):
                out = kernels.decode_attention(
                    qd, x["k_cache"], x["v_cache"], *dmeta, num_splits=splits, autotune=autotune
                )
                row = {"op": f"decode splits={splits}", "dtype": str(dtype), "shape": [ctx, hq, hkv, d, bs]}
                rows.append(row | tolerance(out, truth, same))

            k_new = torch.randn(5, hkv, d, device=device, dtype=dtype)
            slots = torch.tensor([3, -1, 40, 17, 2 * bs + 1], device=device)
            kc, vc = x["k_cache"].clone(), x["v_cache"].clone()
            kernels.store_kv(k_new, k_new, x["k_cache"], x["v_cache"], slots)
            reference.store_kv(k_new, k_new, kc, vc, slots)
            ok = torch.equal(kc, x["k_cache"]) and torch.equal(vc, x["v_cache"])
            rows.append({"op": "store_kv", "dtype": str(dtype), "shape": [hkv, d, bs], "ok": ok})
    for r in rows:
        print(f"  correctness {r['op']:<20} {r['dtype']:<15} {r['shape']} ok={r['ok']}", flush=True)
    return rows


def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, smoke: bool) -> Callable[[], Any]:
    """A closure running SDPA (flash backend on CUDA) on [B, H, N, D] tensors, causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.MATH if smoke else SDPBackend.FLASH_ATTENTION

    def run() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def run_prefill(device: str, smoke: bool, quick: bool, autotune: bool) -> list[dict[str, Any]]:
    from inference_svc.attention import triton as kernels

    dtype = torch.float16 if smoke else torch.bfloat16
    hq, hkv, d, bs = (4, 2, 64, 16) if smoke else (32, 8, 128, 16)
    cases = [(1, 128)] if smoke else [(8, 1024), (4, 2048), (2, 4096), (1, 8192), (1, 16384)]
    if quick and not smoke:
        cases = [(4, 2048), (1, 8192)]
    rows = []
    for batch, n in cases:
        x = paged_inputs([n] * batch, [n] * batch, hq, hkv, d, bs, dtype, device)

        def ours(x: dict[str, Any] = x) -> torch.Tensor:
            return kernels.prefill_attention(
                x["q"], x["k_cache"], x["v_cache"], x["cu"], x["lens"], x["tables"], x["scale"], autotune=autotune
            )

        # SDPA baseline: same q, K/V gathered contiguous, GQA expanded outside the timed region.
        q_b = x["q"].view(batch, n, hq, d).transpose(1, 2).contiguous()
        k_b = torch.randn(batch, hq, n, d, device=device, dtype=dtype)
        v_b = torch.randn(batch, hq, n, d, device=device, dtype=dtype)
        flops = 4 * batch * hq * n * n * d / 2
        ms_ours = bench_ms(ours, smoke)
        ms_sdpa = bench_ms(_sdpa_flash(q_b, k_b, v_b, smoke), smoke)
        tf_ours, tf_sdpa = flops / ms_ours / 1e9, flops / ms_sdpa / 1e9
        row = {
            "batch": batch,
            "seqlen": n,
            "heads": [hq, hkv],
            "head_dim": d,
            "ms_triton": ms_ours,
            "ms_sdpa_flash": ms_sdpa,
            "tflops_triton": tf_ours,
            "tflops_sdpa_flash": tf_sdpa,
            "ratio_vs_sdpa_flash": tf_ours / tf_sdpa,
            "pct_of_h200_peak": 100 * tf_ours / H200_BF16_DENSE_TFLOPS,
        }
        rows.append(row)
        print(
            f"  prefill B={batch} N={n}: triton {tf_ours:.1f} TFLOP/s, sdpa-flash {tf_sdpa:.1f} "
            f"(ratio {row['ratio_vs_sdpa_flash']:.2f}, {row['pct_of_h200_peak']:.1f}% of peak)",
            flush=True,
        )
        del x, q_b, k_b, v_b
    return rows


def copy_bandwidth_gbps(device: str, smoke: bool) -> float:
    """Device-to-device copy of a large buffer; GB/s counting bytes read + written."""
    n_bytes = (1 << 20) if smoke else (4 << 30)
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), smoke)
    return 2 * n_bytes / ms / 1e6


def run_decode(device: str, smoke: bool, quick: bool, autotune: bool) -> dict[str, Any]:
    from inference_svc.attention import triton as kernels
    from inference_svc.attention.triton.paged_decode import choose_num_splits

    dtype = torch.float16 if smoke else torch.bfloat16
    hq, hkv, d, bs = (4, 2, 64, 16) if smoke else (32, 8, 128, 16)
    copy = copy_bandwidth_gbps(device, smoke)
    print(f"  device-to-device copy: {copy:.0f} GB/s (read + write)", flush=True)
    batches = [1] if smoke else ([1, 64] if quick else [1, 8, 32, 64])
    contexts = [300] if smoke else ([1024, 32768] if quick else [1024, 4096, 16384, 32768])
    rows = []
    for batch in batches:
        for ctx in contexts:
            x = paged_inputs([ctx] * batch, [1] * batch, hq, hkv, d, bs, dtype, device)
            q = x["q"]
            kv_bytes = 2 * batch * ctx * hkv * d * x["k_cache"].element_size()
            auto = choose_num_splits(q, x["k_cache"], x["tables"])
            row: dict[str, Any] = {"batch": batch, "context": ctx, "auto_splits": auto, "kv_bytes": kv_bytes}
            for label, splits in (("split_off", 1), ("split_on", None)):

                def ours(x: dict[str, Any] = x, splits: int | None = splits) -> torch.Tensor:
                    return kernels.decode_attention(
                        x["q"],
                        x["k_cache"],
                        x["v_cache"],
                        x["lens"],
                        x["tables"],
                        x["scale"],
                        splits,
                        autotune=autotune,
                    )

                ms = bench_ms(ours, smoke)
                gbps = kv_bytes / ms / 1e6
                row[label] = {"ms": ms, "gbps": gbps, "ratio_vs_copy": gbps / copy}
            rows.append(row)
            print(
                f"  decode B={batch} ctx={ctx}: split off {row['split_off']['gbps']:.0f} GB/s "
                f"({row['split_off']['ratio_vs_copy']:.2f} of copy), split on ({auto}) "
                f"{row['split_on']['gbps']:.0f} GB/s ({row['split_on']['ratio_vs_copy']:.2f})",
                flush=True,
            )
            del x
            if device == "cuda":
                torch.cuda.empty_cache()
    return {"copy_gbps_read_plus_write": copy, "rows": rows}


def _engine_case(
    engine_mod: Any, bundle: Path, vocab: int, backend: str, device: str, concurrency: int, smoke: bool, autotune: bool
) -> dict:
    from inference_svc.engine.types import SamplingParams

    dtype = "float16" if smoke else "bfloat16"
    config = engine_mod.EngineConfig(attention_backend=backend, device=device, dtype=dtype, triton_autotune=autotune)
    engine = engine_mod.Engine.from_bundle(bundle, config)
    prompt_len, new_tokens = (16, 4) if smoke else (512, 128)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate([torch.randint(5, vocab, (prompt_len,), generator=g).tolist()], params)  # warm-up / compile
    prompts = [torch.randint(5, vocab, (prompt_len,), generator=g).tolist() for _ in range(concurrency)]
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    produced = sum(len(r.token_ids) for r in results)
    return {
        "backend": backend,
        "concurrency": concurrency,
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "ttft_ms_mean": sum(r.timing.ttft_ms for r in results) / len(results),
        "tpot_ms_mean": sum(r.timing.tpot_ms for r in results) / len(results),
        "output_tokens_per_s": produced / wall,
        "wall_s": wall,
    }


def run_engine(device: str, smoke: bool, autotune: bool) -> dict[str, Any]:
    try:
        from inference_svc.engine import engine as engine_mod
        from shared_model.bundle import save_bundle
        from shared_model.config import get_preset
        from shared_model.corpus import CorpusConfig, load_corpus
        from shared_model.model import build_model
        from shared_model.tokenizer import Tokenizer
    except Exception as exc:  # the engine is developed in parallel; report, don't fail the other sections
        return {"skipped": f"engine unavailable: {type(exc).__name__}: {exc}"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config = get_preset("tiny" if smoke else "small")
        tokenizer = Tokenizer.train(load_corpus(CorpusConfig(max_documents=40)).texts(), vocab_size=512)
        model = build_model(config, dtype=torch.float32)
        bundle = save_bundle(Path(tmp) / "bundle", config, model, tokenizer=tokenizer, dtype="bfloat16")
        vocab = tokenizer.vocab_size
        for concurrency in (1, 2) if smoke else (1, 64):
            for backend in ("triton", "torch"):
                try:
                    row = _engine_case(engine_mod, bundle, vocab, backend, device, concurrency, smoke, autotune)
                except Exception as exc:
                    row = {"backend": backend, "concurrency": concurrency, "error": f"{type(exc).__name__}: {exc}"}
                    traceback.print_exc()
                rows.append(row)
                print(f"  engine {row}", flush=True)
    return {"preset": "tiny" if smoke else "small", "rows": rows}


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_kernels.json", help="JSON output path")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (for a tight device budget)")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--no-autotune", action="store_true", help="the kernels' heuristic configs, no autotuning")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    if not torch.cuda.is_available() and not args.smoke:
        print("gpu_kernels: no CUDA device; this benchmark needs a GPU (or --smoke on CPU)", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": platform.node(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter, smoke)",
        "torch": torch.__version__,
        "autotune": not args.no_autotune,
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        pass
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    failed = False
    for name in sections:
        print(f"[{name}]", flush=True)
        t0 = time.perf_counter()
        try:
            if name == "correctness":
                report[name] = run_correctness(device, args.smoke, not args.no_autotune)
                failed |= not all(r["ok"] for r in report[name])
            elif name == "prefill":
                report[name] = run_prefill(device, args.smoke, args.quick, not args.no_autotune)
            elif name == "decode":
                report[name] = run_decode(device, args.smoke, args.quick, not args.no_autotune)
            else:
                report[name] = run_engine(device, args.smoke, not args.no_autotune)
        except Exception as exc:
            traceback.print_exc()
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
            failed = True
        report.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(report, indent=2))  # after every section: a timeout still leaves results
    print(f"wrote {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
