"""CPU peer benchmark: Tandem's served batch-1 decode against llama.cpp's `llama-bench` on the same weights, same run.

What it does, in one run:
1. builds (once, cached under `~/.cache/tandem/llama.cpp/<version>/`, see `benchmarks/llama_cpp.py`) llama.cpp's
   `llama-bench` and `llama-quantize` from the llama-cpp-python source release on PyPI, and prints the build time
   (without AMX unless `--llama-amx`: this version's AMX int8 kernels die with SIGILL on the machines we have);
2. makes a random Qwen3 folder (default hidden 768, 12 layers, 12 heads / 4 KV heads of 64, MLP 2048, vocab 8192,
   tied embeddings: about 82M parameters; `--quick`: hidden 256, 4 layers, vocab 2048) with a BPE tokenizer trained
   on the corpus, and converts it with the sdist's own `convert_hf_to_gguf.py` to F32 and BF16 GGUF, then with
   `llama-quantize` (from F32) to Q8_0 and Q4_0. A random tokenizer is unknown to the converter's pre-tokenizer
   table: it is mapped to llama.cpp's "default" pre-tokenizer (speed does not depend on it) and the output says so.
   The converter runs in its own venv beside the build, which reads this interpreter's torch; what it lacks
   (sentencepiece, ...) is pip-installed there first, with a message (`--no-install`: fail instead), never here.
   Model and GGUF files are cached in `~/.cache/tandem/cpu_peer/<model>/`;
3. measures the machine's memory read bandwidth (torch: sum over a 1 GiB fp32 tensor, best of 7) per thread count;
4. for each precision pair fp32↔F32, bf16↔BF16, int8↔Q8_0, int4↔Q4_0 and each `--threads` count:
   - llama.cpp: `llama-bench -m FILE -t THREADS -p 512 -n 64 -o json` (tg64 and pp512, its mean over 5 reps);
   - Tandem: `python -m shared_model.cli serve --model DIR --port P --no-metrics --device cpu --dtype D
     [--quantization int8|int4] [--threads N]` as a subprocess on a free loopback port; after a warm-up, `--reps`
     streamed batch-1 requests (1-token prompt, max_new_tokens 64, ignore_eos, temperature 0.8, top_p 0.95, a seed
     per rep): decode tok/s = tokens after the first / (arrival of the last - arrival of the first), the first
     token being prefill; and `--reps` requests with a fresh random 512-token id prompt (max_new_tokens 1):
     prefill tok/s = 512 / client-side time to first token. Means over reps, like llama-bench's;
   - Tandem in-process (`--in-process`, the default): the same flags' engine with no server
     (`benchmarks/engine_decode.py` in a fresh interpreter, `--reps` greedy requests after a warm-up): llama-bench
     times its steps in one process too, so this ratio compares the two step for step, the served one adds what
     a server costs (gRPC, the stream, the client on the same cores);
   - ratios Tandem / llama.cpp for tg and pp, and each side's decode as GB/s of weight bytes read per token
     (llama.cpp: the GGUF's tensor bytes less the token embedding unless it doubles as the LM head; Tandem:
     computed from the config and shared_model/quantize.py's formats, the embedding gather left out, the LM head
     counted), also as a share of the measured bandwidth.
   A precision whose server flag the server rejects (exit 2, "unrecognized arguments" or "invalid choice") is
   reported as "not offered". A server without `--threads` gets its thread count through OMP_NUM_THREADS instead,
   and the output says so. Servers are always terminated; every step has a bounded timeout.
   Before each case the share of the CPUs busy with other work is sampled (1 s, nothing of ours running) and
   reported; `--quiet-wait S` waits up to S seconds for it to fall below `--quiet-below` (default 10%). On a small
   shared machine other work distorts the multi-thread figures most (llama.cpp's threads spin at barriers).
Writes `<out>/cpu_peer.json` and `<out>/cpu_peer.png` (bar chart; skipped with a message without matplotlib) and
prints a markdown table for docs/benchmarks.md with the date, CPU flags and the exact command. Random weights: only
speed means anything here. Exit status 1 when a step failed (the JSON still holds what was measured).

    .venv/bin/python benchmarks/cpu_peer.py --out results/cpu_peer [--threads 1,2] [--hidden 768 --layers 12]
    .venv/bin/python benchmarks/cpu_peer.py --quick --out results/cpu_peer_quick      # small model, smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(REPO))
import llama_cpp  # noqa: E402 - the sibling helper module (benchmarks/ is not a package)

from inference_svc.serve_process import ServeExited, ServeProcess  # noqa: E402 - this checkout's, after the path

PAIRS = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}  # Tandem precision -> GGUF type
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


class NotOffered(Exception):
    """The server rejects the flag this precision needs."""


def log(msg: str) -> None:
    print(msg, flush=True)


def cpu_summary() -> dict[str, Any]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
    return {
        "model": model or platform.processor(),
        "cores": os.cpu_count(),
        "flags": {f: f in flags for f in CPU_FLAGS},
        "amx": all(f in flags for f in ("amx_tile", "amx_bf16", "amx_int8")),
    }


def flags_line(cpu: dict[str, Any]) -> str:
    f = cpu["flags"]
    shown = ["avx512f", "avx512_bf16", "avx512_vnni"]
    parts = [f"{name} {'yes' if f[name] else 'no'}" for name in shown]
    parts.append(f"amx {'yes' if cpu['amx'] else 'no'}")
    return ", ".join(parts)


def background_busy(seconds: float = 1.0) -> float:
    """Share of all CPUs busy over `seconds` while this benchmark runs nothing: other work on the machine."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        (t0, i0), _, (t1, i1) = sample(), time.sleep(seconds), sample()
    except (OSError, ValueError, IndexError):
        return float("nan")
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(max_wait_s: float, below: float) -> float:
    """Wait up to `max_wait_s` for other work to use less than `below` of the CPUs; the last reading."""
    deadline = time.monotonic() + max_wait_s
    busy = background_busy()
    while busy >= below and time.monotonic() < deadline:
        busy = background_busy(2.0)
    return busy


def memory_bandwidth(threads: int, gib: float = 1.0, reps: int = 7) -> float:
    """GB/s (1e9) of the best of `reps` sums over a `gib` GiB fp32 tensor with `threads` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
        x.sum()  # pages touched, threads started
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t)
        return x.numel() * 4 / min(times) / 1e9
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------ model + GGUF
def model_config(args: argparse.Namespace):
    from shared_model.config import ModelConfig

    heads = args.heads or max(1, args.hidden // 64)
    kv = args.kv_heads or next(k for k in (heads // 3, heads // 2, heads, 1) if k >= 1 and heads % k == 0)
    inter = args.intermediate or max(256, round(args.hidden * 8 / 3 / 256) * 256)
    return ModelConfig(
        model_type="qwen3", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=heads, num_kv_heads=kv, head_dim=64, intermediate_size=inter, rope_theta=10000.0,
        tie_word_embeddings=True, qk_norm=True, max_position_embeddings=4096,
    )  # fmt: skip


def param_count(config) -> int:
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * config.head_dim
    return config.num_layers * per_layer + v * h * (1 if config.tie_word_embeddings else 2) + h


def model_dir(config, seed: int) -> Path:
    key = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str) + f"seed={seed}"
    name = f"qwen3-h{config.hidden_size}-l{config.num_layers}-v{config.vocab_size}-"
    return llama_cpp.cache_root().parent / "cpu_peer" / (name + hashlib.sha256(key.encode()).hexdigest()[:10])


def make_bundle(folder: Path, config, seed: int) -> Path:
    from shared_model.bundle import save_bundle
    from shared_model.corpus import CorpusConfig, load_corpus
    from shared_model.model import build_model
    from shared_model.tokenizer import Tokenizer

    if (folder / "config.json").is_file():
        return folder
    tok = Tokenizer.train(load_corpus(CorpusConfig(max_documents=200)).texts(), vocab_size=config.vocab_size)
    return save_bundle(folder, config, build_model(config, seed=seed), tokenizer=tok)


def make_ggufs(tools: llama_cpp.Tools, hf: Path, folder: Path, threads: int) -> tuple[dict[str, Path], bool]:
    """{GGUF type: file} for F32, BF16 (converted), Q8_0, Q4_0 (quantized from F32); and whether the pre-tokenizer
    had to be mapped to llama.cpp's default."""
    folder.mkdir(parents=True, exist_ok=True)
    note_file, log_file = folder / "convert.json", folder / "convert.log"
    note = json.loads(note_file.read_text()) if note_file.is_file() else {}
    files = {t: folder / f"model-{t}.gguf" for t in PAIRS.values()}
    for gtype, outtype in (("F32", "f32"), ("BF16", "bf16")):
        if not files[gtype].is_file():
            t0 = time.monotonic()
            mapped = llama_cpp.convert_to_gguf(tools.source, hf, files[gtype], outtype, log_file)
            note["pre_tokenizer_mapped"] = note.get("pre_tokenizer_mapped", False) or mapped
            note_file.write_text(json.dumps(note) + "\n")
            log(f"  converted to {gtype} in {time.monotonic() - t0:.0f} s: {files[gtype]}")
    for gtype in ("Q8_0", "Q4_0"):
        if not files[gtype].is_file():
            t0 = time.monotonic()
            llama_cpp.quantize(tools, files["F32"], files[gtype], gtype, threads, log_file)
            log(f"  quantized F32 -> {gtype} in {time.monotonic() - t0:.0f} s: {files[gtype]}")
    return files, bool(note.get("pre_tokenizer_mapped", False))


def gguf_read_bytes(source: Path, path: Path) -> dict[str, Any]:
    """Tensor bytes of a GGUF and the bytes one decoded token reads: all tensors but the token embedding, which
    counts only when there is no separate output.weight (tied: it is the LM head)."""
    code = (
        "import gguf, json, sys\n"
        "r = gguf.GGUFReader(sys.argv[1])\n"
        "print(json.dumps({t.name: [int(t.n_bytes), t.tensor_type.name] for t in r.tensors}))\n"
    )
    cmd = [str(llama_cpp.converter_python(source)), "-c", code, str(path)]
    proc = subprocess.run(cmd, env=llama_cpp.converter_env(source), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise llama_cpp.StepError(f"reading {path.name} with gguf-py failed: {proc.stderr.strip().splitlines()[-1:]}")
    tensors = json.loads(proc.stdout)
    total = sum(b for b, _ in tensors.values())
    embd, embd_type = tensors.get("token_embd.weight", [0, ""])
    tied = "output.weight" not in tensors
    return {
        "file_bytes": path.stat().st_size,
        "tensor_bytes": total,
        "token_embd_bytes": embd,
        "token_embd_type": embd_type,
        "tied": tied,
        "read_per_token": total if tied else total - embd,
    }


# ------------------------------------------------------------------------------------------------ Tandem server
class Server:
    """`tandem serve` as a subprocess on a free loopback port (`inference_svc.serve_process`), run from this
    checkout (`REPO`); `close()` always ends it."""

    def __init__(
        self, bundle: Path, dtype: str, quant: str | None, threads: int, threads_flag: bool, log_path: Path,
        compile_mode: str | None = None, extra_flags: Sequence[str] = (), tree: Path = REPO,
    ) -> None:  # fmt: skip
        flags = ["--no-metrics", "--no-http", "--device", "cpu", "--dtype", dtype, "--log-level", "WARNING"]
        if quant:
            flags += ["--quantization", quant]
        if compile_mode:
            flags += ["--compile", compile_mode]
        env = {"PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
        if threads_flag:
            flags += ["--threads", str(threads)]
        else:
            env["OMP_NUM_THREADS"] = str(threads)
        self.log_path = log_path
        self.process = ServeProcess(bundle, [*flags, *extra_flags], log=log_path, env=env, cwd=tree)
        self.cmd, self.target = self.process.cmd, self.process.target

    def wait_serving(self, timeout_s: float) -> None:
        try:
            self.process.wait_serving(timeout_s)
        except ServeExited as exc:
            text = self.log_path.read_text(errors="replace")
            words = ("unrecognized arguments", "invalid choice")
            bad = next((ln for ln in text.splitlines() if any(w in ln for w in words)), None)
            if exc.code == 2 and bad is not None:
                raise NotOffered(bad.split("error:", 1)[-1].strip()) from exc
            raise llama_cpp.StepError(str(exc)) from exc
        except TimeoutError as exc:
            why = f"server did not report SERVING within {timeout_s:.0f} s; log {self.log_path}"
            raise llama_cpp.StepError(why) from exc

    def close(self) -> None:
        self.process.stop(30)


def _stream(client, prompt: list[int], max_new: int, seed: int, timeout_s: float) -> tuple[float, list[tuple]]:
    """(start time, [(arrival time, tokens in the message, the message)]) of one streamed request."""
    arrivals: list[tuple] = []
    t0 = time.perf_counter()
    stream = client.generate_stream(
        prompt, timeout=timeout_s, max_new_tokens=max_new, ignore_eos=True, temperature=0.8, top_p=0.95, seed=seed
    )
    for msg in stream:
        if msg.token_ids:
            arrivals.append((time.perf_counter(), len(msg.token_ids), msg))
        elif msg.usage is not None:
            arrivals.append((time.perf_counter(), 0, msg))
    return t0, arrivals


def tandem_decode(client, vocab: int, n_gen: int, seed: int, timeout_s: float, rng: random.Random) -> float:
    _, arr = _stream(client, [rng.randrange(3, vocab)], n_gen, seed, timeout_s)
    counted = [a for a in arr if a[1]]
    total = sum(a[1] for a in counted)
    if total != n_gen or len(counted) < 2:
        raise llama_cpp.StepError(f"decode request returned {total} tokens in {len(counted)} messages, not {n_gen}")
    return (total - counted[0][1]) / (counted[-1][0] - counted[0][0])


def tandem_prefill(client, vocab: int, n_prompt: int, seed: int, timeout_s: float, rng: random.Random) -> dict:
    prompt = [rng.randrange(3, vocab) for _ in range(n_prompt)]
    t0, arr = _stream(client, prompt, 1, seed, timeout_s)
    first = next(a for a in arr if a[1])
    last = arr[-1][2]
    return {
        "tok_s": n_prompt / (first[0] - t0),
        "server_ttft_ms": last.timing.ttft_ms if last.timing is not None else float("nan"),
        "cached_prompt_tokens": last.usage.cached_prompt_tokens if last.usage is not None else 0,
    }


def tandem_read_bytes(config, quant: str | None, dtype: str, group: int = 64) -> int:
    """Weight bytes one decoded token reads in Tandem: the weights as served (the ledger's formula,
    `shared_model.ledger.served_weight_bytes`, which the test suite checks against the loaded tensors) less the
    token embedding, of which a step gathers one row, unless the embedding is also the LM head (tied and dense)."""
    from shared_model.ledger import element_bytes, served_weight_bytes

    served = served_weight_bytes(config, dtype, quant or "none", group)
    embedding_is_head = config.tie_word_embeddings and quant is None
    return served - (0 if embedding_is_head else config.vocab_size * config.hidden_size * element_bytes(dtype))


def tandem_case(
    bundle: Path,
    config,
    precision: str,
    threads: int,
    args,
    state: dict,
    out_dir: Path,
    compile_mode: str | None,
    tree: Path = REPO,
    label: str = "",
) -> dict:
    from inference_svc.client import NO_RETRY, TandemClient

    dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(precision, args.quant_dtype)
    quant = precision if precision in ("int8", "int4") else None
    log_path = out_dir / "servers" / f"{label}{precision}-t{threads}-compile-{compile_mode or 'default'}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = None
    try:
        for _ in range(2):  # a second try without --threads when the server lacks it
            server = Server(bundle, dtype, quant, threads, state["threads_flag"], log_path, compile_mode, tree=tree)
            try:
                server.wait_serving(args.server_timeout)
                break
            except NotOffered as exc:
                server.close()
                server = None
                if "--threads" in str(exc) and state["threads_flag"]:
                    state["threads_flag"] = False
                    log("  server has no --threads: its thread count goes through OMP_NUM_THREADS instead")
                    if "--quantization" not in str(exc):
                        continue
                raise
        assert server is not None
        rng = random.Random(args.seed + threads)
        with TandemClient(server.target, retry=NO_RETRY, timeout=args.request_timeout) as c:
            info = c.model_info()
            vocab = info.config.vocab_size
            timeout = args.request_timeout
            tandem_decode(c, vocab, args.n_gen, args.seed, timeout, rng)  # warm-up
            tandem_prefill(c, vocab, args.n_prompt, args.seed, timeout, rng)  # warm-up
            tg = [tandem_decode(c, vocab, args.n_gen, args.seed + r, timeout, rng) for r in range(args.reps)]
            pps = [tandem_prefill(c, vocab, args.n_prompt, args.seed + r, timeout, rng) for r in range(args.reps)]
        return {
            "status": "ok",
            "server_command": shlex.join(server.cmd),
            "threads_via": "--threads" if state["threads_flag"] else "OMP_NUM_THREADS",
            "dtype": info.dtype,
            "quantization": quant or "none",
            "compile": compile_mode,
            "compiled": bool(getattr(info, "compiled", False)),
            "compile_seconds": float(getattr(info, "compile_seconds", 0.0)),
            "tg": statistics.mean(tg),
            "tg_stddev": statistics.stdev(tg) if len(tg) > 1 else 0.0,
            "tg_samples": tg,
            "pp": statistics.mean(p["tok_s"] for p in pps),
            "pp_stddev": statistics.stdev(p["tok_s"] for p in pps) if len(pps) > 1 else 0.0,
            "pp_samples": [p["tok_s"] for p in pps],
            "pp_server_ttft_ms": [p["server_ttft_ms"] for p in pps],
            "pp_cached_prompt_tokens": max(p["cached_prompt_tokens"] for p in pps),
            "ledger_weight_bytes": int(info.ledger.weight_bytes),
            "read_per_token": tandem_read_bytes(config, quant, info.dtype),
        }
    except NotOffered as exc:
        return {"status": "not offered", "reason": str(exc)}
    finally:
        if server is not None:
            server.close()


def in_process_tg(
    bundle: Path, precision: str, threads: int, args, compile_mode: str | None, tree: Path = REPO
) -> dict:
    """Tandem's batch-1 decode with no server (`benchmarks/engine_decode.py` in a fresh interpreter, `tree`'s code,
    the served case's flags): llama-bench's own setting, so the ratio compares the two step for step."""
    dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(precision, args.quant_dtype)
    quant = precision if precision in ("int8", "int4") else "none"
    cmd = [sys.executable, str(tree / "benchmarks" / "engine_decode.py"), str(bundle), "--dtype", dtype,
           "--quantization", quant, "--threads", str(threads), "--compile", compile_mode or "auto",
           "--n-gen", str(args.n_gen), "--reps", str(args.reps)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.server_timeout + 600, env=env, cwd=tree)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"engine_decode.py did not finish in {args.server_timeout + 600:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"status": "error", "error": f"engine_decode.py exited {done.returncode}: {tail[0]}"}
    return {"status": "ok", "command": shlex.join(cmd), **json.loads(lines[-1])}


# ------------------------------------------------------------------------------------------------ report
def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    m = results["model"]
    tg, pp = f"tg{results['n_gen']}", f"pp{results['n_prompt']}"
    modes = results.get("compile_modes", [])
    first, others = (f" (--compile {modes[0]})" if modes else ""), modes[1:]
    lines = [
        f"CPU peer benchmark, {results['date']}: {results['machine']['model']}, {results['machine']['cores']} cores "
        f"({flags_line(results['machine'])}); llama.cpp from llama-cpp-python {results['llama_cpp']['version']} "
        f"(`{results['llama_cpp']['build_commit']}`), GGML_NATIVE=ON.",
        f"Model: random Qwen3, hidden {m['hidden_size']}, {m['num_layers']} layers, vocab {m['vocab_size']}, tied "
        f"embeddings, {m['params'] / 1e6:.1f}M parameters. Memory read bandwidth (torch sum over 1 GiB fp32, best of "
        "7): " + ", ".join(f"{v:.1f} GB/s ({t}T)" for t, v in results["bandwidth_gbs"].items()) + ".",
        f"Command: `{results['command']}`",
        "",
        f"| precision (Tandem / GGUF) | threads | {tg} llama.cpp | {tg} Tandem{first} | tg ratio | {tg} Tandem "
        f"in-process | in-process ratio | {pp} llama.cpp | {pp} Tandem | pp ratio | decode GB/s llama.cpp "
        "| decode GB/s Tandem |" + "".join(f" {tg} Tandem --compile {mode} | tg ratio |" for mode in others),
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|" + "--:|--:|" * len(others),
    ]
    for c in results["cases"]:
        lc, td = c["llama_cpp"], c["tandem"]
        bw = results["bandwidth_gbs"][str(c["threads"])]
        name = f"{c['precision']} / {c['gguf_type']}"
        lgbs = f"{lc['tg_gbs']:.1f} ({lc['tg_gbs'] / bw:.0%})" if "tg_gbs" in lc else "–"
        if td.get("status") != "ok":
            status = td.get("status", "error")
            lines.append(
                f"| {name} | {c['threads']} | {fmt(lc.get('tg'))} | {status} | – | – | – | {fmt(lc.get('pp'))} "
                f"| {status} | – | {lgbs} | – |" + _other_compile_cells(c, others)
            )
            continue
        tgbs = f"{td['tg_gbs']:.1f} ({td['tg_gbs'] / bw:.0%})"
        lines.append(
            f"| {name} | {c['threads']} | {fmt(lc.get('tg'))} | {fmt(td['tg'])} | {fmt(c['ratio'].get('tg'), 2)} "
            f"| {fmt(td.get('tg_in_process'))} | {fmt(c['ratio'].get('tg_in_process'), 2)} "
            f"| {fmt(lc.get('pp'))} | {fmt(td['pp'])} | {fmt(c['ratio'].get('pp'), 2)} | {lgbs} | {tgbs} |"
            + _other_compile_cells(c, others)
        )
    lines += [
        "",
        f"tok/s, means over reps (llama-bench: its 5 reps after its warm-up; Tandem: {results['reps']} streamed "
        f"requests after a warm-up, {tg} = tokens after the first / their arrival span, {pp} = prompt tokens / "
        "client-side time to first token, gRPC and the first sampling included; in-process: the same flags' "
        "engine with no server, `benchmarks/engine_decode.py`, llama-bench's own setting). Ratio = Tandem / llama.cpp. "
        f"Tandem int8/int4 run with --dtype {results['quant_dtype']}. Decode GB/s = weight bytes read per token × "
        f"{tg} tok/s (share of the measured bandwidth in brackets); {results['weight_bytes_estimate']}",
    ]
    lines += [f"Note: {n}" for n in results["notes"]]
    if results.get("baseline") or results.get("rounds", 1) > 1:
        lines += ["", *rounds_table(results)]
    return "\n".join(lines)


def rounds_table(results: dict[str, Any]) -> list[str]:
    """The ratios of every round, this checkout's and the baseline's side by side: their spread across rounds is
    the run-to-run noise, and a change counts only beyond it."""
    base = results.get("baseline")
    head = f"this checkout ({results.get('commit', '?')})"
    title = f"Ratios to llama.cpp per round ({results['rounds']} rounds, llama-bench rerun each round"
    title += f"; before = {base['commit']} at {base['tree']}, in turns with {head})." if base else f"; {head})."
    lines = [title, ""]
    cols = ["precision", "threads"]
    for k in ("tg", "pp"):
        cols += ([f"{k} before (rounds)", f"{k} before mean"] if base else []) + [f"{k} now (rounds)", f"{k} now mean"]
    lines += ["| " + " | ".join(cols) + " |", "|---|--:|" + "--:|" * (len(cols) - 2)]
    for c in results["cases"]:
        cells = [f"{c['precision']} / {c['gguf_type']}", str(c["threads"])]
        for k in ("tg", "pp"):
            for side in (["baseline"] if base else []) + ["tandem"]:
                values = c.get(side, {}).get("ratio_rounds", {}).get(k, [])
                cells += [", ".join(f"{v:.2f}" for v in values) or "–",
                          fmt(statistics.mean(values), 2) if values else "–"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def git_commit(tree: Path) -> str:
    """The short commit of a checkout ('?' when git cannot say), with '+' when it has uncommitted changes."""
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "?"
    return head + ("+" if dirty else "")


def _other_compile_cells(case: dict[str, Any], modes: list[str]) -> str:
    """The tg cells (tok/s, ratio to llama.cpp) of the Tandem runs with the other --compile modes."""
    cells = ""
    for mode in modes:
        td = case.get("tandem_other_compile", {}).get(mode, {})
        lc_tg = case["llama_cpp"].get("tg")
        if td.get("status") != "ok":
            cells += f" {td.get('status', '–')} | – |"
            continue
        cells += f" {fmt(td['tg'])} | {fmt(td['tg'] / lc_tg if lc_tg else None, 2)} |"
    return cells


def chart(results: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: chart skipped"
    cases = results["cases"]
    labels = [f"{c['precision']} / {c['gguf_type']}\n{c['threads']}T" for c in cases]
    tg, pp = f"tg{results['n_gen']}", f"pp{results['n_prompt']}"
    fig, axes = plt.subplots(2, 1, figsize=(max(7.0, 1.1 * len(cases)), 7.5))
    for ax, key, title in ((axes[0], "tg", f"decode {tg} (tok/s)"), (axes[1], "pp", f"prefill {pp} (tok/s)")):
        xs = list(range(len(cases)))
        lv = [c["llama_cpp"].get(key, 0.0) for c in cases]
        tv = [c["tandem"].get(key, 0.0) if c["tandem"].get("status") == "ok" else 0.0 for c in cases]
        ax.bar([x - 0.2 for x in xs], lv, 0.4, label="llama.cpp (llama-bench)")
        ax.bar([x + 0.2 for x in xs], tv, 0.4, label="Tandem (served, gRPC)")
        for x, c in zip(xs, cases, strict=True):
            if key not in c["llama_cpp"]:
                ax.text(x - 0.2, 0, "error", rotation=90, ha="center", va="bottom", fontsize=7)
            if c["tandem"].get("status") != "ok":
                status = c["tandem"].get("status", "error")
                ax.text(x + 0.2, 0, status, rotation=90, ha="center", va="bottom", fontsize=7)
            elif c["ratio"].get(key):
                ax.text(x + 0.2, tv[x], f"{c['ratio'][key]:.2f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    m = results["model"]
    fig.suptitle(f"Batch-1 CPU decode, random Qwen3 {m['params'] / 1e6:.0f}M, {results['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "results" / "cpu_peer", help="folder for cpu_peer.json/.png")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--precisions", default="fp32,bf16,int8,int4", help=f"comma-separated, of {','.join(PAIRS)}")
    p.add_argument("--quick", action="store_true", help="small model (hidden 256, 4 layers, vocab 2048), 3 reps")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 768; heads of 64)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 12)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 8192)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default hidden / 64)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default heads / 3)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 8/3 hidden, rounded to 256)")
    p.add_argument(
        "--compile",
        default="on,off",
        help="comma-separated `tandem serve --compile` modes: the first is the table's Tandem figure, each other one "
        "gets a tg column of its own (same run, same server flags otherwise)",
    )
    p.add_argument("--quant-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="Tandem --dtype for int8/int4 (activations, scales)")  # fmt: skip
    p.add_argument("--reps", type=int, default=None, help="Tandem requests per figure (default 5, --quick 3)")
    p.add_argument("--n-gen", type=int, default=64, help="generated tokens (llama-bench -n)")
    p.add_argument("--n-prompt", type=int, default=512, help="prompt tokens (llama-bench -p)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-cpp-version", default=llama_cpp.VERSION, help="llama-cpp-python sdist to build from")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds a server may take to report SERVING")
    p.add_argument("--request-timeout", type=float, default=300.0, help="deadline of one request in seconds")
    p.add_argument("--bench-timeout", type=float, default=1200.0, help="seconds one llama-bench call may take")
    p.add_argument("--no-install", action="store_true", help="fail instead of pip-installing converter deps")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="seconds to wait before each case for other work on the machine to calm down",
    )
    p.add_argument("--quiet-below", type=float, default=0.1, help="share of the CPUs that counts as calm")
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another checkout of Tandem (e.g. `git worktree add /tmp/before COMMIT`): its server runs in each case "
        "beside this checkout's, with the same flags, in turns, so a change is measured before and after in one run",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times each case is repeated (llama-bench, then Tandem, and the baseline): the table gives the mean "
        "ratio and each round's, whose spread is the run-to-run noise a change must exceed",
    )
    p.add_argument(
        "--llama-amx", action="store_true", help="build llama.cpp with AMX (off by default, see llama_cpp.py)"
    )
    p.add_argument(
        "--in-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time Tandem's decode with no server (benchmarks/engine_decode.py), llama-bench's own setting",
    )
    args = p.parse_args(argv)
    small = {"hidden": 256, "layers": 4, "vocab": 2048, "reps": 3}
    full = {"hidden": 768, "layers": 12, "vocab": 8192, "reps": 5}
    for k, v in (small if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.baseline is not None:
        args.baseline = args.baseline.resolve()
        if not (args.baseline / "shared_model" / "cli.py").is_file():
            p.error(f"--baseline {args.baseline} is not a Tandem checkout (no shared_model/cli.py there)")
    args.thread_counts = [int(t) for t in args.threads.split(",") if t.strip()]
    args.compile_modes = [m.strip() for m in args.compile.split(",") if m.strip()]
    if not args.compile_modes or any(m not in ("auto", "on", "off") for m in args.compile_modes):
        p.error("--compile must be a comma-separated list of auto, on, off")
    args.precision_list = [x.strip() for x in args.precisions.split(",") if x.strip()]
    unknown = [x for x in args.precision_list if x not in PAIRS]
    if unknown or not args.thread_counts or min(args.thread_counts) < 1:
        p.error(f"--precisions must be of {','.join(PAIRS)} and --threads positive integers")
    return args


def one_round(
    index: int, precision: str, threads: int, bundle: Path, config, args, state: dict, out_dir: Path, tools,
    results: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """One round of a case: llama-bench, then Tandem from this checkout and from `--baseline` (if given), the two
    checkouts in turns (the baseline first in even rounds), each with the first `--compile` mode; the other modes
    run from this checkout in round 0 only. Per-round ratios to this round's llama-bench are added to each run."""
    gtype = PAIRS[precision]
    try:
        gguf = Path(results["gguf_files"][gtype])
        lc = llama_cpp.bench(tools, gguf, threads, args.n_prompt, args.n_gen, args.bench_timeout)
        lc["read_per_token"] = results["gguf"][gtype]["read_per_token"]
        lc["tg_gbs"] = lc["read_per_token"] * lc["tg"] / 1e9
        if lc["raw"]:
            results["llama_cpp"]["build_commit"] = lc["raw"][0].get("build_commit", "?")
        log(f"  llama.cpp: tg{args.n_gen} {lc['tg']:.1f} tok/s, pp{args.n_prompt} {lc['pp']:.1f} tok/s")
    except (llama_cpp.StepError, KeyError, ValueError) as exc:
        lc = {"error": str(exc)}
        results["errors"].append(f"llama-bench {gtype} t{threads}: {exc}")
        print(f"error: llama-bench {gtype} t{threads}: {str(exc).splitlines()[0]}", file=sys.stderr)
    trees = [("", REPO)] + ([("baseline ", args.baseline)] if args.baseline is not None else [])
    if index % 2 == 0:
        trees.reverse()
    out: dict[str, Any] = {"llama_cpp": lc, "other_compile": {}}
    for label, tree in trees:
        for mode in args.compile_modes if not label and index == 0 else args.compile_modes[:1]:
            where = f"tandem {label}{precision} t{threads} --compile {mode}"
            try:
                td = tandem_case(bundle, config, precision, threads, args, state, out_dir, mode, tree, label.strip())
            except Exception as exc:  # one case failing must not lose the others
                td = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
                results["errors"].append(f"{where}: {td['error']}")
                print(f"error: {where}: {td['error'].splitlines()[0]}", file=sys.stderr)
            if td.get("status") == "ok":
                td["tg_gbs"] = td["read_per_token"] * td["tg"] / 1e9
                td["ratio"] = {k: td[k] / lc[k] for k in ("tg", "pp") if k in lc}
                compiled = f"compiled in {td['compile_seconds']:.0f} s" if td["compiled"] else "eager"
                ratio = f", tg ratio {td['ratio']['tg']:.2f}" if "tg" in td["ratio"] else ""
                log(f"  Tandem {label}--compile {mode} ({compiled}): tg{args.n_gen} {td['tg']:.1f} tok/s, "
                    f"pp{args.n_prompt} {td['pp']:.1f} tok/s{ratio}")  # fmt: skip
            elif td.get("status") == "not offered":
                log(f"  Tandem {label}--compile {mode}: not offered ({td['reason']})")
            if args.in_process and mode == args.compile_modes[0] and td.get("status") == "ok":
                ip = in_process_tg(bundle, precision, threads, args, mode, tree)
                td["in_process"] = ip
                if ip["status"] == "ok":
                    td["tg_in_process"] = ip["tg"]
                    if "tg" in lc:
                        td["ratio"]["tg_in_process"] = ip["tg"] / lc["tg"]
                    log(f"  Tandem {label}in-process (no server): tg{args.n_gen} {ip['tg']:.1f} tok/s")
                else:
                    results["errors"].append(f"{where} in-process: {ip['error']}")
                    print(f"error: {where} in-process: {ip['error']}", file=sys.stderr)
            if label:
                out["baseline"] = td
            elif mode == args.compile_modes[0]:
                out["tandem"] = td
            else:
                out["other_compile"][mode] = td
    return out


def mean_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several rounds' results of one side as one: the first run's record with its rates replaced by their means
    over the rounds that succeeded, and each rate's per-round values (`<rate>_rounds`) and ratios (`ratio_rounds`)
    beside them; the first failure when none succeeded."""
    ok = [r for r in runs if "error" not in r and r.get("status", "ok") == "ok"]
    if not ok:
        return runs[0]
    merged = dict(ok[0])
    for key in ("tg", "pp", "tg_gbs", "tg_in_process"):
        if all(key in r for r in ok):
            merged[key] = statistics.mean(r[key] for r in ok)
            merged[f"{key}_rounds"] = [r[key] for r in ok]
    if all("ratio" in r for r in ok):
        keys = ("tg", "pp", "tg_in_process")
        merged["ratio_rounds"] = {k: [r["ratio"][k] for r in ok if k in r["ratio"]] for k in keys}
    return merged


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    exe = os.path.relpath(sys.executable) if sys.executable.startswith(str(REPO)) else sys.executable
    command = shlex.join([exe, *(sys.argv if argv is None else [__file__, *argv])])
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    cpu = cpu_summary()
    results: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "machine": cpu,
        "reps": args.reps,
        "n_gen": args.n_gen,
        "n_prompt": args.n_prompt,
        "quant_dtype": args.quant_dtype,
        "compile_modes": args.compile_modes,
        "rounds": args.rounds,
        "baseline": None
        if args.baseline is None
        else {"tree": str(args.baseline), "commit": git_commit(args.baseline)},
        "commit": git_commit(REPO),
        "notes": [],
        "cases": [],
        "errors": [],
    }
    log(f"cpu_peer: {cpu['model']}, {cpu['cores']} cores, {flags_line(cpu)}")
    try:
        tools = llama_cpp.ensure_tools(args.llama_cpp_version, log=lambda m, **_: log(m), amx=args.llama_amx)
    except llama_cpp.StepError as exc:
        print(f"error: llama.cpp build: {exc}", file=sys.stderr)
        return 1
    if tools.cached:
        log(f"llama.cpp {tools.version}: cached build (it took {tools.info.get('build_s', float('nan')):.0f} s "
            f"on {tools.info.get('built_at', '?')}): {tools.bench.parent}")  # fmt: skip
    else:
        log(f"llama.cpp {tools.version}: build took {tools.build_s:.0f} s")
    results["llama_cpp"] = {"version": tools.version, "build_s": tools.info.get("build_s"), "cached": tools.cached,
                            "cmake_flags": tools.info.get("cmake_flags"), "bench": str(tools.bench),
                            "build_commit": "?"}  # fmt: skip

    if not args.llama_amx:
        results["notes"].append(
            "llama.cpp was built without AMX (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16 beside GGML_NATIVE=ON): this "
            "version's AMX int8 kernels (Q8_0/Q4_0) die with SIGILL on tileloadd here; --llama-amx builds with AMX"
        )
    config = model_config(args)
    mdir = model_dir(config, args.seed)
    results["model"] = {**dataclasses.asdict(config), "params": param_count(config), "folder": str(mdir)}
    try:
        installed = llama_cpp.ensure_converter(tools.source, not args.no_install)
        if installed:
            results["notes"].append(f"installed for convert_hf_to_gguf.py: {' '.join(installed)}")
        t0 = time.monotonic()
        bundle = make_bundle(mdir / "hf", config, args.seed)
        log(f"model: {param_count(config) / 1e6:.1f}M parameters at {bundle} ({time.monotonic() - t0:.0f} s)")
        ggufs, mapped = make_ggufs(tools, bundle, mdir / f"gguf-{tools.version}", max(args.thread_counts))
    except (llama_cpp.StepError, subprocess.TimeoutExpired) as exc:
        print(f"error: model/GGUF: {exc}", file=sys.stderr)
        return 1
    if mapped:
        note = ("the random tokenizer is unknown to convert_hf_to_gguf.py's pre-tokenizer table; it was mapped to "
                "llama.cpp's 'default' pre-tokenizer (speed does not depend on it)")  # fmt: skip
        log(f"NOTE: {note}")
        results["notes"].append(note)
    results["gguf"] = {t: {"file": str(p), **gguf_read_bytes(tools.source, p)} for t, p in ggufs.items()}
    results["gguf_files"] = {t: str(p) for t, p in ggufs.items()}
    results["weight_bytes_estimate"] = (
        "weight bytes read per token: llama.cpp = the GGUF's tensor bytes less token_embd unless it is the LM head "
        "(tied here, so it counts); Tandem = computed from the config and shared_model/quantize.py's formats: the "
        "projections, norms and LM head (the tied embedding unquantized, its own int8 copy under int8/int4; "
        "int4 groups of 64), without the embedding gather."
    )

    log("memory read bandwidth (torch sum over 1 GiB fp32, best of 7):")
    results["bandwidth_gbs"] = {}
    for t in args.thread_counts:
        results["bandwidth_gbs"][str(t)] = memory_bandwidth(t)
        log(f"  {t}T: {results['bandwidth_gbs'][str(t)]:.1f} GB/s")

    state = {"threads_flag": True}
    for precision in args.precision_list:
        gtype = PAIRS[precision]
        for threads in args.thread_counts:
            case: dict[str, Any] = {"precision": precision, "gguf_type": gtype, "threads": threads, "ratio": {}}
            case["background_cpu_busy"] = wait_quiet(args.quiet_wait, args.quiet_below)  # other work on the machine
            log(f"[{precision} / {gtype}, {threads}T] (other work on the CPUs: {case['background_cpu_busy']:.0%})")
            rounds = [
                one_round(r, precision, threads, bundle, config, args, state, out_dir, tools, results)
                for r in range(args.rounds)
            ]
            lc, td = mean_run([r["llama_cpp"] for r in rounds]), mean_run([r["tandem"] for r in rounds])
            case["llama_cpp"], case["tandem"], case["rounds"] = lc, td, rounds
            case["tandem_other_compile"] = rounds[0]["other_compile"]
            for k, peer in (("tg", "tg"), ("pp", "pp"), ("tg_in_process", "tg")):
                if peer in lc and td.get("status") == "ok" and k in td:
                    case["ratio"][k] = td[k] / lc[peer]
            if args.baseline is not None:
                case["baseline"] = mean_run([r["baseline"] for r in rounds])
            results["cases"].append(case)
    busy = [c["background_cpu_busy"] for c in results["cases"] if c["background_cpu_busy"] == c["background_cpu_busy"]]
    if busy and max(busy) > 0.15:
        results["notes"].append(
            f"other work on the machine used up to {max(busy):.0%} of its CPUs just before a case (median "
            f"{statistics.median(busy):.0%}; background_cpu_busy per case in the JSON): the figures are noisy"
        )
    if not state["threads_flag"]:
        results["notes"].append("the server has no --threads flag: its thread count was set with OMP_NUM_THREADS")
    results["wall_s"] = time.monotonic() - t_start
    (out_dir / "cpu_peer.json").write_text(json.dumps(results, indent=1) + "\n")
    skipped = chart(results, out_dir / "cpu_peer.png")
    log("")
    log(markdown(results))
    log("")
    log(f"wrote {out_dir / 'cpu_peer.json'}" + (f"; {skipped}" if skipped else f" and {out_dir / 'cpu_peer.png'}"))
    log(f"wall time {results['wall_s']:.0f} s")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
