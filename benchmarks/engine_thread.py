"""Engine decode speed by where the model was loaded: on the stepping thread, or on another thread that stays alive.

Why it matters: torch's CPU ops run on OpenMP (libgomp), which keeps a pool of workers for every thread that ran a
parallel region. With two pools alive, workers outnumber the CPUs and libgomp stops letting idle workers spin,
so every parallel region of a step waits for sleeping workers. A server that loaded its model on the event loop's
executor thread and stepped it on its engine thread decoded at about half speed (`inference_svc/engine_thread.py`).

Each case runs in a fresh subprocess (pools live as long as their thread), in interleaved rounds:
- `one-thread`: `Engine.from_bundle` and the decode loop on one non-main thread (what `tandem serve` does);
- `loaded-elsewhere`: the engine built on a `ThreadPoolExecutor` thread that stays alive, then stepped on another
  thread (what `tandem serve` did before).
Each case decodes `--requests` batch-1 requests of `--tokens` sampled tokens (temperature 0.8, top-p 0.95) after a
one-token prompt and reports the engine's decode tok/s (1 / mean gap between steps); the table gives the median
over requests and rounds and the ratio one-thread / loaded-elsewhere. The model is `benchmarks/cpu_peer.py`'s
random Qwen3 (82M by default; cached), so the figures sit beside that benchmark's.

    .venv/bin/python benchmarks/engine_thread.py --precision int8 --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_peer  # the sibling benchmark: its model and bundle cache

REPO = Path(__file__).resolve().parents[1]
CASES = ("one-thread", "loaded-elsewhere")


def _decode_rates(engine, requests: int, tokens: int, vocab: int) -> list[float]:
    import random
    import time

    from inference_svc.engine import SamplingParams

    rng = random.Random(0)
    rates = []
    for r in range(requests + 1):  # the first request warms up and is not counted
        sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True, temperature=0.8, top_p=0.95, seed=r)
        engine.add_request(f"r{r}", [rng.randrange(3, vocab)], sampling)
        stamps = []
        while engine.has_unfinished_requests():
            engine.step()
            stamps.append(time.perf_counter())
        gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]  # decode steps only (not prefill)
        if r:
            rates.append(1 / statistics.mean(gaps))
    return rates


def run_case(case: str, bundle: str, args: argparse.Namespace) -> list[float]:
    """In this process (a fresh one per case): load and step as `case` says; decode tok/s per request."""
    import concurrent.futures

    from inference_svc.engine import Engine, EngineConfig

    dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(args.precision, "bfloat16")
    quant = args.precision if args.precision in ("int8", "int4") else "none"
    config = EngineConfig(dtype=dtype, quantization=quant, compile=args.compile, threads=args.threads, device="cpu")
    out: dict[str, list[float]] = {}
    if case == "one-thread":

        def both() -> None:
            engine = Engine.from_bundle(bundle, config)
            out["rates"] = _decode_rates(engine, args.requests, args.tokens, engine.model_config.vocab_size)

        worker = threading.Thread(target=both)
        worker.start()
        worker.join()
    else:
        loader = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # alive until this process ends
        engine = loader.submit(Engine.from_bundle, bundle, config).result()

        def step() -> None:
            out["rates"] = _decode_rates(engine, args.requests, args.tokens, engine.model_config.vocab_size)

        worker = threading.Thread(target=step)
        worker.start()
        worker.join()
    return out["rates"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="int8", choices=list(cpu_peer.PAIRS))
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (EngineConfig.threads)")
    p.add_argument("--compile", default="on", choices=["auto", "on", "off"])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both cases")
    p.add_argument("--requests", type=int, default=3, help="requests per case and round")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--quick", action="store_true", help="cpu_peer's small model (hidden 256, 4 layers)")
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # internal: run one case, print JSON
    p.add_argument("--bundle", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.bundle, args)))
        return 0
    peer = cpu_peer.parse_args(["--quick"] if args.quick else [])
    model = cpu_peer.model_config(peer)
    bundle = cpu_peer.make_bundle(cpu_peer.model_dir(model, peer.seed) / "hf", model, peer.seed)
    rates: dict[str, list[float]] = {c: [] for c in CASES}
    own = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--quick"]
    for r in range(args.rounds):
        for case in CASES:
            cmd = [sys.executable, __file__, *own, "--case", case, "--bundle", str(bundle)]
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            got = json.loads(done.stdout.strip().splitlines()[-1])
            rates[case] += got
            print(f"round {r + 1} {case}: " + ", ".join(f"{x:.1f}" for x in got) + " tok/s", flush=True)
    med = {c: statistics.median(v) for c, v in rates.items()}
    print(f"\n{args.precision}, {args.threads} threads, --compile {args.compile}, {model.num_layers} layers "
          f"x hidden {model.hidden_size}: median decode tok/s")  # fmt: skip
    print("| one thread (tandem serve now) | loaded on another live thread (before) | ratio |")
    print("|--:|--:|--:|")
    one, elsewhere = med["one-thread"], med["loaded-elsewhere"]
    print(f"| {one:.1f} | {elsewhere:.1f} | {one / elsewhere:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
