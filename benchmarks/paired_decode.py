"""Batch-1 decode (or, with `--phase prefill`, prompt processing) in process against llama-bench, in pairs taken
seconds apart, so each ratio sees one state of the machine: on a shared host whose memory bus moves by a third within
minutes (docs/benchmarks.md §12), two figures taken a minute apart differ by more than the two engines do.

For each precision (fp32 against F32, bf16 against BF16, int8 against Q8_0, int4 against Q4_0) it loads Tandem's
engine once, in an interpreter of its own (one compiled engine per process), as `benchmarks/engine_decode.py` does
(the `--compile`, `--threads` and dtype flags `cpu_peer.py` serves with, int8/int4 at bf16; the thread governor
off unless `--thread-governor auto`: see that flag), then takes `--pairs` pairs, the two sides back to back, the
order alternating pair by pair (llama-bench first in even pairs); the engine idles while llama-bench runs, and the
other way round:
- decode: `llama-bench -m GGUF -t THREADS -p 0 -n N_GEN` (its mean over its 5 repetitions) against Tandem's mean
  over `--reps` greedy requests of N_GEN tokens (`engine_decode.decode_rate`);
- prefill: `llama-bench -m GGUF -t THREADS -p N_PROMPT -n 0` against Tandem's mean over `--reps` requests of
  N_PROMPT random tokens and one output token (`engine_decode.prefill_rate`), a new prompt each, so the prefix
  cache holds none of it.
Each pair's ratio is Tandem / llama-bench; the figure is their median, with the quartiles and the fraction of pairs
at or above 1.0 beside it.

The model folder and the GGUFs are cpu_peer.py's (the same cache; made here when missing, with the same flags), as
is the llama.cpp build. Writes `<out>/paired_<phase>.json` and prints a markdown table for docs/benchmarks.md.

    .venv/bin/python benchmarks/paired_decode.py --precisions fp32,int4 --pairs 8 --out results/paired
    .venv/bin/python benchmarks/paired_decode.py --phase prefill --precisions fp32 --pairs 8 --out results/paired
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_peer  # the sibling benchmark modules (benchmarks/ is not a package)
import engine_decode
import llama_cpp

from inference_svc.engine import Engine, EngineConfig


def engine_flags(precision: str) -> tuple[str, str]:
    """(dtype, quantization) of the Tandem engine that meets this precision's GGUF (cpu_peer.py's pairing)."""
    if precision not in cpu_peer.PAIRS:
        raise ValueError(f"unknown precision {precision!r}: expected one of {', '.join(cpu_peer.PAIRS)}")
    if precision in ("int8", "int4"):
        return "bfloat16", precision
    return {"fp32": "float32", "bf16": "bfloat16"}[precision], "none"


def tandem_first(pair: int) -> bool:
    """Whether Tandem runs first in this pair (odd pairs), so neither side always follows the other."""
    return pair % 2 == 1


def summary(ratios: list[float]) -> dict[str, float]:
    """The pairs' median ratio, its quartiles and the share of pairs at or above 1.0."""
    if not ratios:
        raise ValueError("no pairs to summarise")
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"median": median, "q1": q1, "q3": q3, "min": min(ratios), "max": max(ratios),
            "at_least_1": sum(r >= 1.0 for r in ratios) / len(ratios)}  # fmt: skip


def tandem_side(engine: Engine, phase: str, n_gen: int, n_prompt: int) -> Callable[[str, int], float]:
    """`ours(request_id, rep)`: the engine's tok/s over one request of the phase: `decode_rate`'s (first token 3 +
    rep) or `prefill_rate`'s (a new random prompt at every call)."""
    if phase == "decode":
        return lambda rid, rep: engine_decode.decode_rate(engine, n_gen, rid, 3 + rep)
    if phase != "prefill":
        raise ValueError(f"unknown phase {phase!r}: expected decode or prefill")
    seeds = itertools.count()
    return lambda rid, rep: engine_decode.prefill_rate(engine, n_prompt, rid, next(seeds))


def run_pairs(
    ours: Callable[[str, int], float], peer: Callable[[], float], pairs: int, reps: int
) -> list[dict[str, Any]]:
    """`pairs` pairs of `peer()` (the peer's tok/s) and the mean of `reps` calls of `ours(request_id, rep)` (the
    engine's tok/s), back to back in `tandem_first`'s order; each with its ratio Tandem / peer."""
    out = []
    for i in range(pairs):
        sides: dict[str, float] = {}
        for side in ("tandem", "llama") if tandem_first(i) else ("llama", "tandem"):
            if side == "llama":
                sides[side] = peer()
            else:
                sides[side] = statistics.mean(ours(f"p{i}-{r}", r) for r in range(reps))
        out.append({**sides, "ratio": sides["tandem"] / sides["llama"], "tandem_first": tandem_first(i)})
        cpu_peer.log(f"  pair {i}: llama-bench {sides['llama']:.1f}, Tandem {sides['tandem']:.1f} tok/s, "
                     f"ratio {out[-1]['ratio']:.2f}")  # fmt: skip
    return out


def run_precision(precision: str, args: argparse.Namespace, bundle: Path, gguf: Path, tools) -> dict[str, Any]:
    dtype, quant = engine_flags(precision)
    config = EngineConfig(dtype=dtype, quantization=quant, threads=str(args.threads), compile=args.compile,
                          device="cpu", thread_governor=args.thread_governor,
                          decode_runner=args.decode_runner)  # fmt: skip
    t0 = time.monotonic()
    engine = Engine.from_bundle(bundle, config)
    ours = tandem_side(engine, args.phase, args.n_gen, args.n_prompt)
    ours("warm-up", 0)
    cpu_peer.log(f"{precision}: engine ready in {time.monotonic() - t0:.0f} s (compiled: {bool(engine.compiled)})")
    n_prompt, n_gen = (args.n_prompt, 0) if args.phase == "prefill" else (0, args.n_gen)
    kind = "pp" if args.phase == "prefill" else "tg"

    def llama_bench() -> float:
        return llama_cpp.bench(tools, gguf, args.threads, n_prompt, n_gen, args.bench_timeout)[kind]

    pairs = run_pairs(ours, llama_bench, args.pairs, args.reps)
    return {"precision": precision, "gguf": gguf.name, "dtype": dtype, "quantization": quant,
            "compiled": bool(engine.compiled), "pairs": pairs, **summary([p["ratio"] for p in pairs])}  # fmt: skip


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Paired batch-1 {results['phase']}, {results['date']}, {results['machine']['model']} "
        f"({results['machine']['cores']} cores, {cpu_peer.flags_line(results['machine'])}), "
        f"commit {results['commit']}, {results['threads']} threads, "
        f"Tandem's thread governor {results['thread_governor']}, decode runner {results['decode_runner']}, "
        f"{results['measure']}:",
        "",
        "| precision (Tandem / GGUF) | pairs | llama-bench tok/s (median) | Tandem tok/s (median) | ratio median | "
        "quartiles | pairs ≥ 1.0 |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for c in results["cases"]:
        llama = statistics.median(p["llama"] for p in c["pairs"])
        tandem = statistics.median(p["tandem"] for p in c["pairs"])
        lines.append(f"| {c['precision']} / {c['gguf'].removeprefix('model-').removesuffix('.gguf')} | "
                     f"{len(c['pairs'])} | {llama:.1f} | {tandem:.1f} | **{c['median']:.2f}** | "
                     f"{c['q1']:.2f}-{c['q3']:.2f} | {c['at_least_1']:.0%} |")  # fmt: skip
    lines += ["", f"Command: `{results['command']}`"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=cpu_peer.REPO / "results" / "paired_decode")
    p.add_argument(
        "--precisions", default="fp32,bf16,int8,int4", help=f"comma-separated, of {','.join(cpu_peer.PAIRS)}"
    )
    p.add_argument("--pairs", type=int, default=8, help="pairs per precision")
    p.add_argument("--threads", type=int, default=2, help="threads of both engines")
    p.add_argument("--compile", default="on", choices=["auto", "on", "off"], help="Tandem's --compile")
    p.add_argument("--thread-governor", default="off", choices=["auto", "off"],
                   help="Tandem's --thread-governor: off by default, as the peer's own run just before would count as "
                   "another process's load at the engine's first poll (it polls at its steps only here)")  # fmt: skip
    p.add_argument("--decode-runner", default="auto", choices=["auto", "off"],
                   help="Tandem's --decode-runner (off: the compiled graph runs every step)")  # fmt: skip
    p.add_argument("--phase", default="decode", choices=["decode", "prefill"],
                   help="decode: llama-bench's tg (N_GEN tokens after one); prefill: its pp (N_PROMPT)")  # fmt: skip
    p.add_argument("--n-prompt", type=int, default=512, help="prompt tokens of --phase prefill (llama-bench -p)")
    p.add_argument("--reps", type=int, default=3, help="Tandem requests per pair (llama-bench: its own 5)")
    p.add_argument("--n-gen", type=int, default=64, help="generated tokens (llama-bench -n)")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-cpp-version", default=llama_cpp.VERSION)
    p.add_argument("--bench-timeout", type=float, default=600.0, help="seconds one llama-bench call may take")
    p.add_argument("--no-install", action="store_true", help="fail instead of pip-installing converter deps")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one precision, run by main in a child
    args = p.parse_args(argv)
    args.precision_list = [s.strip() for s in args.precisions.split(",") if s.strip()]
    for precision in [*args.precision_list, *([args.case] if args.case else [])]:
        try:
            engine_flags(precision)
        except ValueError as exc:
            p.error(str(exc))
    if args.pairs < 1 or args.reps < 1 or args.n_gen < 2 or args.threads < 1 or args.n_prompt < 1:
        p.error("--pairs, --reps, --threads and --n-prompt must be at least 1, --n-gen at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tools = llama_cpp.ensure_tools(args.llama_cpp_version, log=lambda m, **_: cpu_peer.log(m))
    llama_cpp.ensure_converter(tools.source, not args.no_install)
    config = cpu_peer.model_config(args)
    folder = cpu_peer.model_dir(config, args.seed)
    bundle = cpu_peer.make_bundle(folder / "hf", config, args.seed)
    ggufs, _ = cpu_peer.make_ggufs(tools, bundle, folder / f"gguf-{tools.version}", args.threads)
    if args.case is not None:  # one precision in this interpreter (a compiled engine per process): a JSON line
        print(json.dumps(run_precision(args.case, args, bundle, ggufs[cpu_peer.PAIRS[args.case]], tools)))
        return 0
    results: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv] if argv is None else [__file__, *argv]),
        "machine": cpu_peer.cpu_summary(), "commit": cpu_peer.git_commit(cpu_peer.REPO), "threads": args.threads,
        "phase": args.phase, "measure": f"pp{args.n_prompt}" if args.phase == "prefill" else f"tg{args.n_gen}",
        "n_gen": args.n_gen, "n_prompt": args.n_prompt, "reps": args.reps, "thread_governor": args.thread_governor,
        "decode_runner": args.decode_runner, "model": str(bundle),
        "cases": [],
    }  # fmt: skip
    for precision in args.precision_list:  # each in a fresh interpreter
        child = [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv), "--case", precision]
        done = subprocess.run(child, stdout=subprocess.PIPE, text=True, timeout=args.pairs * 3 * args.bench_timeout)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        print("\n".join(ln for ln in done.stdout.splitlines() if not ln.startswith("{")), flush=True)
        if done.returncode != 0 or not lines:
            print(f"error: {precision}: the case exited {done.returncode}", file=sys.stderr)
            return 1
        results["cases"].append(json.loads(lines[-1]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"paired_{args.phase}.json").write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
