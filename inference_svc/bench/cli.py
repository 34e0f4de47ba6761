"""`tandem bench --target HOST:PORT`: sweep a load over a running server, report and plot it.

Contract:
- `main(argv) -> int` (called by `shared_model.cli`). Exit 0 when every level completed at least one request,
  1 when the server could not be reached or a level completed none, 2 on invalid flags (argparse) or a bad
  `--dataset` file (one line naming the file and the line).
- Backends (`--backend`), the same workload and the same report for both:
  - `grpc` (the default): a Tandem server at `--target HOST:PORT`, through `AsyncTandemClient`.
  - `openai`: any OpenAI-compatible server (Tandem's HTTP API, vLLM, llama.cpp's server) at `--target` given as a
    base URL (`http://HOST:PORT`, with or without `/v1`), through streamed `/v1/completions`
    (`openai_backend`). `--model` names the `model` field (default: the first id of `GET /v1/models`); the
    context is that card's `max_model_len` when the server gives one.
- One run: wait for the server to be ready (`--wait`: gRPC health SERVING, or HTTP `GET /health` 200), read the
  model's context (GetModelInfo / the model card), build the prompts, draw `--num-requests` requests (same set for
  every level), send `--warmup` requests that are not measured, then run each level of the sweep
  (`--concurrency 1,4,16` — the default — or `--request-rate 2,8,inf`), each bounded by `--num-requests` and
  `--duration` (+ `--drain-timeout` for the requests in flight). Defaults finish within about two minutes.
- Prompts: windows of the default corpus as token ids, tokenized by the server (gRPC Tokenize; over HTTP the
  server's `/tokenize`, or a local `--tokenizer`), so prompt lengths are exact in the served model's tokens; or,
  with `--dataset FILE`, the text prompts of a JSONL file (`workload.read_dataset`), sent as text.
- Around each level the server's Prometheus metrics are scraped and compared with the client's figures
  (`server_metrics.cross_check`). The endpoint is `--metrics-url`; without it, the gRPC backend takes the port the
  server reports in GetModelInfo (`metrics_port`; http://HOST:PORT/metrics, HOST from `--target`) and the openai
  backend has none (the check is skipped, saying so in one line). A server without metrics, or an endpoint with no
  `tandem_` series, only loses that check (`--no-server-metrics` skips it).
- Results go to `--out` (default ./bench-results/<UTC timestamp>/): `results.json` (meta with date, command and
  backend, per-level summary, server cross-check and per-request records), `throughput_latency.png` and
  `latency_cdf.png`. A table is printed at the end, with a progress bar on stderr while running.
- The client never retries (refusals are measured as errors by status code, not hidden). The API key
  (`--api-key-file`, else the `--api-key-env` variable) goes as gRPC metadata or as `Authorization: Bearer`.
- `--compare` anywhere before a `--` hands the rest of argv to `bench.compare.main`: it starts its own servers,
  one per serve configuration of one bundle, and compares them (its own flags: `tandem bench --compare --help`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from inference_svc.bench.loadgen import Backend, GrpcBackend, Level, RequestRecord, probe_rtt, run_level
from inference_svc.bench.progress import Progress
from inference_svc.bench.server_metrics import ScrapeError, cross_check, scrape, server_delta
from inference_svc.bench.stats import distribution, summarize
from inference_svc.bench.workload import (
    DatasetEntry,
    DatasetError,
    LengthSpec,
    RequestSpec,
    WorkloadError,
    dataset_requests,
    make_requests,
    read_dataset,
    token_pool,
)

DEFAULT_CONCURRENCY = "1,4,16"
BACKENDS = ("grpc", "openai")
DEFAULT_TARGETS = {"grpc": "127.0.0.1:50051", "openai": "http://127.0.0.1:8000"}
UNKNOWN_CONTEXT = 10**9
"""The context assumed when an OpenAI-compatible server does not say (no `max_model_len` on its model card)."""


def _floats(text: str) -> list[float]:
    try:
        values = [math.inf if v.strip().lower() == "inf" else float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem bench",
        description="Load-test a Tandem server (gRPC) or any OpenAI-compatible server (HTTP): TTFT, time per output "
        "token, inter-token latency, throughput.",
    )
    p.add_argument(
        "--backend",
        default="grpc",
        choices=BACKENDS,
        help="grpc: a Tandem server; openai: streamed /v1/completions of any OpenAI-compatible server",
    )
    p.add_argument(
        "--target",
        default=None,
        help=f"grpc: HOST:PORT (default {DEFAULT_TARGETS['grpc']}); openai: base URL http(s)://HOST:PORT, with or "
        f"without /v1 (default {DEFAULT_TARGETS['openai']})",
    )
    p.add_argument("--model", default=None, help="openai: the request's model (default: the first of /v1/models)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="compare serve configurations of one bundle, starting each server itself (perplexity, latency, "
        "throughput, peak memory side by side; see `tandem bench --compare --help`)",
    )
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument(
        "--concurrency",
        type=_floats,
        default=None,
        help=f"closed-loop clients per level (default {DEFAULT_CONCURRENCY})",
    )
    sweep.add_argument(
        "--request-rate", type=_floats, default=None, help="Poisson arrival rates per level, req/s ('inf': all at once)"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="rate mode: cap on requests in flight")
    p.add_argument("--num-requests", type=int, default=48, help="requests per level (at most)")
    p.add_argument("--duration", type=float, default=25.0, help="seconds per level before no new request is sent")
    p.add_argument("--drain-timeout", type=float, default=10.0, help="seconds in-flight requests get after --duration")
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests sent before the sweep")
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens")
    w.add_argument("--output-len", type=int, default=64, help="mean output length in tokens (ignore_eos)")
    w.add_argument("--len-dist", default="uniform", choices=["fixed", "uniform", "lognormal"])
    w.add_argument("--range-ratio", type=float, default=0.5, help="uniform: ±fraction of the mean; lognormal: sigma")
    w.add_argument("--corpus-docs", type=int, default=64, help="documents of the default corpus to cut prompts from")
    w.add_argument(
        "--dataset",
        default=None,
        help='JSONL file of text prompts, one {"prompt": ..., "max_tokens": ...} per line (max_tokens optional: '
        "else --output-len); replaces the corpus prompts and --input-len",
    )
    w.add_argument(
        "--tokenizer",
        default=None,
        help="openai: tokenizer.json (or the model's folder) to cut corpus prompts with (default: the server's "
        "/tokenize)",
    )
    w.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="results folder (default ./bench-results/<UTC timestamp>)")
    o.add_argument("--percentiles", default="99", help="comma-separated percentiles to report besides the median")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    m = p.add_argument_group("server metrics cross-check")
    m.add_argument(
        "--metrics-url",
        default=None,
        help="Prometheus endpoint of the Tandem server (default: grpc: the metrics port GetModelInfo reports, on "
        "HOST; openai: none, no cross-check)",
    )
    m.add_argument("--no-server-metrics", action="store_true", help="skip the scrape and the cross-check")
    c = p.add_argument_group("connection")
    c.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the server to report SERVING")
    c.add_argument("--tls", action="store_true", help="grpc: use TLS (system roots unless --tls-ca); openai: https://")
    c.add_argument("--tls-ca", default=None, help="PEM file of the CA to trust")
    c.add_argument("--tls-server-name", default=None, help="grpc: expected server name in its certificate")
    c.add_argument("--api-key-file", default=None, help="file whose first key is sent as the API key")
    c.add_argument("--api-key-env", default="TANDEM_API_KEY", help="environment variable holding the API key")
    return p


def _levels(args: argparse.Namespace) -> list[Level]:
    if args.request_rate is not None:
        return [Level("rate", v, args.max_concurrency) for v in args.request_rate]
    values = args.concurrency if args.concurrency is not None else _floats(DEFAULT_CONCURRENCY)
    return [Level("concurrency", v) for v in values]


def _api_key(args: argparse.Namespace) -> str | None:
    from inference_svc.settings import read_api_keys

    if args.api_key_file:
        return read_api_keys(args.api_key_file)[0].decode()
    return os.environ.get(args.api_key_env) or None


def _client_kwargs(args: argparse.Namespace, api_key: str | None) -> dict[str, Any]:
    from inference_svc.client import NO_RETRY

    root = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    return {
        "api_key": api_key,
        "tls": args.tls or root is not None,
        "root_certificates": root,
        "tls_server_name": args.tls_server_name,
        "retry": NO_RETRY,
    }


@dataclasses.dataclass
class Prepared:
    """What the set-up found: the model, the requests, the idle round trip, and how to open the backend."""

    model: dict[str, Any]
    requests: list[RequestSpec]
    rtt_ms: float
    metrics_port: int | None
    """The metrics port the server reports (gRPC GetModelInfo; 0: none), None when it cannot say."""
    open_backend: Callable[[], AbstractAsyncContextManager[Backend]]


def _build_requests(
    args: argparse.Namespace,
    dataset: list[DatasetEntry] | None,
    max_context: int | None,
    tokenize: Callable[[str], Sequence[int]],
) -> tuple[list[RequestSpec], int | None]:
    """The run's requests and the corpus pool's size (None with a dataset)."""
    from inference_svc.bench.workload import corpus_text

    output_len = LengthSpec(args.output_len, args.len_dist, args.range_ratio)
    if dataset is not None:
        return dataset_requests(dataset, args.num_requests, output_len, max_context, seed=args.seed), None
    pool = token_pool(tokenize, corpus_text(max_documents=args.corpus_docs))
    requests = make_requests(
        pool,
        args.num_requests,
        LengthSpec(args.input_len, args.len_dist, args.range_ratio),
        output_len,
        max_context=max_context or UNKNOWN_CONTEXT,
        seed=args.seed,
    )
    return requests, len(pool)


def _rtt_ms(call: Callable[[], object], n: int = 5) -> float:
    rtts = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        rtts.append((time.perf_counter() - t) * 1000)
    return statistics.median(rtts)


def _prepare_grpc(
    args: argparse.Namespace,
    api_key: str | None,
    dataset: list[DatasetEntry] | None,
    tokenize: Callable[[str], Sequence[int]] | None = None,
) -> Prepared:
    """Blocking set-up over gRPC: health, model info, token pool, requests, round-trip time."""
    from inference_svc.client import AsyncTandemClient, TandemClient

    kwargs = _client_kwargs(args, api_key)
    with TandemClient(args.target, timeout=60.0, **kwargs) as client:
        client.wait_until_serving(args.wait)
        info = client.model_info()
        rtt = _rtt_ms(client.health)
        max_context = int(info.max_context)
        requests, pool = _build_requests(args, dataset, max_context, lambda s: list(client.tokenize(s).token_ids))
    model = {
        "model_name": info.model_name,
        "model_type": info.config.model_type,
        "dtype": info.dtype,
        "device": info.device,
        "attention_backend": info.attention_backend,
        "kv_capacity_tokens": int(info.kv_capacity_tokens),
        "max_context": max_context,
        "corpus_pool_tokens": pool,
    }

    @contextlib.asynccontextmanager
    async def open_backend() -> AsyncIterator[Backend]:
        async with AsyncTandemClient(args.target, timeout=None, **kwargs) as aclient:
            yield GrpcBackend(aclient)

    return Prepared(model, requests, rtt, int(info.metrics_port), open_backend)


def _prepare_openai(
    args: argparse.Namespace,
    api_key: str | None,
    dataset: list[DatasetEntry] | None,
    tokenize: Callable[[str], Sequence[int]] | None = None,
) -> Prepared:
    """Blocking set-up over HTTP: readiness, the model card, token pool, requests, round-trip time."""
    from inference_svc.bench.openai_backend import OpenAIBackend, OpenAIServer, verify_option

    verify = verify_option(args.tls_ca)
    with OpenAIServer(args.target, api_key=api_key, verify=verify) as server:
        health_url = server.wait_ready(args.wait)
        cards = server.models()
        name = args.model or cards[0]["id"]
        card = next((c for c in cards if c["id"] == name), {})
        context = card.get("max_model_len")
        max_context = context if type(context) is int and context > 0 else None
        rtt = _rtt_ms(lambda: server.http.get(health_url, timeout=5.0))
        requests, pool = _build_requests(args, dataset, max_context, tokenize or (lambda s: server.tokenize(s, name)))
    model = {
        "model_name": name,
        "model_type": None,
        "dtype": None,
        "device": None,
        "attention_backend": None,
        "kv_capacity_tokens": None,
        "max_context": max_context,
        "corpus_pool_tokens": pool,
    }

    @contextlib.asynccontextmanager
    async def open_backend() -> AsyncIterator[Backend]:
        async with OpenAIBackend(args.target, name, api_key=api_key, verify=verify, health_url=health_url) as b:
            yield b

    return Prepared(model, requests, rtt, None, open_backend)


def _grpc_host(target: str) -> str:
    """The host part of a gRPC target (HOST:PORT, [v6]:PORT, dns:///HOST:PORT, ipv4:HOST:PORT)."""
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(prefix):
            target = target[len(prefix) :]
            break
    return target.rsplit(":", 1)[0] if ":" in target else target


def _metrics_url(args: argparse.Namespace, prepared: Prepared) -> str | None:
    """The Prometheus endpoint to cross-check against, or None (saying why in one line)."""
    if args.no_server_metrics:
        return None
    if args.metrics_url:
        return args.metrics_url
    if args.backend == "openai":
        print(
            "tandem bench: no --metrics-url given for --backend openai; skipping the server cross-check",
            file=sys.stderr,
        )
        return None
    if not prepared.metrics_port:
        msg = "the server serves no metrics (GetModelInfo metrics_port 0); skipping the server cross-check"
        print(f"tandem bench: {msg}", file=sys.stderr)
        return None
    return f"http://{_grpc_host(args.target)}:{prepared.metrics_port}/metrics"


async def _sweep(
    args: argparse.Namespace,
    open_backend: Callable[[], AbstractAsyncContextManager[Backend]],
    levels: list[Level],
    requests: list[RequestSpec],
    metrics_url: str | None,
    rtt_ms: float,
    percentiles: list[float],
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    async with open_backend() as backend:
        if args.warmup > 0:
            warm = Level("concurrency", float(min(args.warmup, 4)))
            specs = [dataclasses.replace(r, index=-1 - i) for i, r in enumerate(requests)]
            await run_level(backend, specs[: args.warmup], warm, duration=60.0, drain_timeout=30.0)
        for level in levels:
            before = _try_scrape(metrics_url)
            bar = Progress(len(requests), level.label, enabled=not args.no_progress)

            def done(rec: RequestRecord, bar: Progress = bar) -> None:
                bar.update(rec.ok)

            stop = asyncio.Event()
            probe = asyncio.create_task(probe_rtt(backend, stop))
            try:
                records, wall = await run_level(
                    backend,
                    requests,
                    level,
                    duration=args.duration,
                    drain_timeout=args.drain_timeout,
                    seed=args.seed,
                    on_done=done,
                )
            finally:
                stop.set()
                rtts = await probe
            bar.close()
            loaded_rtt = float(np.percentile(rtts, 99)) if rtts else rtt_ms
            records.sort(key=lambda r: r.index)
            summary = summarize(records, wall, percentiles)
            entry: dict[str, Any] = {
                "label": level.label,
                "mode": level.mode,
                "value": None if math.isinf(level.value) else level.value,
                "max_concurrency": level.max_concurrency,
                "summary": summary,
                "rtt_under_load_ms": distribution([r / 1000 for r in rtts]),
                "server_check": None,
                "requests": [r.to_json() for r in records],
            }
            if before is not None:
                delta = await _settled_delta(metrics_url, before, summary)
                if delta is not None:
                    entry["server_check"] = {"server": delta, **cross_check(summary, delta, loaded_rtt, records)}
            results.append(entry)
    return results


async def _settled_delta(
    url: str | None, before: dict[str, float], summary: dict[str, Any], patience: float = 3.0
) -> dict[str, Any] | None:
    """The server's change over the level, re-scraped (for up to `patience` s) until its counters have caught up
    with what the client saw: the engine thread refreshes them just after posting a step's outputs."""
    deadline = time.perf_counter() + patience
    delta = None
    while True:
        await asyncio.sleep(0.2)
        after = _try_scrape(url)
        if after is None:
            return delta
        delta = server_delta(before, after)
        caught_up = (
            delta["generation_tokens"] >= summary["client_output_tokens_all"]
            and sum(delta["finished"].values()) >= summary["completed"]
        )
        if caught_up or time.perf_counter() >= deadline:
            return delta


def _try_scrape(url: str | None) -> dict[str, float] | None:
    if url is None:
        return None
    try:
        snapshot = scrape(url)
    except ScrapeError as exc:
        print(f"tandem bench: server metrics unavailable ({exc}); skipping the cross-check", file=sys.stderr)
        return None
    if not any(k.startswith("tandem_") for k in snapshot):
        msg = f"{url} has no tandem_ series (not a Tandem server's metrics); skipping the cross-check"
        print(f"tandem bench: {msg}", file=sys.stderr)
        return None
    return snapshot


def _fmt(value: float | None, width: int = 8, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def format_table(levels: list[dict[str, Any]], pct: str) -> str:
    head = (
        f"{'level':<12}{'ok/all':>9}{'req/s':>8}{'tok/s':>9}"
        f"{'TTFT med':>10}{'p' + pct:>8}{'TPOT med':>10}{'p' + pct:>8}{'ITL med':>9}{'p' + pct:>8}"
        f"{'e2e med':>9}{'p' + pct:>9}  server check"
    )
    lines = [head, "-" * len(head)]
    for lv in levels:
        s = lv["summary"]
        chk = lv["server_check"]
        if chk is None:
            check = "n/a"
        else:
            over = chk.get("ttft_overhead_ms")
            check = ("agrees" if chk["agrees"] else "DISAGREES") + (
                f" (TTFT +{over:.1f} ms, tokens {chk['server_generation_tokens']:.0f}/{chk['client_output_tokens']})"
                if over is not None
                else ""
            )
        errs = " ".join(f"{k}:{v}" for k, v in s["errors"].items())
        lines.append(
            f"{lv['label']:<12}{s['completed']:>4}/{s['requests']:<4}{s['request_throughput']:>8.2f}"
            f"{s['output_throughput']:>9.1f}"
            f"{_fmt(s['ttft_ms']['median'], 10)}{_fmt(s['ttft_ms']['p' + pct])}"
            f"{_fmt(s['tpot_ms']['median'], 10, 2)}{_fmt(s['tpot_ms']['p' + pct], 8, 2)}"
            f"{_fmt(s['itl_ms']['median'], 9, 2)}{_fmt(s['itl_ms']['p' + pct], 8, 2)}"
            f"{_fmt(s['e2e_ms']['median'], 9)}{_fmt(s['e2e_ms']['p' + pct], 9)}  {check}"
            + (f"  errors {errs}" if errs else "")
        )
    lines.append("(latencies in ms; tok/s = output tokens per second; med = median)")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    own = argv[: argv.index("--")] if "--" in argv else argv
    if "--compare" in own:
        from inference_svc.bench.compare import main as compare_main

        at = argv.index("--compare")
        return compare_main(argv[:at] + argv[at + 1 :])
    import grpc

    parser = build_parser()
    args = parser.parse_args(list(argv))
    for name in ("num_requests", "input_len", "output_len", "corpus_docs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.duration <= 0 or args.drain_timeout < 0 or args.warmup < 0:
        parser.error("--duration must be > 0, --drain-timeout and --warmup >= 0")
    try:
        percentiles = _floats(args.percentiles)
        levels = _levels(args)
        LengthSpec(args.input_len, args.len_dist, args.range_ratio)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    args.target = args.target or DEFAULT_TARGETS[args.backend]
    prepare_errors: tuple[type[BaseException], ...] = (grpc.RpcError, TimeoutError, WorkloadError)
    if args.backend == "openai":
        try:
            from inference_svc.bench.openai_backend import OpenAIError, base_urls
        except ImportError as exc:
            print(f"tandem bench: --backend openai needs httpx2 (pip install httpx2): {exc}", file=sys.stderr)
            return 2
        prepare_errors += (OpenAIError,)
        try:
            base_urls(args.target)
        except ValueError as exc:
            parser.error(str(exc))
        if args.tls and not args.target.startswith("https://"):
            parser.error("--backend openai speaks TLS to an https:// --target; --tls is for --backend grpc")
        if args.tls_server_name:
            parser.error("--tls-server-name is for --backend grpc")
    else:
        for flag, value in (("--model", args.model), ("--tokenizer", args.tokenizer)):
            if value is not None:
                parser.error(f"{flag} is for --backend openai (a gRPC server names its model and tokenizes)")
    from shared_model.errors import TokenizerError

    dataset = tokenize = None
    try:
        api_key = _api_key(args)
        if args.dataset:
            dataset = read_dataset(args.dataset)
        if args.tokenizer:
            from shared_model.tokenizer import Tokenizer

            tokenize = Tokenizer.load(args.tokenizer).encode
    except (DatasetError, TokenizerError, OSError, ValueError) as exc:
        print(f"tandem bench: {exc}", file=sys.stderr)
        return 2
    stamp = datetime.now(timezone.utc)
    out_dir = Path(args.out) if args.out else Path.cwd() / "bench-results" / stamp.strftime("%Y%m%d-%H%M%S")

    prepare = _prepare_openai if args.backend == "openai" else _prepare_grpc
    try:
        prepared = prepare(args, api_key, dataset, tokenize)
    except prepare_errors as exc:
        msg = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"tandem bench: cannot prepare the run against {args.target}: {msg}", file=sys.stderr)
        return 1
    model, requests, rtt_ms = prepared.model, prepared.requests, prepared.rtt_ms
    metrics_url = _metrics_url(args, prepared)
    about = [v for v in (model["device"], model["dtype"]) if v]
    about.append(f"context {model['max_context']}" if model["max_context"] else "context not reported")
    print(
        f"tandem bench: {model['model_name']} on {args.target} over {args.backend} ({', '.join(about)}); "
        f"{len(requests)} requests/level, sweep {', '.join(lv.label for lv in levels)}; round trip {rtt_ms:.2f} ms",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    results = asyncio.run(_sweep(args, prepared.open_backend, levels, requests, metrics_url, rtt_ms, percentiles))
    pct = f"{percentiles[-1]:g}"
    report = {
        "meta": {
            "date": stamp.isoformat(timespec="seconds"),
            "command": "tandem bench " + shlex.join(list(argv)),
            "backend": args.backend,
            "target": args.target,
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
            "model": model,
            "workload": {
                "input_len": None if dataset is not None else args.input_len,
                "output_len": args.output_len,
                "len_dist": args.len_dist,
                "range_ratio": args.range_ratio,
                "num_requests": args.num_requests,
                "duration_s": args.duration,
                "warmup": args.warmup,
                "seed": args.seed,
                "dataset": str(Path(args.dataset).resolve()) if dataset is not None else None,
            },
            "rtt_ms": rtt_ms,
            "metrics_url": metrics_url,
            "wall_s": time.perf_counter() - t0,
        },
        "levels": results,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    written = ["results.json"]
    if not args.no_plots:
        from inference_svc.bench.plots import plot_cdf, plot_tradeoff

        name = Path(model["model_name"]).name or model["model_name"]
        shape = f"{Path(args.dataset).name} prompts" if dataset is not None else f"{args.input_len}"
        title = f"{name} · {model['device'] or args.backend} · {shape}→{args.output_len} tokens"
        written.append(plot_tradeoff(results, out_dir / "throughput_latency.png", title).name)
        written.append(plot_cdf(results, out_dir / "latency_cdf.png", title).name)
    print(format_table(results, pct))
    print(f"results: {out_dir.resolve()} ({', '.join(written)})")
    return 0 if all(lv["summary"]["completed"] > 0 for lv in results) else 1
