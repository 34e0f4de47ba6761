"""Batch-1 decode of Tandem's engine in this process, with no server: llama-bench's own setting (its tg figure times
the model's steps in one process), so the two are compared kernel for kernel; `cpu_peer.py` runs it beside the
served figure, in a fresh interpreter per case.

Builds `inference_svc.engine.Engine` from a model folder with the serve flags that shape the step (dtype,
quantization, threads, compile, thread governor), and per rep generates `--n-gen` tokens after a one-token prompt
(greedy, `ignore_eos`): decode tok/s = the tokens after the first / the wall time of their `Engine.step()` calls
(each step's scheduling, sampling and detokenization included, as a server's step pays them; the first token is
the prefill's). One warm-up rep first. Prints one JSON line: {"tg": mean, "tg_samples": [...], "compiled": bool}.

    .venv/bin/python benchmarks/engine_decode.py MODEL_DIR --dtype bfloat16 --quantization int4 --threads 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from inference_svc.engine import Engine, EngineConfig, SamplingParams


def decode_rate(engine: Engine, n_gen: int, rid: str, first_token: int) -> float:
    """Tokens after the first of one greedy request, per second of the steps that made them."""
    engine.add_request(rid, [first_token], SamplingParams(max_new_tokens=n_gen, temperature=0.0, ignore_eos=True))
    engine.step()  # the prefill: the first token
    steps, seconds = 0, 0.0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        seconds += time.perf_counter() - t0
        steps += 1
    if steps != n_gen - 1:
        raise RuntimeError(f"{rid}: {steps + 1} steps for {n_gen} tokens")
    return steps / seconds


def prefill_rate(engine: Engine, n_prompt: int, rid: str, seed: int) -> float:
    """Prompt tokens per second of one greedy request of `n_prompt` random tokens (new ones per seed, so the prefix
    cache holds none of them) and one output token: the prompt over the wall time of the `Engine.step()` calls that
    made its first token (llama-bench's pp: the prompt's forward pass, timed in process)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, engine.model_config.vocab_size) for _ in range(n_prompt)]
    engine.add_request(rid, prompt, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return n_prompt / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--threads", default="auto")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--thread-governor", default="auto", choices=["auto", "off"])
    ap.add_argument("--decode-runner", default="auto", choices=["auto", "off"])
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.n_gen < 2 or args.reps < 1:
        ap.error("--n-gen must be at least 2 and --reps at least 1")
    config = EngineConfig(
        dtype=args.dtype, quantization=args.quantization, threads=args.threads, compile=args.compile, device="cpu",
        thread_governor=args.thread_governor, decode_runner=args.decode_runner,
    )  # fmt: skip
    engine = Engine.from_bundle(args.model, config)
    decode_rate(engine, args.n_gen, "warm-up", 3)
    samples = [decode_rate(engine, args.n_gen, f"rep-{i}", 3 + i) for i in range(args.reps)]
    print(json.dumps({"tg": statistics.mean(samples), "tg_samples": samples, "compiled": bool(engine.compiled)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
