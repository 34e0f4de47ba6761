"""`tandem bench --backend openai`: the same workload and report against any OpenAI-compatible server (Tandem's
HTTP API, vLLM, llama.cpp's server), over streamed `/v1/completions`.

Contract:
- `base_urls(target)` takes the base URL (`http://HOST:PORT`, with or without a trailing `/v1`, https too) and
  returns (root, api): `/health` and `/tokenize` live under root, `/v1/models` and `/v1/completions` under api.
  Anything but an http(s) URL is a `ValueError`.
- `OpenAIServer` (blocking, for the set-up): `wait_ready(wait)` polls `GET /health` until 200 (a server without
  `/health`, answering 404, is ready when `GET /v1/models` answers 200) and returns the URL the RTT probe will use;
  `models()` lists the model cards of `/v1/models`; `tokenize(text)` uses the server's `/tokenize` route (vLLM's
  `{"prompt"}` body, else llama.cpp's `{"content"}`) and raises `OpenAIError` when it has none. Failures raise
  `OpenAIError` (or `TimeoutError` from `wait_ready`) with the URL and the server's message.
- `OpenAIBackend` (async; a `loadgen.Backend`): `send(spec, timeout, request_id)` POSTs one streamed completion —
  `model`, `prompt` (the token ids as a list of ints, or a dataset's text), `max_tokens`, `temperature` 0 (greedy,
  as the gRPC path), `ignore_eos: true` (vLLM's extra; a server without it may stop early, and the record holds the
  tokens actually received), `stream: true`, `stream_options.include_usage` — with `X-Request-Id: request_id`.
  Times are taken on the client's monotonic clock as the gRPC path takes them from stream messages: TTFT at the
  first SSE event that carries a token (a choice with text, or any choice not yet finished: a token whose text is
  still held back is a token), ITL between such events, e2e at the stream's end. Output tokens are the final usage
  chunk's `completion_tokens` (the number of token events when the server sends no usage); for a text prompt,
  prompt tokens are its `prompt_tokens`. Never raises for a failed request: an HTTP error records the error's `code`
  when it is a status name (Tandem's are gRPC's, so a refusal reads as it does over gRPC), else `HTTP_<status>`;
  an error event mid-stream likewise (`STREAM_ERROR` without a code); a dropped connection `UNAVAILABLE`; the
  level's deadline `DEADLINE_EXCEEDED` (the stream is closed, so the server aborts the request); a stream that ends
  with neither `[DONE]` nor a finish reason `INCOMPLETE`. No retries.
- The API key, when given, goes as `Authorization: Bearer KEY` on every request. The connection pool is unbounded
  (one connection per request in flight, kept alive), HTTP/1.1, and ignores proxy settings from the environment:
  the benchmark measures the server, not a proxy.
- HTTP goes through `httpx2` (the package the `openai` SDK installs as its HTTP client), or `httpx` when that is
  what is installed: the same API.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

try:
    import httpx2 as httpx
except ImportError:  # the classic package: the same API
    import httpx  # type: ignore[no-redef]

from inference_svc.bench.loadgen import RequestRecord
from inference_svc.bench.workload import RequestSpec

_STATUS_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


class OpenAIError(RuntimeError):
    """The set-up against the server failed (models, tokenize): the message says which URL and why."""


def base_urls(target: str) -> tuple[str, str]:
    """(root, api) of a base URL given with or without its trailing `/v1`."""
    parts = urlsplit(target.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--target must be an http(s) base URL such as http://127.0.0.1:8000, got {target!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    root = f"{parts.scheme}://{parts.netloc}{path}"
    return root, root + "/v1"


def verify_option(ca_file: str | None) -> ssl.SSLContext | bool:
    """TLS verification: the system's roots, or only the CA in `ca_file`."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else True


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_of(obj: Any) -> dict[str, Any] | None:
    """The error object of a JSON body or SSE event: OpenAI's `{"error": {...}}` or vLLM's older flat shape."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("error"), dict):
        return obj["error"]
    if isinstance(obj.get("error"), str):
        return {"message": obj["error"]}
    if obj.get("object") == "error":
        return obj
    return None


def _status_of(err: dict[str, Any] | None, fallback: str) -> tuple[str, str]:
    """(status, detail) of an error object: its `code` when that is a status name, else `fallback`."""
    if err is None:
        return fallback, ""
    code = err.get("code")
    status = code if isinstance(code, str) and _STATUS_NAME.fullmatch(code) else fallback
    return status, str(err.get("message") or err)[:200]


def _describe(resp: Any) -> str:
    """'HTTP 401: <message>' of a non-200 response."""
    try:
        err = _error_of(resp.json())
    except ValueError:
        err = None
    message = (err or {}).get("message") or resp.text[:200]
    return f"HTTP {resp.status_code}" + (f": {message}" if message else "")


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(type(t) is int for t in value):
        return value
    return None


class OpenAIServer:
    """Blocking calls of the set-up: readiness, model cards, tokenizing the corpus."""

    def __init__(self, target: str, *, api_key: str | None = None, verify: ssl.SSLContext | bool = True) -> None:
        self.root, self.api = base_urls(target)
        self.http = httpx.Client(headers=_headers(api_key), verify=verify, timeout=60.0, trust_env=False)
        self._tokenize_body: str | None = None

    def __enter__(self) -> OpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def wait_ready(self, wait: float) -> str:
        """Wait until the server answers ready; return the URL for the RTT probe (`/health`, or `/v1/models`)."""
        deadline = time.monotonic() + wait
        last = ""
        while True:
            try:
                r = self.http.get(self.root + "/health", timeout=5.0)
                if r.status_code == 200:
                    return self.root + "/health"
                last = f"GET {self.root}/health: {_describe(r)}"
                if r.status_code == 404:
                    m = self.http.get(self.api + "/models", timeout=5.0)
                    if m.status_code == 200:
                        return self.api + "/models"
                    last = f"GET {self.api}/models: {_describe(m)}"
                    if m.status_code in (401, 403):
                        raise OpenAIError(last)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.root} was not ready within {wait:g} s ({last})")
            time.sleep(0.25)

    def models(self) -> list[dict[str, Any]]:
        url = self.api + "/models"
        try:
            r = self.http.get(url)
        except httpx.HTTPError as exc:
            raise OpenAIError(f"GET {url}: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise OpenAIError(f"GET {url}: {_describe(r)}")
        try:
            cards = [c for c in r.json().get("data", []) if isinstance(c, dict) and isinstance(c.get("id"), str)]
        except (ValueError, AttributeError):
            raise OpenAIError(f"GET {url}: not a model list: {r.text[:200]}") from None
        if not cards:
            raise OpenAIError(f"GET {url}: the server lists no model")
        return cards

    def tokenize(self, text: str, model: str | None = None) -> list[int]:
        """Token ids of `text` (no special tokens added) from the server's `/tokenize`."""
        url = self.root + "/tokenize"
        bodies = {
            "vllm": {"model": model, "prompt": text, "add_special_tokens": False},
            "llama.cpp": {"content": text, "add_special": False},
        }
        order = [self._tokenize_body] if self._tokenize_body else list(bodies)
        why = ""
        for shape in order:
            try:
                r = self.http.post(url, json=bodies[shape])
            except httpx.HTTPError as exc:
                raise OpenAIError(f"POST {url}: {type(exc).__name__}: {exc}") from None
            ids = None
            if r.status_code == 200:
                try:
                    ids = _ids(r.json().get("tokens"))
                except (ValueError, AttributeError):
                    ids = None
            if ids is not None and (ids or not text):
                self._tokenize_body = shape
                return ids
            why = _describe(r) if r.status_code != 200 else "no token ids in the answer"
        raise OpenAIError(
            f"POST {url}: {why}; this server cannot tokenize the corpus for token-id prompts: pass --tokenizer "
            "(a tokenizer.json or the model's folder) or --dataset FILE (text prompts)"
        )


class OpenAIBackend:
    """Streamed `/v1/completions` requests, timed on the client (a `loadgen.Backend`)."""

    name = "openai"

    def __init__(
        self,
        target: str,
        model: str,
        *,
        api_key: str | None = None,
        verify: ssl.SSLContext | bool = True,
        health_url: str | None = None,
    ) -> None:
        self.root, self.api = base_urls(target)
        self.model = model
        self.completions_url = self.api + "/completions"
        self.health_url = health_url or self.root + "/health"
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(
            headers=_headers(api_key), verify=verify, timeout=httpx.Timeout(None), limits=limits, trust_env=False
        )

    async def __aenter__(self) -> OpenAIBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def health(self, timeout: float = 5.0) -> object:
        return (await self.http.get(self.health_url, timeout=timeout)).status_code

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def send(self, spec: RequestSpec, timeout: float, request_id: str = "") -> RequestRecord:
        """Stream one completion; never raises for a failed request (it is recorded in `status`)."""
        rec = RequestRecord.starting(spec)
        try:
            await asyncio.wait_for(self._stream(spec, rec, request_id), max(0.001, timeout))
        except asyncio.TimeoutError:
            rec.status, rec.detail = "DEADLINE_EXCEEDED", f"not finished within {timeout:.1f} s"
        except httpx.HTTPError as exc:
            rec.status, rec.detail = "UNAVAILABLE", f"{type(exc).__name__}: {exc}"[:200]
        rec.end = time.perf_counter()
        return rec

    async def _stream(self, spec: RequestSpec, rec: RequestRecord, request_id: str) -> None:
        headers = {"X-Request-Id": request_id} if request_id else None
        async with self.http.stream("POST", self.completions_url, json=self.body(spec), headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                try:
                    err = _error_of(resp.json())
                except ValueError:
                    err = {"message": resp.text}
                rec.status, rec.detail = _status_of(err, f"HTTP_{resp.status_code}")
                return
            events = 0
            usage: dict[str, Any] | None = None
            done = finished = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    rec.status, rec.detail = "STREAM_ERROR", f"not JSON: {data[:180]}"
                    return
                err = _error_of(obj)
                if err is not None:
                    rec.status, rec.detail = _status_of(err, "STREAM_ERROR")
                    return
                for choice in obj.get("choices") or ():
                    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                        continue
                    reason = choice.get("finish_reason")
                    if choice.get("text") or reason is None:
                        if rec.first_token is None:
                            rec.first_token = now
                        rec.token_times.append(now)
                        events += 1
                    finished = finished or reason is not None
                if isinstance(obj.get("usage"), dict):
                    usage = obj["usage"]
        completion = (usage or {}).get("completion_tokens")
        rec.output_tokens = completion if type(completion) is int else events
        prompt = (usage or {}).get("prompt_tokens")
        if spec.prompt_text is not None and type(prompt) is int:
            rec.prompt_tokens = prompt
        if not done and not finished:
            rec.status, rec.detail = "INCOMPLETE", "the stream ended before its finish reason and data: [DONE]"
