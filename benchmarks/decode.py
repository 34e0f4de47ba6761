"""Engine decode benchmark on the `small` preset: every figure quoted against a baseline measured in the same run.

Measures, for each dtype (fp32, then bf16):
  1. the weight-read floor: one matvec per weight matrix (what batch-1 decode must at least do per token),
     measured in rounds interleaved with the engine's decode runs so both see the same machine load;
     reported as floor / engine time per output token (goal >= 0.8);
  2. batch-1 decode tokens/s, engine vs transformers `generate` on the same weights and prompt (goal >= 1.3x);
  3. aggregate output tokens/s, TTFT and time per output token at 1, 4, 16, 64 concurrent requests
     (goal: aggregate at 16 >= 5x at 1), drawn as throughput against per-user latency;
  4. prefix cache: TTFT of a request whose 512-token prefix is cached vs the same request uncached (goal <= 25%);
  5. chunked prefill: p99 inter-token latency of 8 running decodes while a 1,500-token prompt arrives, chunked
     vs not chunked.
Writes `<out>/decode.json` and `<out>/decode.png`.

    .venv/bin/python benchmarks/decode.py --out results/bench_engine
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from inference_svc.engine import Engine, EngineConfig, SamplingParams
from shared_model.bundle import save_bundle
from shared_model.config import get_preset
from shared_model.corpus import CorpusConfig, load_corpus
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer


def make_bundle(folder: Path, preset: str) -> Path:
    if (folder / "config.json").is_file():
        return folder
    tok = Tokenizer.train(load_corpus(CorpusConfig(max_documents=40)).texts(), vocab_size=2048)
    save_bundle(folder, get_preset(preset), build_model(get_preset(preset), seed=0), tokenizer=tok)
    return folder


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 2000) for _ in range(n)]


# ------------------------------------------------------------------------------------------------ floor
def weight_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    mats = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return list(mats.values())


@torch.inference_mode()
def floor_pass(mats: list[torch.Tensor]) -> tuple[float, float]:
    """(wall, cpu) seconds to read every weight matrix once: one matvec each."""
    wall = cpu = 0.0
    for w in mats:
        x = torch.randn(1, w.shape[1], dtype=w.dtype)
        t, c = time.perf_counter(), time.process_time()
        torch.nn.functional.linear(x, w)
        wall += time.perf_counter() - t
        cpu += time.process_time() - c
    return wall, cpu


# ------------------------------------------------------------------------------------------------ engine runs
def run_requests(
    engine: Engine, prompts: list[list[int]], new_tokens: int, arrivals: list[float] | None = None
) -> dict:
    """Add all prompts, step to completion; per-request TTFT / TPOT and the aggregate output rate."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, arrival_time=t0)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    wall = time.monotonic() - t0
    ttft = [o.timing.ttft_ms for o in finals]
    tpot = [o.timing.tpot_ms for o in finals]
    tokens = sum(o.usage.completion_tokens for o in finals)
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_ms_mean": statistics.mean(ttft),
        "ttft_ms_p50": statistics.median(ttft),
        "tpot_ms_mean": statistics.mean(tpot),
    }


def engine_decode_per_token(engine: Engine, prompt: list[int], n: int) -> tuple[float, float]:
    """(wall, cpu) seconds per output token after the first, batch 1 (same definition as for transformers)."""
    engine.add_request("solo", prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
    first: tuple[float, float] | None = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and outs:
            first = time.perf_counter(), time.process_time()
    assert first is not None
    return (time.perf_counter() - first[0]) / (n - 1), (time.process_time() - first[1]) / (n - 1)


def hf_decode_per_token(model, prompt: list[int], n: int) -> tuple[float, float]:
    """(wall, cpu) seconds per output token after the first: (t(n tokens) - t(1 token)) / (n - 1)."""
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)

    def gen(k: int) -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        model.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False)
        return time.perf_counter() - t, time.process_time() - c

    with torch.inference_mode():
        gen(2)
        one = min(gen(1) for _ in range(2))
        many = gen(n)
    return (many[0] - one[0]) / (n - 1), (many[1] - one[1]) / (n - 1)


# ------------------------------------------------------------------------------------------------ sections
def bench_floor_and_batch1(bundle: Path, dtype: str, args, rng: random.Random) -> dict:
    engine = Engine.from_bundle(bundle, EngineConfig(dtype=dtype))
    mats = weight_matrices(engine.runner.model)
    prompt = rand_prompt(rng, args.prompt_len)
    engine_decode_per_token(engine, prompt, 8)  # warm-up
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(bundle, dtype=engine.dtype).eval()
    floors, decodes, hf_times = [], [], []
    for _ in range(args.rounds):  # interleaved so that all three see the same machine load
        floors += [floor_pass(mats) for _ in range(3)]
        decodes.append(engine_decode_per_token(engine, prompt, args.new_tokens))
        hf_times.append(hf_decode_per_token(hf, prompt, args.new_tokens))
    del hf
    out: dict = {"weight_bytes": engine.weight_bytes}
    for i, clock in enumerate(("wall", "cpu")):
        floor = statistics.median(f[i] for f in floors)
        dec = statistics.median(d[i] for d in decodes)
        hft = statistics.median(h[i] for h in hf_times)
        out[clock] = {
            "floor_ms": floor * 1e3,
            "engine_ms_per_token": dec * 1e3,
            "hf_ms_per_token": hft * 1e3,
            "floor_over_engine": floor / dec,
            "floor_over_hf": floor / hft,
            "engine_tokens_per_s": 1 / dec,
            "hf_tokens_per_s": 1 / hft,
            "engine_over_hf_speed": hft / dec,
        }
    out["rounds_ms"] = {"floor": [[x * 1e3 for x in f] for f in floors],
                        "engine": [[x * 1e3 for x in d] for d in decodes],
                        "hf": [[x * 1e3 for x in h] for h in hf_times]}  # fmt: skip
    return out


def bench_concurrency(bundle: Path, dtype: str, args, rng: random.Random) -> dict:
    engine = Engine.from_bundle(bundle, EngineConfig(dtype=dtype, max_num_seqs=64, enable_prefix_caching=False))
    run_requests(engine, [rand_prompt(rng, args.prompt_len)], 4)  # warm-up
    out = {}
    for c in args.concurrency:
        out[str(c)] = run_requests(engine, [rand_prompt(rng, args.prompt_len) for _ in range(c)], args.new_tokens)
        print(f"  [{dtype}] concurrency {c}: {out[str(c)]}", flush=True)
    base = out[str(args.concurrency[0])]["tokens_per_s"]
    for c in args.concurrency:
        out[str(c)]["speedup_vs_1"] = out[str(c)]["tokens_per_s"] / base
    return out


def bench_prefix_cache(bundle: Path, dtype: str, rng: random.Random) -> dict:
    prefix = rand_prompt(rng, 512)
    engine = Engine.from_bundle(bundle, EngineConfig(dtype=dtype))
    run_requests(engine, [rand_prompt(rng, 64)], 1)  # warm-up
    uncached, cached = [], []
    for _ in range(3):
        p = prefix + rand_prompt(rng, 16)
        fresh = Engine.from_bundle(bundle, EngineConfig(dtype=dtype, enable_prefix_caching=False))
        uncached.append(run_requests(fresh, [p], 1)["ttft_ms_mean"])
        run_requests(engine, [prefix + rand_prompt(rng, 16)], 1)  # caches the prefix
        cached.append(run_requests(engine, [p], 1)["ttft_ms_mean"])
        prefix = rand_prompt(rng, 512)
    u, c = statistics.median(uncached), statistics.median(cached)
    return {"uncached_ttft_ms": u, "cached_ttft_ms": c, "cached_over_uncached": c / u, "runs": [uncached, cached]}


def bench_chunked_prefill(bundle: Path, dtype: str, rng: random.Random) -> dict:
    out = {}
    for chunked in (True, False):
        engine = Engine.from_bundle(
            bundle, EngineConfig(dtype=dtype, enable_chunked_prefill=chunked, prefill_chunk_size=256)
        )
        params = SamplingParams(max_new_tokens=10_000 // 100, ignore_eos=True)
        for i in range(8):
            engine.add_request(f"d{i}", rand_prompt(rng, 32), params)
        last: dict[str, float] = {}
        gaps: list[float] = []
        step = 0
        long_done = False
        while engine.has_unfinished_requests() and not long_done:
            if step == 5:
                engine.add_request("long", rand_prompt(rng, 1500), SamplingParams(max_new_tokens=1))
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id == "long":
                    long_done = True
                elif o.request_id in last and step >= 5:
                    gaps.append(now - last[o.request_id])
                last[o.request_id] = now
            step += 1
        gaps.sort()
        p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1e3
        out["chunked" if chunked else "unchunked"] = {"p99_itl_ms": p99, "max_itl_ms": gaps[-1] * 1e3,
                                                      "median_itl_ms": statistics.median(gaps) * 1e3}  # fmt: skip
    out["unchunked_over_chunked_p99"] = out["unchunked"]["p99_itl_ms"] / out["chunked"]["p99_itl_ms"]
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dtype, r in results["dtypes"].items():
        conc = r["concurrency"]
        keys = [k for k in conc if k.isdigit()]
        x = [conc[k]["tpot_ms_mean"] for k in keys]
        y = [conc[k]["tokens_per_s"] for k in keys]
        ax.plot(x, y, marker="o", label=dtype)
        for k, xi, yi in zip(keys, x, y, strict=True):
            ax.annotate(f"{k} req", (xi, yi), textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set_xlabel("time per output token, per user (ms)  →  slower for each user")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title("Tandem engine, small preset, CPU: throughput vs per-user latency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/bench_engine"))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["batch1", "concurrency", "prefix", "chunked"])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    bundle = make_bundle(args.out / f"bundle-{args.preset}", args.preset)
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch_threads": torch.get_num_threads(),
        "dtypes": {},
    }
    for dtype in args.dtypes:
        rng = random.Random(0)
        r: dict = {}
        if "batch1" not in args.skip:
            r["batch1"] = bench_floor_and_batch1(bundle, dtype, args, rng)
            print(
                f"[{dtype}] batch 1: {json.dumps({k: v for k, v in r['batch1'].items() if k != 'rounds'})}", flush=True
            )
        if "concurrency" not in args.skip:
            r["concurrency"] = bench_concurrency(bundle, dtype, args, rng)
        if "prefix" not in args.skip:
            r["prefix_cache"] = bench_prefix_cache(bundle, dtype, rng)
            print(f"[{dtype}] prefix cache: {r['prefix_cache']}", flush=True)
        if "chunked" not in args.skip:
            r["chunked_prefill"] = bench_chunked_prefill(bundle, dtype, rng)
            print(f"[{dtype}] chunked prefill: {r['chunked_prefill']}", flush=True)
        results["dtypes"][dtype] = r
        (args.out / "decode.json").write_text(json.dumps(results, indent=2) + "\n")
    if all("concurrency" in r for r in results["dtypes"].values()):
        plot(results, args.out / "decode.png")
    print(f"wrote {args.out / 'decode.json'}")


if __name__ == "__main__":
    main()
