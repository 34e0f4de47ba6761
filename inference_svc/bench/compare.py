"""`tandem bench --compare`: one bundle under several serve configurations, side by side — task quality, user
latency, throughput and peak memory, the table to read before choosing a fix.

Contract:
- `main(argv) -> int` (called by `bench.cli.main` when its argv holds `--compare`). Exit 0 when every
  configuration ran to the end, 1 when one or more is a row with an error (the others are still measured and
  written), 2 on a bad flag or configuration (one line on stderr; no server is started).
- `--configs A,B,...` names the configurations, in order. Each is a preset (`PRESETS`: fp32, bf16, fp16, int8, int4,
  chunked, no-chunked, prefix, no-prefix, kv-bf16, kv-fp8, kv-int8, default), presets joined by `+` (`bf16+int8`), or
  an explicit `NAME=FLAGS` whose FLAGS are `tandem serve` flags (`big-kv=--kv-cache-memory 1GiB`, split like a shell
  line; no commas). Arguments after `--` go to every server (`-- --device cpu --kv-cache-memory 64MiB`). Flags are
  checked against `tandem serve`'s own parser first; flags the comparison sets itself (model, host, ports, HTTP,
  metrics) and TLS/API keys are refused.
- Per configuration, in order: start `tandem serve` as a subprocess on a free loopback port (HTTP off, metrics on
  any free port, its output in `server-<name>.log`), wait for SERVING (`--startup-timeout`; a server that exits
  first fails at once), read GetModelInfo, score held-out perplexity and bits per byte through the server
  (`evaluation.evaluate_grpc` on `shared_model.evaluate.text_windows` of the held-out corpus: the same windows for
  every configuration, `--eval-tokens` tokens in windows of `--eval-window`), send `--warmup` unmeasured requests,
  run the workload at each stream count (`--streams 1,16`: closed-loop clients, `loadgen.run_level`; the same
  requests, cut from the default corpus with the bundle's tokenizer, for every configuration), read GetModelInfo
  again (the workspace peak grows with use) and the server's peak RSS, then SIGTERM it and check it exits 0.
- Peak memory: the ledger's weights + K/V pool + peak workspace (GetModelInfo), and the measured peak. On CPU that
  is the server process's peak resident set (`/proc/PID/status` VmHWM, read just before SIGTERM), which also holds
  the interpreter and its libraries. On CUDA the allocator's peak lives inside the server: it is used when the
  server reports it (`ledger.extra["peak_allocated_bytes"]`), else the measured column is null and says why; the
  host RSS is reported either way (`peak_rss_bytes`).
- A configuration that fails (cannot start, dies, a level with no completed request, a non-zero exit) is a row
  with its `error` and whatever was measured before; the comparison goes on with the next one.
- Output in `--out` (default ./bench-results/compare-<UTC timestamp>/): `compare.json` (`meta` with `columns`,
  `configs` one entry per requested configuration holding every column, null where not measured), `compare.png`
  (unless `--no-plots`), the server logs; the table is printed at the end.
- What exists is what is compared: dtype, weight quantization, K/V-cache dtype (`kv-*`: `--kv-cache-dtype`),
  chunked prefill, prefix caching, and any other `tandem serve` flag through `NAME=FLAGS` (speculative decoding:
  `spec=--speculative ngram`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from inference_svc.serve_process import ServeExited, ServeProcess

PRESETS: dict[str, list[str]] = {
    "default": [],
    "fp32": ["--dtype", "float32"],
    "bf16": ["--dtype", "bfloat16"],
    "fp16": ["--dtype", "float16"],
    "int8": ["--quantization", "int8"],
    "int4": ["--quantization", "int4"],
    "chunked": ["--chunked-prefill"],
    "no-chunked": ["--no-chunked-prefill"],
    "prefix": ["--prefix-caching"],
    "no-prefix": ["--no-prefix-caching"],
    "kv-bf16": ["--kv-cache-dtype", "bf16"],
    "kv-fp8": ["--kv-cache-dtype", "fp8"],
    "kv-int8": ["--kv-cache-dtype", "int8"],
}
"""Named configurations: the `tandem serve` flags each adds. Join them with '+' (`bf16+int8`)."""

DEFAULT_CONFIGS = "fp32,bf16,int8,int4,no-chunked"
DEFAULT_STREAMS = "1,16"
RESERVED = ("model", "model_path", "host", "port", "http_port", "no_http", "metrics_port", "metrics_host", "no_metrics")
"""`tandem serve` settings the comparison sets itself."""
REFUSED = ("tls_cert", "tls_key", "api_key_file", "api_key")
"""Settings its client cannot follow."""
PROG = "tandem bench --compare"


class CompareError(ValueError):
    """A bad configuration or flag: one line, exit 2."""


@dataclass
class ServeConfig:
    name: str
    flags: list[str]
    settings: dict[str, Any] = field(default_factory=dict)
    """The `tandem serve` settings these flags change from its defaults."""


def columns(streams: Sequence[int]) -> list[str]:
    """Every column of a configuration's entry, in table order."""
    cols = ["perplexity", "bits_per_byte"]
    for s in streams:
        cols += [f"ttft_p50_ms@{s}", f"tpot_p50_ms@{s}", f"throughput_tok_s@{s}"]
    return [*cols, "weight_bytes", "kv_cache_bytes", "workspace_bytes", "ledger_peak_bytes", "measured_peak_bytes"]


# ---------------------------------------------------------------------------------------- configurations
def _serve_parser() -> argparse.ArgumentParser:
    """`tandem serve`'s parser, raising CompareError instead of printing usage and exiting."""
    from inference_svc.cli import _serve_parser as serve_parser

    p = serve_parser()

    def error(message: str) -> Any:
        raise CompareError(message)

    p.error = error  # type: ignore[method-assign]
    return p


def parse_configs(text: str, common: Sequence[str] = ()) -> list[ServeConfig]:
    """The configurations of `--configs` (see the module contract); raises CompareError naming the bad one."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise CompareError("--configs names no configuration")
    out: list[ServeConfig] = []
    for item in items:
        if "=" in item:
            name, _, spec = item.partition("=")
            name = name.strip()
            if not name:
                raise CompareError(f"configuration {item!r}: NAME=FLAGS needs a name")
            try:
                flags = shlex.split(spec)
            except ValueError as exc:
                raise CompareError(f"configuration {name!r}: {exc}") from None
        else:
            name, flags = item, []
            for part in item.split("+"):
                if part not in PRESETS:
                    known = ", ".join(PRESETS)
                    raise CompareError(f"unknown configuration {part!r} (known: {known}; or NAME='--serve-flag ...')")
                flags += PRESETS[part]
        if any(c.name == name for c in out):
            raise CompareError(f"configuration {name!r} is named twice")
        out.append(ServeConfig(name, flags, _settings(name, [*common, *flags])))
    return out


def _settings(name: str, flags: Sequence[str]) -> dict[str, Any]:
    """What `flags` change from `tandem serve`'s defaults; CompareError when they are not valid serve flags."""
    parser = _serve_parser()
    base = vars(parser.parse_args(["--model", "-"]))
    try:
        given = vars(_serve_parser().parse_args(["--model", "-", *flags]))
    except CompareError as exc:
        raise CompareError(f"configuration {name!r}: tandem serve: {exc}") from None
    changed = {k: v for k, v in given.items() if v != base[k]}
    for key in (*RESERVED, *REFUSED):
        if key in changed:
            flag = "--" + key.replace("_", "-")
            why = "is set by the comparison" if key in RESERVED else "is not supported by the comparison"
            raise CompareError(f"configuration {name!r}: {flag} {why}")
    return changed


# ---------------------------------------------------------------------------------------- one server
def _proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (bytes) of a live process; {} where /proc is not there."""
    out: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM") and value.strip().endswith("kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


# ---------------------------------------------------------------------------------------- measuring
def _model_info(target: str) -> Any:
    from inference_svc.client import TandemClient

    with TandemClient(target, timeout=30.0) as client:
        return client.model_info()


async def _sweep(target: str, requests: list[Any], streams: Sequence[int], args: argparse.Namespace) -> list[dict]:
    """Warm-up, then one closed-loop level per stream count; the summary of each."""
    from inference_svc.bench.loadgen import GrpcBackend, Level, run_level
    from inference_svc.bench.stats import summarize
    from inference_svc.client import NO_RETRY, AsyncTandemClient

    out = []
    async with AsyncTandemClient(target, timeout=None, retry=NO_RETRY) as client:
        backend = GrpcBackend(client)
        if args.warmup > 0:
            warm = [dataclasses.replace(r, index=-1 - i) for i, r in enumerate(requests)]
            level = Level("concurrency", float(min(args.warmup, 4)))
            await run_level(backend, warm[: args.warmup], level, duration=60.0, drain_timeout=30.0)
        for s in streams:
            n = args.num_requests or max(8, 2 * s)
            records, wall = await run_level(
                backend,
                requests[:n],
                Level("concurrency", float(s)),
                duration=args.duration,
                drain_timeout=args.drain_timeout,
                seed=args.seed,
            )
            out.append({"streams": s, "summary": summarize(records, wall, (50, 99))})
    return out


def _ledger(info: Any) -> dict[str, Any]:
    led = info.ledger
    workspace = int(led.extra.get("peak_workspace_bytes", 0))
    return {
        "weight_bytes": int(led.weight_bytes),
        "kv_cache_bytes": int(led.kv_cache_bytes),
        "workspace_bytes": workspace,
        "ledger_peak_bytes": int(led.weight_bytes) + int(led.kv_cache_bytes) + workspace,
    }


def run_config(
    cfg: ServeConfig,
    args: argparse.Namespace,
    common: Sequence[str],
    windows: list[Any],
    tokenizer: Any,
    requests: list[Any],
    streams: Sequence[int],
    out_dir: Path,
) -> dict[str, Any]:
    """One configuration's entry: every column (None where not measured) and `error` (None when all went well)."""
    from inference_svc.evaluation import evaluate_grpc

    t0 = time.perf_counter()
    entry: dict[str, Any] = {"name": cfg.name, "flags": cfg.flags, "settings": cfg.settings, "error": None}
    entry.update(dict.fromkeys(columns(streams)))
    entry.update(
        dtype=None, quantization=None, device=None, attention_backend=None, kv_capacity_tokens=None, max_context=None,
        measured_peak_source=None, peak_rss_bytes=None, rss_serving_bytes=None, server_exit_code=None,
        startup_s=None, eval=None, levels=[], log=None,
    )  # fmt: skip
    slug = re.sub(r"[^A-Za-z0-9_.+-]", "_", cfg.name)
    log = out_dir / f"server-{slug}.log"
    entry["log"] = log.name
    print(f"{PROG}: [{cfg.name}] tandem serve {shlex.join([*common, *cfg.flags])}", file=sys.stderr, flush=True)
    server = None
    peak = None
    try:
        flags = [*common, *cfg.flags, "--no-http", "--metrics-port", "0", "--shutdown-grace", "10"]
        server = ServeProcess(args.model, flags, log=log)
        entry["startup_s"] = round(server.wait_serving(args.startup_timeout), 3)
        entry["rss_serving_bytes"] = _proc_status(server.proc.pid).get("VmRSS")
        info = _model_info(server.target)
        entry.update(
            dtype=info.dtype, quantization=info.quantization, device=info.device,
            attention_backend=info.attention_backend, kv_capacity_tokens=int(info.kv_capacity_tokens),
            max_context=int(info.max_context),
        )  # fmt: skip
        entry.update(_ledger(info))
        e0 = time.perf_counter()
        res = asyncio.run(evaluate_grpc(server.target, windows, tokenizer))
        entry.update(perplexity=res.perplexity, bits_per_byte=res.bits_per_byte)
        entry["eval"] = {**res.as_dict(), "seconds": round(time.perf_counter() - e0, 3)}
        levels = asyncio.run(_sweep(server.target, requests, streams, args))
        failed = []
        for lv in levels:
            s, summ = lv["streams"], lv["summary"]
            entry[f"ttft_p50_ms@{s}"] = summ["ttft_ms"]["p50"]
            entry[f"tpot_p50_ms@{s}"] = summ["tpot_ms"]["p50"]
            entry[f"throughput_tok_s@{s}"] = summ["output_throughput"]
            entry["levels"].append(lv)
            if summ["completed"] == 0:
                errs = " ".join(f"{k}:{v}" for k, v in summ["errors"].items())
                failed.append(f"{s} streams: 0/{summ['requests']} requests completed ({errs})")
        info = _model_info(server.target)  # the workspace peak after the workload
        entry.update(_ledger(info))
        peak = info.ledger.extra.get("peak_allocated_bytes")
        if failed:
            entry["error"] = "; ".join(failed)
    except Exception as exc:  # a configuration that fails is a row with its error, never the end of the comparison
        entry["error"] = _describe(exc)
    finally:
        if server is not None:
            entry["peak_rss_bytes"] = _proc_status(server.proc.pid).get("VmHWM")
            code = server.stop()
            entry["server_exit_code"] = code
            if code != 0 and entry["error"] is None:
                entry["error"] = f"server exited {code} after SIGTERM: {server.last_line()}"
    device = entry["device"] or ""
    if device.startswith("cuda"):
        if peak is not None:
            entry["measured_peak_bytes"] = int(peak)
            entry["measured_peak_source"] = "CUDA allocator peak (reported by the server)"
        else:
            entry["measured_peak_source"] = "not measured: the CUDA allocator's peak is not reachable from outside"
    elif entry["peak_rss_bytes"] is not None:
        entry["measured_peak_bytes"] = entry["peak_rss_bytes"]
        entry["measured_peak_source"] = "peak RSS of the server process (VmHWM)"
    entry["wall_s"] = round(time.perf_counter() - t0, 3)
    status = "ok" if entry["error"] is None else f"FAILED: {entry['error']}"
    print(f"{PROG}: [{cfg.name}] {status} ({entry['wall_s']:.1f} s)", file=sys.stderr, flush=True)
    return entry


def _describe(exc: Exception) -> str:
    """One line for a failure: the gRPC status and details, the server's own words, or the exception."""
    import grpc

    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    if type(exc) is RuntimeError or isinstance(exc, (ServeExited, TimeoutError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------------------- report
def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}B"


def _num(v: float | None, digits: int) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}f}"


def format_table(entries: list[dict[str, Any]], streams: Sequence[int]) -> str:
    head = [("config", "<", 14), ("dtype", "<", 9), ("quant", "<", 6), ("ppl", ">", 9), ("bits/B", ">", 7)]
    for s in streams:
        head += [(f"TTFT@{s}", ">", 9), (f"TPOT@{s}", ">", 9), (f"tok/s@{s}", ">", 10)]
    head += [("weights", ">", 8), ("KV", ">", 8), ("work", ">", 8), ("ledger", ">", 8), ("measured", ">", 9)]
    lines = [" ".join(f"{h:{a}{w}}" for h, a, w in head) + "  serve flags"]
    lines.append("-" * len(lines[0]))
    for e in entries:
        cells = [e["name"][:14], e["dtype"] or "-", e["quantization"] or "-"]
        cells += [_num(e["perplexity"], 2), _num(e["bits_per_byte"], 3)]
        for s in streams:
            cells += [_num(e[f"ttft_p50_ms@{s}"], 1), _num(e[f"tpot_p50_ms@{s}"], 2)]
            cells += [_num(e[f"throughput_tok_s@{s}"], 1)]
        cells += [_size(e[k]) for k in ("weight_bytes", "kv_cache_bytes", "workspace_bytes", "ledger_peak_bytes")]
        cells.append(_size(e["measured_peak_bytes"]))
        row = " ".join(f"{c:{a}{w}}" for c, (_, a, w) in zip(cells, head, strict=True))
        lines.append(f"{row}  {shlex.join(e['flags'])}")
        if e["error"]:
            lines.append(f"  {e['name']}: FAILED: {e['error']}")
    lines.append(
        "(perplexity and bits/byte on the held-out windows, through each server; TTFT/TPOT: medians in ms; tok/s: "
        "output tokens/s, all streams together;\n ledger = weights + K/V pool + peak workspace (GetModelInfo); "
        "measured = peak RSS of the server process on CPU (interpreter and libraries included), the allocator's "
        "peak on CUDA)"
    )
    return "\n".join(lines)


def plot_compare(entries: list[dict[str, Any]], streams: Sequence[int], path: Path, title: str = "") -> Path:
    """Bars per configuration: perplexity, TTFT, TPOT, throughput (one bar per stream count) and peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [e["name"] for e in entries]
    x = np.arange(len(entries))

    def val(e: dict[str, Any], key: str, scale: float = 1.0) -> float:
        v = e.get(key)
        return float("nan") if v is None else v / scale

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    ax = axes[0][0]  # points, not bars from zero: the differences that matter are small
    ppl = [val(e, "perplexity") for e in entries]
    ax.plot(x, ppl, "o", color="tab:purple")
    for xi, v in zip(x, ppl, strict=True):
        if math.isfinite(v):
            ax.annotate(f"{v:.4g}", (xi, v), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlim(-0.5, len(entries) - 0.5)
    ax.set_title("held-out perplexity (lower is better)")
    width = 0.8 / max(1, len(streams))
    for ax, key, name in (
        (axes[0][1], "ttft_p50_ms", "TTFT p50 (ms)"),
        (axes[0][2], "tpot_p50_ms", "time per output token p50 (ms)"),
        (axes[1][0], "throughput_tok_s", "aggregate output tokens/s"),
    ):
        for i, s in enumerate(streams):
            ax.bar(x + (i - (len(streams) - 1) / 2) * width, [val(e, f"{key}@{s}") for e in entries], width,
                   label=f"{s} stream{'s' if s != 1 else ''}")  # fmt: skip
        ax.set_title(name)
        ax.legend(fontsize=8)
    ax = axes[1][1]
    bottom = np.zeros(len(entries))
    mib = float(2**20)
    for key, label in (("weight_bytes", "weights"), ("kv_cache_bytes", "K/V pool"), ("workspace_bytes", "workspace")):
        heights = np.nan_to_num(np.array([val(e, key, mib) for e in entries]))
        ax.bar(x - 0.2, heights, 0.4, bottom=bottom, label=f"ledger: {label}")
        bottom += heights
    measured = [val(e, "measured_peak_bytes", mib) for e in entries]
    ax.bar(x + 0.2, measured, 0.4, color="0.4", label="measured peak")
    for xi, led, meas in zip(x, bottom, measured, strict=True):
        for dx, v in ((-0.2, led), (0.2, meas)):
            if math.isfinite(v) and v > 0:
                ax.annotate(
                    f"{v:.4g}", (xi + dx, v), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7
                )
    ax.set_title("peak memory (MiB)")
    ax.legend(fontsize=8)
    for row in axes:
        for ax in row[:3]:
            ax.set_xticks(x, names, rotation=20, fontsize=8)
            ax.grid(alpha=0.3, axis="y")
    axes[1][2].axis("off")
    failed = [f"{e['name']}: {e['error'][:80]}" for e in entries if e["error"]]
    if failed:
        axes[1][2].text(0, 1, "failed:\n" + "\n".join(failed), va="top", fontsize=8, wrap=True)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------- command
def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct whole numbers >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Serve one model under several configurations, one after another, and compare held-out "
        "perplexity, TTFT, time per output token, aggregate throughput and peak memory side by side. Arguments "
        "after `--` go to every `tandem serve`.",
    )
    p.add_argument("--model", required=True, help="Tandem bundle or Hugging Face Llama/Qwen2/Qwen3 folder")
    p.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help=f"comma-separated configurations: presets ({', '.join(PRESETS)}), presets joined by '+' "
        f"(bf16+int8), or NAME=FLAGS with tandem serve flags (default: {DEFAULT_CONFIGS})",
    )
    p.add_argument("--streams", type=_ints, default=_ints(DEFAULT_STREAMS), help="concurrent streams per level")
    p.add_argument("--num-requests", type=int, default=None, help="requests per level (default: max(8, 2 × streams))")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per level before no new request is sent")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get after --duration")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per configuration")
    p.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="mean output length in tokens (ignore_eos)")
    p.add_argument("--len-dist", default="fixed", choices=["fixed", "uniform", "lognormal"])
    p.add_argument("--range-ratio", type=float, default=0.5, help="uniform: ±fraction of the mean; lognormal: sigma")
    p.add_argument("--corpus-docs", type=int, default=64, help="documents of the default corpus to cut prompts from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens scored for perplexity")
    p.add_argument("--eval-window", type=int, default=512, help="tokens per perplexity window (capped by the model)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a server may take to report SERVING")
    p.add_argument("--out", default=None, help="results folder (default ./bench-results/compare-<UTC timestamp>)")
    p.add_argument("--no-plots", action="store_true")
    return p


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    common: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, common = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    from shared_model.errors import SharedModelError

    try:
        for name in ("input_len", "output_len", "corpus_docs"):
            if getattr(args, name) < 1:
                raise CompareError(f"--{name.replace('_', '-')} must be >= 1")
        if args.num_requests is not None and args.num_requests < 1:
            raise CompareError("--num-requests must be >= 1")
        if args.eval_tokens < 2 or args.eval_window < 2:
            raise CompareError("--eval-tokens and --eval-window must be >= 2")
        if args.duration <= 0 or args.drain_timeout < 0 or args.warmup < 0:
            raise CompareError("--duration must be > 0, --drain-timeout and --warmup >= 0")
        configs = parse_configs(args.configs, common)
        prepared = _prepare(args)
    except (CompareError, SharedModelError, OSError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    tokenizer, windows, requests, window = prepared
    streams = args.streams
    stamp = datetime.now(timezone.utc)
    out_dir = Path(args.out) if args.out else Path.cwd() / "bench-results" / f"compare-{stamp:%Y%m%d-%H%M%S}"
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    entries = [run_config(c, args, common, windows, tokenizer, requests, streams, out_dir) for c in configs]
    report = {
        "meta": {
            "date": stamp.isoformat(timespec="seconds"),
            "command": "tandem bench --compare " + shlex.join(argv + (["--", *common] if common else [])),
            "model": str(Path(args.model).resolve()),
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
            "configs": [c.name for c in configs],
            "common_serve_flags": common,
            "streams": streams,
            "columns": columns(streams),
            "workload": {
                "input_len": args.input_len,
                "output_len": args.output_len,
                "len_dist": args.len_dist,
                "range_ratio": args.range_ratio,
                "num_requests": {str(s): min(len(requests), args.num_requests or max(8, 2 * s)) for s in streams},
                "duration_s": args.duration,
                "warmup": args.warmup,
                "seed": args.seed,
            },
            "eval": {
                "data": "held-out split of the default corpus",
                "window": window,
                "max_tokens": args.eval_tokens,
                "windows": len(windows),
            },
            "wall_s": round(time.perf_counter() - t0, 3),
        },
        "configs": entries,
    }
    (out_dir / "compare.json").write_text(json.dumps(report, indent=1) + "\n")
    written = ["compare.json"]
    if not args.no_plots:
        title = f"{Path(args.model).name} · {args.input_len}→{args.output_len} tokens · streams {streams}"
        written.append(plot_compare(entries, streams, out_dir / "compare.png", title).name)
    print(format_table(entries, streams))
    print(f"results: {out_dir.resolve()} ({', '.join(written)}, server logs)")
    return 0 if all(e["error"] is None for e in entries) else 1


def _prepare(args: argparse.Namespace) -> tuple[Any, list[Any], list[Any], int]:
    """The bundle's tokenizer, the held-out windows and the workload's requests (the same for every configuration)."""
    from inference_svc.bench.workload import LengthSpec, corpus_text, make_requests, token_pool
    from shared_model.bundle import read_config
    from shared_model.evaluate import heldout_texts, text_windows
    from shared_model.tokenizer import Tokenizer

    if not Path(args.model).is_dir():
        raise CompareError(f"--model: {args.model} is not a folder")
    config = read_config(args.model)
    tokenizer = Tokenizer.load(args.model)
    positions = config.max_position_embeddings
    window = min(args.eval_window, positions - 1)
    windows = text_windows(tokenizer, heldout_texts(), window, None, args.eval_tokens)
    pool = token_pool(tokenizer.encode, corpus_text(max_documents=args.corpus_docs))
    n = args.num_requests or max(8, 2 * max(args.streams))
    requests = make_requests(
        pool,
        n,
        LengthSpec(args.input_len, args.len_dist, args.range_ratio),
        LengthSpec(args.output_len, args.len_dist, args.range_ratio),
        max_context=positions,
        seed=args.seed,
    )
    return tokenizer, windows, requests, window
