"""`tandem serve` and `tandem generate` (called by `shared_model.cli` with the remaining argv; return exit codes).

Contract:
- `serve_main` parses flags (the model folder positional, as `vllm serve DIR`, or `--model`; both given and
  different is an error; no flag is taken by a prefix of its name, so `--api-key` never means `--api-key-file`)
  into `ServerSettings` + `EngineConfig` (an invalid value exits 2 naming the flag), binds
  the gRPC port (loopback unless --host says otherwise; health NOT_SERVING while the model loads), and once the
  model is loaded and warmed up prints `tandem serve: listening on HOST:PORT` and `tandem serve: SERVING ...`.
  /metrics binds `--metrics-host` (loopback by default), never `--host` implicitly. IPv6 hosts are taken with or
  without brackets (`::1`, `[::1]`) and printed as `[::1]:PORT`.
  A gRPC or metrics address that cannot be bound prints one line `tandem serve: gRPC|metrics: cannot listen on
  HOST:PORT: <reason>` on stderr (no traceback) and exits 1.
  It runs until SIGTERM or SIGINT, which drain gracefully (see `TandemServer.shutdown`).
  Exit code 0 after a drain, 1 if the model fails to load.
  `--dtype auto` means the folder's own dtype on GPU and float32 on CPU.
- Flags are parsed before torch is imported: `build_serve_config` puts `--omp-wait`'s policy in the environment
  first (`set_omp_wait`), before the OpenMP runtime starts (`inference_svc.engine` imports its engine lazily, and
  nothing before that line imports torch).
- `tandem generate` lives in `generate_cli`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from inference_svc.dataclass_flags import FlagSpec, add_flags, from_args
from inference_svc.engine.config import (
    ATTENTION_BACKENDS,
    COMPILE_MODES,
    CPU_KERNEL_MODES,
    DECODE_RUNNER_MODES,
    INT4_KERNELS,
    KV_CACHE_DTYPES,
    OMP_WAIT_POLICIES,
    THREAD_GOVERNOR_MODES,
    EngineConfig,
)
from inference_svc.errors import InferenceError
from inference_svc.openai_api.reasoning import REASONING_PARSERS
from inference_svc.settings import (
    METRIC_NAMES,
    AdmissionLimits,
    HttpLimits,
    OpenAIApiSettings,
    ScaleOutSettings,
    ServerSettings,
    host_port,
)
from shared_model.ledger import INT4_GROUP_SIZES, QUANTIZATIONS

log = logging.getLogger("tandem.serve")

ENGINE_FLAGS = FlagSpec(
    names={
        "max_num_seqs": ["--max-running"],
        "max_num_batched_tokens": ["--max-batched-tokens"],
        "max_new_tokens_limit": ["--max-new-tokens"],
        "enable_prefix_caching": ["--prefix-caching"],
        "enable_chunked_prefill": ["--chunked-prefill"],
    },
    choices={
        "dtype": ["auto", "float32", "bfloat16", "float16"],
        "attention_backend": ATTENTION_BACKENDS,
        "kv_cache_dtype": KV_CACHE_DTYPES,
        "compile": COMPILE_MODES,
        "cpu_kernels": CPU_KERNEL_MODES,
        "decode_runner": DECODE_RUNNER_MODES,
        "int4_kernel": INT4_KERNELS,
        "omp_wait": OMP_WAIT_POLICIES,
        "thread_governor": THREAD_GOVERNOR_MODES,
        "quantization": QUANTIZATIONS,
        "quantization_group_size": INT4_GROUP_SIZES,
    },
)
"""Every `EngineConfig` field is a `tandem serve` flag (`dataclass_flags`); these keep the names the flags had
before they were derived (the dataclass's own spelling, e.g. `--max-num-seqs`, is an alias)."""

SERVER_DERIVED = frozenset({"access_log"})
"""The `ServerSettings` fields whose flags are derived from the dataclass (the others are declared below)."""
HTTP_FLAGS = FlagSpec(
    names={
        "max_connections": ["--http-max-connections"],
        "max_connections_per_client": ["--http-max-connections-per-client"],
        "head_timeout": ["--http-head-timeout"],
    }
)
"""`HttpLimits` fields as `tandem serve` flags (the connection bounds spelled with the `--http-` prefix)."""
SCALE_OUT_FLAGS = FlagSpec(choices={"metrics_names": METRIC_NAMES})
"""Every `ScaleOutSettings` field is a `tandem serve` flag (`--metrics-names`, ...)."""
OPENAI_API_FLAGS = FlagSpec(choices={"reasoning_parser": REASONING_PARSERS})
"""Every `OpenAIApiSettings` field is a `tandem serve` flag (`--strict-request-fields`, ...)."""


# ---------------------------------------------------------------------------------------- serve
def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem serve",
        description="Serve a model over gRPC (tandem.inference.v1) and the OpenAI-compatible HTTP API.",
        allow_abbrev=False,  # a prefix is never another flag: --api-key is not --api-key-file
    )
    p.add_argument(
        "model_path", nargs="?", default=None, metavar="MODEL", help="the model folder (as `vllm serve DIR`)"
    )
    p.add_argument("--model", default=None, help="Tandem bundle or Hugging Face Llama/Qwen2/Qwen3 folder")
    p.add_argument("--host", default="127.0.0.1", help="gRPC interface to bind, IPv4 or IPv6 (default: loopback)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    p.add_argument(
        "--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API port on --host (0: any free)"
    )
    p.add_argument("--no-http", action="store_true", help="do not serve the HTTP API")
    p.add_argument(
        "--served-model-name", default=None, help="the model's name in requests and responses (default: folder name)"
    )
    p.add_argument("--chat-template", default=None, help="Jinja chat template file (default: the folder's own)")
    p.add_argument(
        "--tool-call-parser", default=None, choices=("hermes", "llama3_json"),
        help="read tool calls from chat output in this format (hermes: Qwen2.5/Qwen3 and Hermes <tool_call> JSON; "
        "llama3_json: Llama 3.1 JSON calls); default: tool calls are not parsed, tool_choice must be 'none'",
    )  # fmt: skip
    p.add_argument(
        "--http-body-timeout", type=float, default=30.0, help="seconds an HTTP request body may take to arrive (408)"
    )
    p.add_argument("--metrics-port", type=int, default=9464, help="Prometheus /metrics port (0: any free port)")
    p.add_argument(
        "--metrics-host", default="127.0.0.1", help="/metrics interface to bind, apart from --host (default: loopback)"
    )
    p.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    add_flags(p.add_argument_group("engine (inference_svc.engine.config.EngineConfig)"), EngineConfig, ENGINE_FLAGS)
    add_flags(p.add_argument_group("HTTP limits (inference_svc.settings.HttpLimits)"), HttpLimits, HTTP_FLAGS)
    add_flags(p.add_argument_group("scale-out (inference_svc.settings.ScaleOutSettings)"), ScaleOutSettings,
              SCALE_OUT_FLAGS)  # fmt: skip
    add_flags(p.add_argument_group("OpenAI API (inference_svc.settings.OpenAIApiSettings)"), OpenAIApiSettings,
              OPENAI_API_FLAGS)  # fmt: skip
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-queue", type=int, default=256, help="most requests waiting for their first token")
    lim.add_argument("--max-queue-tokens", type=int, default=262144, help="most prompt tokens waiting, summed")
    lim.add_argument(
        "--max-tokenizing-chars",
        type=int,
        default=AdmissionLimits.max_tokenizing_chars,
        help="most characters of long texts being tokenized at once; more gets RESOURCE_EXHAUSTED",
    )
    lim.add_argument(
        "--burst-window-ms",
        type=float,
        default=AdmissionLimits.burst_window_ms,
        help="an idle engine's first step also takes the requests that follow within this many ms of each other "
        "(at most 20 windows in all): a burst is prefilled in one step; 0 starts at the first request",
    )
    lim.add_argument("--max-request-bytes", type=int, default=1024 * 1024, help="largest serialized request")
    lim.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    sec = p.add_argument_group("security")
    sec.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key: serve TLS only)")
    sec.add_argument("--tls-key", default=None, help="PEM private key")
    sec.add_argument("--api-key-file", default=None, help="file with one API key per line")
    sec.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="an API key (repeatable; with --api-key-file, any key of either is accepted). It shows in the process "
        "list: prefer --api-key-file where others share the machine",
    )
    p.add_argument("--no-warmup", action="store_true", help="report SERVING without a warm-up request")
    skip = frozenset(f.name for f in dataclasses.fields(ServerSettings)) - SERVER_DERIVED
    add_flags(p.add_argument_group("logging"), ServerSettings, FlagSpec(skip=skip))
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _resolve_dtype(dtype: str, device: str) -> str:
    """'auto': the folder's own dtype on GPU, float32 on CPU (half precision is slow there)."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    if device == "auto":
        import torch

        return "auto" if torch.cuda.is_available() else "float32"
    return "auto"


def build_serve_config(argv: Sequence[str]) -> tuple[ServerSettings, Any, argparse.Namespace]:
    """Parse `tandem serve` flags; raises SystemExit(2) with the flag named on an invalid value."""
    parser = _serve_parser()
    args = parser.parse_args(list(argv))
    if args.model is not None and args.model_path is not None and args.model != args.model_path:
        parser.error(f"the model folder is given twice, differently: {args.model_path!r} and --model {args.model!r}")
    args.model = args.model or args.model_path
    if args.model is None:
        parser.error("a model folder is required: tandem serve DIR (or --model DIR)")
    try:
        set_omp_wait(args.threads, args.omp_wait)  # first: resolving --dtype auto may import torch
        settings = ServerSettings(
            model=args.model,
            host=args.host,
            port=args.port,
            metrics_port=None if args.no_metrics else args.metrics_port,
            metrics_host=args.metrics_host,
            http_port=None if args.no_http else args.http_port,
            served_model_name=args.served_model_name,
            chat_template=args.chat_template,
            tool_call_parser=args.tool_call_parser,
            http_body_timeout=args.http_body_timeout,
            http=from_args(HttpLimits, args),
            admission=AdmissionLimits(
                max_queued_requests=args.max_queue,
                max_queued_tokens=args.max_queue_tokens,
                max_tokenizing_chars=args.max_tokenizing_chars,
                burst_window_ms=args.burst_window_ms,
            ),
            max_request_bytes=args.max_request_bytes,
            shutdown_grace=args.shutdown_grace,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            api_key_file=args.api_key_file,
            api_keys=tuple(args.api_key),
            warmup=not args.no_warmup,
            **{name: getattr(args, name) for name in SERVER_DERIVED},
            scale_out=from_args(ScaleOutSettings, args),
            openai_api=from_args(OpenAIApiSettings, args),
        )
        engine_config = from_args(EngineConfig, args, dtype=_resolve_dtype(args.dtype, args.device))
        clash = [name for name, _ in engine_config.lora_module_dirs if name == settings.model_name]
        if clash:
            parser.error(f"lora_modules: the adapter name {clash[0]!r} is the served model's name; choose another")
    except (InferenceError, ValueError) as exc:
        parser.error(str(exc))
    return settings, engine_config, args


def set_omp_wait(threads_flag: int | str, omp_wait: str) -> None:
    """Put `--omp-wait`'s policy (for `--threads`) in this process's environment, where the OpenMP runtime reads it
    when torch loads it (`inference_svc.executor.threads`); the engine records what is in effect. A no-op once
    torch was imported; `EngineConfigError` naming the flag on a bad value."""
    config = EngineConfig(threads=threads_flag, omp_wait=omp_wait)  # validated as the engine's config will be
    if "torch" in sys.modules or (omp_wait == "auto" and {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ)):
        return  # too late, or the user's own setting (the engine reports it)
    from inference_svc.executor import threads

    sample = threads.LOAD_SAMPLE_SECONDS if omp_wait == "auto" else 0.0
    policy = threads.choose_threads(config.threads, config.omp_wait, threads.read_cpu_facts(load_sample=sample))
    os.environ.update(threads.omp_environment(policy))


async def _serve(settings: ServerSettings, engine_config: Any, fault_hook: Any = None) -> int:
    from inference_svc.server import TandemServer

    server = TandemServer(settings, engine_config, fault_hook=fault_hook)
    loop = asyncio.get_running_loop()
    shutdown_task: list[asyncio.Task] = []

    def on_signal(signame: str) -> None:
        if not shutdown_task:
            log.info("%s: draining (grace %.1f s)", signame, settings.shutdown_grace)
            print(f"tandem serve: {signame}, draining", flush=True)
            shutdown_task.append(asyncio.ensure_future(server.shutdown()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        await server.start()
    except (InferenceError, OSError) as exc:  # model load failure, port in use
        print(f"tandem serve: {exc}", file=sys.stderr, flush=True)
        await server.shutdown(0)
        return 1
    if not shutdown_task:
        info = server.engine_info()
        assert info is not None  # started and not shutting down: the engine exists
        print(f"tandem serve: listening on {host_port(settings.host, server.port)}", flush=True)
        if server.http_port is not None:
            print(f"tandem serve: HTTP API on http://{host_port(settings.host, server.http_port)}/v1", flush=True)
        print(
            f"tandem serve: SERVING {settings.model} (dtype {info.dtype}, attention {info.attention_backend}, KV "
            f"capacity {info.kv_capacity_tokens} tokens in {info.kv_cache_dtype}, metrics port {server.metrics_port})",
            flush=True,
        )
    await server.wait_for_termination()
    print("tandem serve: stopped", flush=True)
    return 0


def serve_main(argv: Sequence[str], *, fault_hook: Any = None) -> int:
    """`tandem serve`. `fault_hook` is the engine's test-only hook (see `AsyncEngine`); the CLI never sets it."""
    settings, engine_config, args = build_serve_config(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve(settings, engine_config, fault_hook))


# ---------------------------------------------------------------------------------------- generate
