"""`tandem generate`: one completion from a running Tandem server, streamed to the terminal.

Contract:
- `tandem generate PROMPT` streams the completion to stdout over gRPC as it is generated, then prints TTFT
  (client-side, from send to the first token, and the server's own), time per output token and usage to stderr.
  `PROMPT` `-` reads the prompt from stdin (all of it, as text).
- `--logprobs N` asks for each token's log-probability and its N best alternatives (0: the chosen token only) and
  prints them to stderr after the summary, by token id (with the token's text when its message held one token);
  `--json` prints one JSON object instead of the streamed text
  (text, token ids, finish reason, matched stop, usage, timing, client-side latencies and the logprobs).
- `--chat` sends the prompt as one user message (after `--system` when given) through the model's chat template:
  over the server's OpenAI-compatible HTTP API, whose port GetModelInfo reports; a server without HTTP, or a
  model without a chat template, is one line on stderr.
- Exit 0 on success, 1 with the status code (or HTTP status) and message on a server error.
- `stream_completion` is the function behind it, for scripts (e.g. the demo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem generate", description="Stream one completion from a Tandem server.")
    p.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    p.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of the server (gRPC)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, metavar="N", help="log-probabilities, N alternatives each")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of the call in seconds")
    p.add_argument("--tls", action="store_true", help="use TLS (system roots unless --tls-ca)")
    p.add_argument("--tls-ca", default=None, help="PEM file of the CA (or self-signed cert) to trust")
    p.add_argument("--tls-server-name", default=None, help="expected server name in its certificate")
    p.add_argument("--api-key-file", default=None, help="file whose first key is sent as the API key")
    p.add_argument("--api-key-env", default="TANDEM_API_KEY", help="environment variable holding the API key")
    return p


def _summary_line(s: dict[str, Any]) -> str:
    return (
        f"--- finish: {s['finish_reason']} | TTFT {s['ttft_ms']:.1f} ms (server {s['server_ttft_ms']:.1f} ms, "
        f"queue {s['server_queue_ms']:.1f} ms) | time per output token {s['tpot_ms']:.1f} ms "
        f"(server {s['server_tpot_ms']:.1f} ms) | total {s['total_ms']:.1f} ms\n"
        f"--- usage: prompt {s['prompt_tokens']} tokens ({s['cached_prompt_tokens']} cached), "
        f"completion {s['completion_tokens']} tokens\n"
    )


def _logprob_lines(entries: list[dict[str, Any]]) -> str:
    """One line per generated token: id, its text when known, logprob, then the alternatives' ids and logprobs."""
    lines = []
    for e in entries:
        text = f" {e['text']!r}" if "text" in e else ""
        alts = ", ".join(f"{a['token_id']} {a['logprob']:.3f}" for a in e.get("top", []))
        lines.append(
            f"--- token {e['token_id']}{text} logprob {e['logprob']:.3f}" + (f" | top: {alts}" if alts else "")
        )
    return "\n".join(lines) + ("\n" if lines else "")


def stream_completion(
    target: str,
    prompt: str,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    timeout: float = 120.0,
    client_kwargs: dict[str, Any] | None = None,
    as_json: bool = False,
    **sampling: Any,
) -> dict[str, Any]:
    """Stream `prompt`'s completion to `out` (or, `as_json`, print one JSON object), then the latency and usage
    summary to `err`; return the figures."""
    from inference_svc.client import TandemClient

    out = out or sys.stdout
    err = err or sys.stderr
    texts: list[str] = []
    tokens: list[int] = []
    logprobs: list[dict[str, Any]] = []
    with TandemClient(target, timeout=timeout, **(client_kwargs or {})) as client:
        t0 = time.perf_counter()
        first: float | None = None
        last = None
        for msg in client.generate_stream(prompt, **sampling):
            if msg.token_ids and first is None:
                first = time.perf_counter()
            tokens += msg.token_ids
            texts.append(msg.text)
            tops = msg.top_logprobs or [None] * len(msg.logprobs)
            for tok, lp, entry in zip(msg.token_ids, msg.logprobs, tops, strict=False):
                record: dict[str, Any] = {"token_id": tok, "logprob": lp}
                if len(msg.token_ids) == 1:
                    record["text"] = msg.text  # one token in this message: its text (empty mid-character)
                if entry is not None:
                    record["top"] = [{"token_id": t, "logprob": v} for t, v in entry.top]
                logprobs.append(record)
            if not as_json:
                out.write(msg.text)
                out.flush()
            last = msg
        t_end = time.perf_counter()
    assert last is not None and last.timing is not None and last.usage is not None  # the last chunk carries them
    n_tokens = len(tokens)
    summary: dict[str, Any] = {
        "finish_reason": last.finish_reason.name if last.finish_reason is not None else "UNSPECIFIED",
        "stop_reason": last.stop_reason,
        "ttft_ms": ((first or t_end) - t0) * 1000,
        "tpot_ms": (t_end - first) * 1000 / (n_tokens - 1) if first is not None and n_tokens > 1 else 0.0,
        "server_ttft_ms": last.timing.ttft_ms,
        "server_tpot_ms": last.timing.tpot_ms,
        "server_queue_ms": last.timing.queue_ms,
        "total_ms": (t_end - t0) * 1000,
        "prompt_tokens": last.usage.prompt_tokens,
        "completion_tokens": last.usage.completion_tokens,
        "cached_prompt_tokens": last.usage.cached_prompt_tokens,
    }
    if as_json:
        whole = {"text": "".join(texts), "token_ids": tokens, **summary}
        if logprobs:
            whole["logprobs"] = logprobs
        out.write(json.dumps(whole, ensure_ascii=False) + "\n")
    else:
        out.write("\n")
    err.write(_summary_line(summary))
    if logprobs and not as_json:
        err.write(_logprob_lines(logprobs))
    err.flush()
    return summary


def chat_completion(
    target: str,
    messages: list[dict[str, str]],
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    timeout: float = 120.0,
    client_kwargs: dict[str, Any] | None = None,
    api_key: str | None = None,
    as_json: bool = False,
    **sampling: Any,
) -> dict[str, Any]:
    """`messages` through the server's chat template, streamed from its HTTP API (found through GetModelInfo)."""
    import httpx2 as httpx

    from inference_svc.client import TandemClient

    out = out or sys.stdout
    err = err or sys.stderr
    kwargs = client_kwargs or {}
    with TandemClient(target, timeout=timeout, **kwargs) as client:
        info = client.model_info()
    if not info.http_port:
        raise ChatUnavailable("the server does not serve its HTTP API (started with --no-http): --chat needs it")
    host = target.rsplit(":", 1)[0]
    scheme = "https" if kwargs.get("tls") else "http"
    body: dict[str, Any] = {"model": info.model_name, "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0}  # fmt: skip
    for key, value in sampling.items():
        if value not in (None, [], ()):
            body[{"max_new_tokens": "max_completion_tokens"}.get(key, key)] = value
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    verify: Any = True
    if kwargs.get("root_certificates"):
        import ssl

        verify = ssl.create_default_context(cadata=kwargs["root_certificates"].decode())
    texts: list[str] = []
    usage: dict[str, Any] = {}
    finish = None
    t0 = time.perf_counter()
    first = None
    with (
        httpx.Client(timeout=timeout, verify=verify) as http,
        http.stream(
            "POST", f"{scheme}://{host}:{info.http_port}/v1/chat/completions", json=body, headers=headers
        ) as response,
    ):
        if response.status_code != 200:
            response.read()
            raise ChatFailed(response.status_code, response.json().get("error", {}).get("message", response.text))
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise ChatFailed(200, event["error"]["message"])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                delta = choice.get("delta", {}).get("content") or ""
                if delta and first is None:
                    first = time.perf_counter()
                texts.append(delta)
                finish = choice.get("finish_reason") or finish
                if delta and not as_json:
                    out.write(delta)
                    out.flush()
    t_end = time.perf_counter()
    n = usage.get("completion_tokens", 0)
    summary = {
        "finish_reason": (finish or "unspecified").upper(),
        "ttft_ms": ((first or t_end) - t0) * 1000,
        "tpot_ms": (t_end - first) * 1000 / (n - 1) if first is not None and n > 1 else 0.0,
        "total_ms": (t_end - t0) * 1000,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": n,
        "cached_prompt_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
    }
    if as_json:
        out.write(json.dumps({"text": "".join(texts), **summary}, ensure_ascii=False) + "\n")
    else:
        out.write("\n")
    err.write(
        f"--- finish: {summary['finish_reason']} | TTFT {summary['ttft_ms']:.1f} ms | total "
        f"{summary['total_ms']:.1f} ms\n--- usage: prompt {summary['prompt_tokens']} tokens "
        f"({summary['cached_prompt_tokens']} cached), completion {n} tokens\n"
    )
    return summary


class ChatUnavailable(Exception):
    pass


class ChatFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")


def generate_main(argv: Sequence[str]) -> int:
    import grpc

    from inference_svc.settings import read_api_keys

    args = generate_parser().parse_args(list(argv))
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    api_key = os.environ.get(args.api_key_env) or None
    if args.api_key_file:
        api_key = read_api_keys(args.api_key_file)[0].decode()
    root = None
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            root = f.read()
    client_kwargs = {
        "api_key": api_key,
        "tls": args.tls or root is not None,
        "root_certificates": root,
        "tls_server_name": args.tls_server_name,
    }
    sampling: dict[str, Any] = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "seed": args.seed,
        "repetition_penalty": args.repetition_penalty,
        "stop": args.stop,
        "stop_token_ids": args.stop_token_id,
        "ignore_eos": args.ignore_eos or None,
    }
    try:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            if args.logprobs is not None:
                sampling.update(logprobs=True, top_logprobs=args.logprobs)
            chat_completion(args.target, messages, timeout=args.timeout, client_kwargs=client_kwargs,
                            api_key=api_key, as_json=args.json, **sampling)  # fmt: skip
        else:
            if args.logprobs is not None:
                sampling.update(logprobs=True, top_logprobs=args.logprobs or None)
            stream_completion(args.target, prompt, timeout=args.timeout, client_kwargs=client_kwargs,
                              as_json=args.json, **sampling)  # fmt: skip
    except grpc.RpcError as exc:
        print(f"\ntandem generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (ChatUnavailable, ChatFailed) as exc:
        print(f"\ntandem generate: {exc}", file=sys.stderr)
        return 1
    return 0
