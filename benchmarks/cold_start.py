"""Where a cold start's compile goes: each warm-up step of an in-process engine, timed, with torch's compile counters.

Contract: builds `Engine.from_bundle(--model, EngineConfig(dtype, compile='on', threads, compile_cache=<a fresh
temporary folder>))` with torch's inductor cache pointed at another fresh temporary folder (nothing compiled before
is found), and times each `ModelRunner.run` call of the target runner's warm-up (`engine.loader.warm_up`): its rows,
its kind (a decode-only step through the traced graph, or a chunk through the opaque one), its seconds, and how many
graphs dynamo compiled in it (`torch._dynamo.utils.counters['stats']['unique_graphs']`). Then prints torch's
cumulative compile phases (`torch._dynamo.utils.compile_times`: dynamo's trace, AOTAutograd, inductor's codegen and
the C++ compiles) and the engine's total. With `--serve-steps N`, it then times N greedy decode steps at 1 and 16
streams (median ms per step), the warm step's speed for an A/B. A measurement, not a test: figures go to
docs/benchmarks.md §26.

    PYTHONPATH=. .venv/bin/python benchmarks/cold_start.py --model DIR [--dtype bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--serve-steps", type=int, default=0, help="timed decode steps at 1 and 16 streams after start")
    p.add_argument("--speculative", default="off")
    p.add_argument(
        "--compile-cache",
        help="reuse this compile cache folder (a warm start after the first), for an A/B "
        "of the step's speed without compiling each time; default: a fresh one (a cold start)",
    )
    args = p.parse_args()
    inductor_dir = tempfile.mkdtemp(prefix="cold-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir  # before torch reads it: nothing compiled before is found
    t_import = time.perf_counter()
    import torch
    from torch._dynamo.utils import compile_times, counters

    from inference_svc.engine import Engine, EngineConfig, SamplingParams, loader
    from inference_svc.engine.model_runner import ModelRunner

    print(f"torch {torch.__version__}; imports {time.perf_counter() - t_import:.1f} s; inductor cache {inductor_dir}")
    steps: list[tuple[str, float, int]] = []
    original_run = ModelRunner.run
    original_warm_up = loader.warm_up
    warming = {"on": False}

    def timed_run(self, batch, *a, **k):
        if not warming["on"]:
            return original_run(self, batch, *a, **k)
        rows = sum(b.num_tokens for b in batch)
        kind = "decode-only" if all(b.num_tokens <= 17 for b in batch) and len(batch) > 0 else "chunk"
        before = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        out = original_run(self, batch, *a, **k)
        steps.append((f"{len(batch)} item(s), {rows} rows, {kind}", time.perf_counter() - start,
                      counters["stats"]["unique_graphs"] - before))  # fmt: skip
        return out

    def timed_warm_up(*a, **k):
        warming["on"] = True
        try:
            return original_warm_up(*a, **k)
        finally:
            warming["on"] = False

    ModelRunner.run = timed_run  # type: ignore[method-assign]
    loader.warm_up = timed_warm_up  # type: ignore[assignment]
    cache = args.compile_cache or tempfile.mkdtemp(prefix="cold-cache-")
    config = EngineConfig(dtype=args.dtype, compile="on", threads=args.threads, compile_cache=cache,
                          speculative=args.speculative)  # fmt: skip
    start = time.perf_counter()
    engine = Engine.from_bundle(args.model, config)
    total = time.perf_counter() - start
    for label, seconds, graphs in steps:
        print(f"step {label}: {seconds:.1f} s, {graphs} new graph(s)")
    print(f"engine built in {total:.1f} s; compile warm-up {engine.compile_seconds:.1f} s; "
          f"graphs {counters['stats']['unique_graphs']}; {engine.runner.compiled.precompiled}")  # fmt: skip
    print(compile_times(repr="str", aggregate=True))
    for name in ("recompiles", "graph_break"):
        if counters[name]:
            print(name, dict(counters[name]))
    if args.serve_steps:
        params = SamplingParams(max_new_tokens=args.serve_steps + 16, temperature=0.0, ignore_eos=True)
        for streams in (1, 16, 1, 16):
            ids = [f"s{streams}-{i}-{time.monotonic_ns()}" for i in range(streams)]
            for i, rid in enumerate(ids):
                engine.add_request(rid, [(7 * i + j) % 8000 + 3 for j in range(32)], params)
            for _ in range(3):
                engine.step()
            times = []
            for _ in range(args.serve_steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            med = statistics.median(times)
            print(f"streams={streams} median_ms={med * 1e3:.2f} best_ms={min(times) * 1e3:.2f} "
                  f"tok/s={streams / med:.0f} best_tok/s={streams / min(times):.0f} "
                  f"eager_calls={engine.runner.compiled.eager_calls}")  # fmt: skip
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()


if __name__ == "__main__":
    main()
