"""Quality and capacity of the K/V cache dtypes (`--kv-cache-dtype`) on a model trained by `tandem train`.

What it does:
  1. Loads a bundle exported by `tandem train` (`--bundle DIR`; random weights say nothing about quality).
  2. Cuts the held-out text `tandem eval` scores (the validation split of the default corpus) into windows of
     `--window` tokens (at most `--max-tokens`), and scores them through an in-process `Engine` per K/V dtype
     (`inference_svc.evaluation.evaluate_engine`: prompt logprobs, fp32 weights on CPU, the torch attention
     path, chunked prefill off so each window is one prefill), in this order: auto (= the weights' fp32), bf16,
     fp16, fp8, int8.
  3. For each dtype: perplexity and its ratio to bf16 K/V (goal: fp8 and int8 within 1%), the teacher-forced
     greedy agreement with bf16 K/V (the fraction of scored positions whose top-1 token equals bf16's), the
     greedy agreement of free-running continuations (`--continue` tokens from the start of each of
     `--prompts` windows, position by position against bf16's), and the KV capacity in tokens of a
     `--kv-cache-memory` pool with its ratio to bf16 (goal: ≥ 1.9× for fp8 and int8). Writes JSON (`--out`).

    .venv/bin/python benchmarks/kv_dtype_quality.py --bundle /tmp/kv-demo-run/bundle
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from inference_svc.engine import Engine, EngineConfig, SamplingParams
from inference_svc.evaluation import evaluate_engine
from shared_model.bundle import load_bundle
from shared_model.evaluate import evaluate_offline, heldout_texts, text_windows

DTYPES = ("auto", "bf16", "fp16", "fp8", "int8")
BASELINE = "bf16"
GOALS = {"perplexity_ratio_max": 1.01, "capacity_ratio_min": 1.9}


def _engine(bundle: Path, kv: str, memory: str) -> Engine:
    config = EngineConfig(
        dtype="float32", device="cpu", kv_cache_dtype=kv, kv_cache_memory=memory, enable_chunked_prefill=False
    )
    return Engine.from_bundle(bundle, config)


def _continuations(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    results = engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return [r.token_ids for r in results]


def _agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / max(len(a), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, required=True, help="a bundle exported by `tandem train`")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--prompts", type=int, default=16, help="windows whose first 32 tokens seed a continuation")
    p.add_argument("--continue", dest="cont", type=int, default=32, help="greedy tokens per continuation")
    p.add_argument("--kv-cache-memory", default="64MiB", help="the pool whose capacity is reported per dtype")
    p.add_argument("--out", type=Path, default=Path("benchmarks/kv_dtype_quality.json"))
    args = p.parse_args()
    torch.manual_seed(0)

    bundle = load_bundle(args.bundle, dtype=torch.float32)
    tokenizer = bundle.tokenizer
    assert tokenizer is not None
    texts = heldout_texts()
    ws = text_windows(tokenizer, texts, args.window, None, args.max_tokens)
    offline = evaluate_offline(bundle.model.eval(), tokenizer, texts, args.window, None, args.max_tokens)
    prompts = [w.ids[:32] for w in ws[: args.prompts]]
    print(f"{len(ws)} windows of {args.window} tokens ({sum(len(w.scored) for w in ws)} scored), offline fp32 "
          f"perplexity {offline.perplexity:.4f}", flush=True)  # fmt: skip

    rows: dict[str, dict] = {}
    top1: dict[str, list[int]] = {}
    conts: dict[str, list[list[int]]] = {}
    for kv in DTYPES:
        t0 = time.perf_counter()
        engine = _engine(args.bundle, kv, args.kv_cache_memory)
        res, top1[kv] = evaluate_engine(engine, ws, tokenizer)
        conts[kv] = _continuations(engine, prompts, args.cont)
        info = engine.info()
        rows[kv] = {
            "kv_cache_dtype": info.kv_cache_dtype,
            "perplexity": res.perplexity,
            "mean_nll": res.mean_nll,
            "kv_bytes_per_token": info.kv_bytes_per_token,
            "kv_bytes_per_block": info.kv_bytes_per_block,
            "kv_capacity_tokens": info.kv_capacity_tokens,
            "seconds": time.perf_counter() - t0,
        }
        print(f"  {kv:<5} perplexity {res.perplexity:.4f}  ({rows[kv]['seconds']:.0f} s)", flush=True)
    base = rows[BASELINE]
    for kv, row in rows.items():
        row["perplexity_ratio_vs_bf16"] = row["perplexity"] / base["perplexity"]
        row["greedy_agreement_teacher_forced_vs_bf16"] = _agreement(top1[kv], top1[BASELINE])
        row["greedy_agreement_continuations_vs_bf16"] = _agreement(
            [t for c in conts[kv] for t in c], [t for c in conts[BASELINE] for t in c]
        )
        row["capacity_ratio_vs_bf16"] = row["kv_capacity_tokens"] / base["kv_capacity_tokens"]

    head = f"{'kv':<6}{'stored':>7}{'ppl':>10}{'ppl/bf16':>10}{'agree tf':>10}{'agree gen':>10}"
    head += f"{'B/token':>9}{'tokens @ ' + args.kv_cache_memory:>18}{'x bf16':>8}"
    print(head)
    for kv, r in rows.items():
        cells = [f"{kv:<6}", f"{r['kv_cache_dtype']:>7}", f"{r['perplexity']:>10.4f}"]
        cells += [f"{r['perplexity_ratio_vs_bf16']:>10.4f}", f"{r['greedy_agreement_teacher_forced_vs_bf16']:>10.4f}"]
        cells += [f"{r['greedy_agreement_continuations_vs_bf16']:>10.4f}", f"{r['kv_bytes_per_token']:>9}"]
        cells += [f"{r['kv_capacity_tokens']:>18,}", f"{r['capacity_ratio_vs_bf16']:>8.3f}"]
        print("".join(cells))
    failed = [
        kv
        for kv in ("fp8", "int8")
        if rows[kv]["perplexity_ratio_vs_bf16"] > GOALS["perplexity_ratio_max"]
        or rows[kv]["capacity_ratio_vs_bf16"] < GOALS["capacity_ratio_min"]
    ]
    print(
        "goals (fp8, int8: perplexity within 1% of bf16 K/V, capacity >= 1.9x):",
        "FAILED " + str(failed) if failed else "met",
    )
    out = {
        "bundle": str(args.bundle),
        "window": args.window,
        "windows": len(ws),
        "scored_tokens": sum(len(w.scored) for w in ws),
        "continuations": {"prompts": len(prompts), "tokens": args.cont},
        "kv_cache_memory": args.kv_cache_memory,
        "offline_fp32_perplexity": offline.perplexity,
        "goals": GOALS,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
