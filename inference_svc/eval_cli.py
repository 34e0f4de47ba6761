"""`tandem eval`: held-out perplexity and bits per byte of a model folder, offline and through a running service.

Contract:
- `tandem eval --model DIR` scores the held-out text (by default the validation split of the default corpus,
  which no training run on it ever sees; `--data FILE ...` for your own files) with `shared_model` in fp32, over the
  windows `shared_model.evaluate.windows` cuts (non-overlapping `--window` tokens, or a sliding `--stride`),
  at most `--max-tokens` tokens of text.
- `--target HOST:PORT` also scores the same windows through that server's prompt logprobs: over gRPC, over its
  OpenAI-compatible HTTP API (`--protocol http`; the port comes from GetModelInfo), or both. The table shows
  each path's perplexity, bits per byte and its relative difference from the offline figure; `--json` prints them
  as one object. The window defaults to the model's positions, capped at 512 and at the server's context − 1.
- `--kv-cache-dtype auto|fp32|bf16|fp16|fp8|int8` (`EngineConfig.kv_cache_dtype`) also scores them through an
  in-process engine (path "engine": fp32 weights on CPU, the torch attention path) whose K/V cache is stored in
  that dtype, so the table shows what the K/V format costs in perplexity (`--kv-cache-memory` sizes its pool).
- Exit 0 on success, 2 on a bad argument (one line), 1 when the server fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_WINDOW_CAP = 512
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8", "int8")
"""`inference_svc.engine.config.KV_CACHE_DTYPES` (repeated so `--help` imports no torch; a test pins the two)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem eval", description="Held-out perplexity and bits per byte of a model.")
    p.add_argument("--model", required=True, help="Tandem bundle or Hugging Face Llama/Qwen2/Qwen3 folder")
    p.add_argument("--data", nargs="+", default=None, help="text files to score (default: the held-out corpus)")
    p.add_argument("--target", default=None, help="HOST:PORT of a server of the same model (gRPC)")
    p.add_argument("--protocol", default="grpc", choices=["grpc", "http", "both"], help="path to the server")
    p.add_argument("--window", type=int, default=None, help="tokens per window (default: min(positions, 512))")
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride (default: non-overlapping)")
    p.add_argument("--max-tokens", type=int, default=8192, help="score at most this many tokens of text")
    p.add_argument("--api-key-file", default=None, help="file whose first key is sent as the API key")
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=KV_CACHE_DTYPES,
        help="also score through an in-process engine with its K/V cache stored in this dtype",
    )
    p.add_argument("--kv-cache-memory", default="256MiB", help="that engine's KV-cache budget (with --kv-cache-dtype)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _texts(paths: Sequence[str] | None) -> list[str]:
    from shared_model.evaluate import heldout_texts

    if not paths:
        return heldout_texts()
    texts = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ValueError(f"--data: {p} is not a file")
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"--data: {p} is not UTF-8 text") from None
    return texts


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from inference_svc.evaluation import evaluate_grpc, evaluate_http
    from shared_model.bundle import load_bundle
    from shared_model.evaluate import evaluate_offline, text_windows

    bundle = load_bundle(args.model, dtype=torch.float32)
    if bundle.tokenizer is None:
        raise ValueError(f"--model: {args.model} has no tokenizer.json")
    key = None
    if args.api_key_file:
        from inference_svc.settings import read_api_keys

        key = read_api_keys(args.api_key_file)[0].decode()
    info = None
    if args.target:
        from inference_svc.client import TandemClient

        with TandemClient(args.target, timeout=60, api_key=key) as c:
            info = c.model_info()
    window = args.window or min(bundle.config.max_position_embeddings, DEFAULT_WINDOW_CAP)
    if info is not None and args.window is None:
        window = min(window, info.max_context - 1)
    texts = _texts(args.data)
    ws = text_windows(bundle.tokenizer, texts, window, args.stride, args.max_tokens)
    t0 = time.perf_counter()
    offline = evaluate_offline(bundle.model.eval(), bundle.tokenizer, texts, window, args.stride, args.max_tokens)
    results: dict[str, Any] = {"window": window, "stride": args.stride, "offline": offline.as_dict()}
    results["offline"]["seconds"] = time.perf_counter() - t0
    if args.kv_cache_dtype is not None:
        t0 = time.perf_counter()
        res = _evaluate_engine(args, ws, bundle.tokenizer)
        entry = res.as_dict()
        entry["seconds"] = time.perf_counter() - t0
        entry["kv_cache_dtype"] = args.kv_cache_dtype
        entry["relative_difference"] = abs(res.perplexity - offline.perplexity) / offline.perplexity
        results["engine"] = entry
    if info is not None:
        paths = ["grpc", "http"] if args.protocol == "both" else [args.protocol]
        for path in paths:
            t0 = time.perf_counter()
            if path == "grpc":
                res = asyncio.run(evaluate_grpc(args.target, ws, bundle.tokenizer, client_kwargs={"api_key": key}))
            else:
                if not info.http_port:
                    raise ValueError("--protocol http: the server does not serve its HTTP API (--no-http)")
                host = args.target.rsplit(":", 1)[0]
                base = f"http://{host}:{info.http_port}"
                res = asyncio.run(evaluate_http(base, ws, bundle.tokenizer, api_key=key, max_context=info.max_context))
            entry = res.as_dict()
            entry["seconds"] = time.perf_counter() - t0
            entry["relative_difference"] = abs(res.perplexity - offline.perplexity) / offline.perplexity
            results[path] = entry
    return results


def _evaluate_engine(args: argparse.Namespace, ws: Sequence[Any], tokenizer: Any) -> Any:
    from inference_svc.engine import Engine, EngineConfig
    from inference_svc.engine.config import EngineConfigError
    from inference_svc.evaluation import evaluate_engine

    try:
        config = EngineConfig(
            dtype="float32", device="cpu", kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_cache_memory
        )
    except EngineConfigError as exc:
        raise ValueError(f"--{exc.field.replace('_', '-')}: {exc}") from None
    return evaluate_engine(Engine.from_bundle(args.model, config), ws, tokenizer)[0]


def _table(results: dict[str, Any]) -> str:
    rows = [f"{'path':<8} {'perplexity':>12} {'bits/byte':>10} {'tokens':>8} {'bytes':>9} {'vs offline':>11} {'s':>7}"]
    for path in ("offline", "engine", "grpc", "http"):
        r = results.get(path)
        if r is None:
            continue
        diff = "" if path == "offline" else f"{r['relative_difference']:.2e}"
        rows.append(f"{path:<8} {r['perplexity']:>12.4f} {r['bits_per_byte']:>10.4f} {r['tokens']:>8} {r['bytes']:>9} "
                    f"{diff:>11} {r['seconds']:>7.1f}")  # fmt: skip
    stride = "non-overlapping" if results["stride"] is None else f"stride {results['stride']}"
    return f"windows of {results['window']} tokens, {stride}\n" + "\n".join(rows)


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    args = parser.parse_args(list(argv))
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2")
    from shared_model.errors import SharedModelError

    try:
        results = run(args)
    except (ValueError, SharedModelError) as exc:
        print(f"tandem eval: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a server failure: one line, never a traceback
        code = getattr(exc, "code", None)
        name = code().name if callable(code) else type(exc).__name__
        details = exc.details() if hasattr(exc, "details") else str(exc)  # type: ignore[union-attr]
        print(f"tandem eval: {name}: {details}", file=sys.stderr)
        return 1
    print(json.dumps(results) if args.json else _table(results))
    return 0
