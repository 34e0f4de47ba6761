"""Decode with the decode runner against the compiled graph, two engines side by side in one process.

Both engines serve the same model with the same flags but `--decode-runner auto` and `off` (the graph for every
step); they take turns round by round (each round 3 greedy requests of 64 tokens per engine, `engine_decode.py`'s
measure, the order alternating; with `--streams N`, N requests at once instead, decode tok/s = their tokens after
the first over the decode steps' wall time), and the figure is the median of the rounds' ratios runner / graph.
Taking turns seconds apart keeps the host's memory bus, which moves by a third within minutes here
(docs/benchmarks.md §12), the same for both sides of a ratio. docs/benchmarks.md §40 and §41 have the current
figures.

    .venv/bin/python benchmarks/decode_runner_ab.py MODEL_DIR --dtype float32 [--quantization int4] [--rounds 8]
    .venv/bin/python benchmarks/decode_runner_ab.py MODEL_DIR --dtype bfloat16 --streams 64 --n-gen 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # engine_decode beside this script

from engine_decode import decode_rate

from inference_svc.engine import Engine, EngineConfig, SamplingParams

MODES = ("auto", "off")


def burst_rate(engine: Engine, streams: int, n_gen: int, tag: str) -> float:
    """Decode tok/s of `streams` greedy requests of one-token prompts run together: the tokens after each one's
    first (their prefill step's) over the wall time of the steps after that one."""
    params = SamplingParams(max_new_tokens=n_gen, temperature=0.0, ignore_eos=True)
    for j in range(streams):
        engine.add_request(f"{tag}-{j}", [3 + j], params)
    engine.step()  # every prompt's one token: the first tokens
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - t0
    if steps != n_gen - 1:
        raise RuntimeError(f"{tag}: {steps + 1} steps for {n_gen} tokens of {streams} streams")
    return streams * steps / seconds


def interleave(rates: dict[str, Callable[[str], float]], rounds: int) -> list[dict[str, float]]:
    """`rounds` rounds of each side's rate (a callable given a request tag), the order reversed every round."""
    out = []
    for i in range(rounds):
        order = list(rates) if i % 2 == 0 else list(rates)[::-1]
        out.append({mode: rates[mode](f"{mode}-{i}") for mode in order})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3, help="greedy requests per engine per round")
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--streams", type=int, default=1, help="requests decoded together (1: one at a time)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.requests < 1 or args.n_gen < 2 or args.streams < 1:
        ap.error("--rounds, --requests and --streams must be at least 1, --n-gen at least 2")
    engines = {}
    for mode in MODES:
        config = EngineConfig(dtype=args.dtype, quantization=args.quantization, threads=args.threads, compile="on",
                              device="cpu", thread_governor="off", decode_runner=mode,
                              max_num_seqs=max(64, args.streams))  # fmt: skip
        engine = Engine.from_bundle(args.model, config)
        print(f"{mode}: decode_runner={engine.load_plan.value('decode_runner')}", flush=True)
        decode_rate(engine, args.n_gen, f"warm-up-{mode}", 3)
        engines[mode] = engine

    def rate(mode: str) -> Callable[[str], float]:
        if args.streams > 1:
            return lambda tag: statistics.mean(
                burst_rate(engines[mode], args.streams, args.n_gen, f"{tag}-{j}") for j in range(args.requests)
            )
        return lambda tag: statistics.mean(
            decode_rate(engines[mode], args.n_gen, f"{tag}-{j}", 3 + j) for j in range(args.requests)
        )

    rounds = interleave({mode: rate(mode) for mode in MODES}, args.rounds)
    ratios = [r["auto"] / r["off"] for r in rounds]
    for i, (r, ratio) in enumerate(zip(rounds, ratios, strict=True)):
        print(f"round {i}: runner {r['auto']:.1f}, graph {r['off']:.1f} tok/s, ratio {ratio:.3f}", flush=True)
    print(json.dumps({"dtype": args.dtype, "quantization": args.quantization, "streams": args.streams,
                      "rounds": rounds,
                      "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                      "ratio_max": max(ratios)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
