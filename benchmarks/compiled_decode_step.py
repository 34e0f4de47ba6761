"""The compiled decode step of an in-process engine, timed step by step (no server, no HTTP).

Contract: builds (once, cached under --folder) `benchmarks/cpu_peer.py`'s random Qwen3 of the given size, starts
`Engine.from_bundle(folder, EngineConfig(dtype=..., compile="on", threads=...))`, and for each stream count adds that
many greedy requests (32-token prompts), steps past their prefill, then times `engine.step()` over `--steps` decode
steps; prints one line per stream count (median and best ms per step, the engine's `eager_calls`), then aborts the
requests. To compare two trees, run it alternately with PYTHONPATH set to each (figures: docs/benchmarks.md).
`--thread-governor auto` compiles the step as the thread governor needs it (inductor's dynamic threads); with
`--hold-threads` the governor is then stopped at its ceiling, so an A/B against 'off' times the kernels alone, not
the governor's reaction to the machine's load. `--quantization int8|int4` serves quantized weights.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks import cpu_peer
from inference_svc.engine import Engine, EngineConfig, SamplingParams
from inference_svc.executor.governor import ThreadGovernor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="run", help="printed at the start of every line")
    p.add_argument("--folder", type=Path, default=Path("/tmp/tandem-bench/compiled-decode-82m"))
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quantization", default="none")
    p.add_argument("--thread-governor", default="off", choices=("auto", "off"))
    p.add_argument("--hold-threads", action="store_true", help="keep the governor's count at its ceiling")
    p.add_argument("--streams", default="1,16,1,16", help="comma-separated stream counts, run in this order")
    p.add_argument("--steps", type=int, default=60, help="timed decode steps per stream count")
    args = p.parse_args()
    shape = argparse.Namespace(
        hidden=args.hidden, layers=args.layers, vocab=args.vocab, heads=None, kv_heads=None, intermediate=None
    )
    folder = cpu_peer.make_bundle(args.folder, cpu_peer.model_config(shape), 0)
    config = EngineConfig(dtype=args.dtype, compile="on", threads=args.threads, quantization=args.quantization,
                          thread_governor=args.thread_governor)  # fmt: skip
    engine = Engine.from_bundle(folder, config)
    if args.hold_threads:
        gov = engine.thread_governor
        engine.thread_governor = ThreadGovernor(gov.ceiling, gov.cpus, enabled=False)
    print(args.label, "compile_seconds", round(engine.info().compile_seconds, 1), flush=True)
    params = SamplingParams(max_new_tokens=args.steps + 16, temperature=0.0, ignore_eos=True)
    for streams in (int(s) for s in args.streams.split(",")):
        ids = [f"{args.label}-{streams}-{i}-{time.monotonic_ns()}" for i in range(streams)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, [(7 * i + j) % (args.vocab - 8) + 3 for j in range(32)], params)
        for _ in range(3):  # the prefill, then into decoding
            engine.step()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        eager = engine.runner.compiled.eager_calls if engine.runner.compiled is not None else None
        print(f"{args.label} streams={streams} median_ms={statistics.median(times):.3f} best_ms={min(times):.3f} "
              f"eager_calls={eager} threads={engine.thread_governor.active}", flush=True)  # fmt: skip
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()


if __name__ == "__main__":
    main()
