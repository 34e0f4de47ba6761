"""Perplexity through the engine: the windows of `shared_model.evaluate`, scored by prompt logprobs over gRPC or
the OpenAI-compatible HTTP API of a running service, or by an `Engine` in this process (`evaluate_engine`).

Contract:
- `evaluate_grpc(target, windows, tokenizer)` sends each window as `prompt_token_ids` with `prompt_logprobs = 0`
  and `max_new_tokens = 1`; `evaluate_http(base_url, windows, tokenizer)` sends it to `/v1/completions` with
  `echo: true, logprobs: 0, max_tokens: 1`. Both sum -log p of each window's scored tokens, so with the same
  windows they return an `EvalResult` with the same tokens and bytes as `evaluate_offline` and an NLL that
  differs only by the server's arithmetic (fp32 serving: within 1e-4 relative; the wire carries fp32 logprobs).
- At most `concurrency` windows are in flight at once; a failed window fails the evaluation with the server's
  error (nothing is averaged over a partial set).
- A window must fit the server's context with one generated token: `max_context - 1` tokens at most
  (`GetModelInfo.max_context`), checked before anything is sent.
- `evaluate_engine(engine, windows, tokenizer)` asks the same of an in-process `Engine` (its own settings:
  `--kv-cache-dtype`, `--dtype`, ...), all windows at once through `Engine.generate`, and also returns the
  model's top-1 token at every scored position (teacher-forced greedy choices, which
  `benchmarks/kv_dtype_quality.py` compares across K/V dtypes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from shared_model.evaluate import EvalResult, Window, score_bytes


def evaluate_engine(engine: Any, ws: Sequence[Window], tokenizer: Any) -> tuple[EvalResult, list[int]]:
    """The windows scored by an in-process `Engine`'s prompt logprobs; (result, the top-1 token the model gives
    each scored position, window after window)."""
    from inference_svc.engine.types import SamplingParams

    check_fits(ws, engine.max_model_len)
    results = engine.generate([w.ids for w in ws], SamplingParams(max_new_tokens=1, prompt_logprobs=1))
    nll = 0.0
    top1: list[int] = []
    for w, r in zip(ws, results, strict=True):
        entries = r.prompt_logprobs[w.first_scored :]  # one per prompt token, the first None: [j] scores token j
        nll -= sum(e.logprob for e in entries)
        top1 += [e.top[0][0] for e in entries]
    return _result(nll, ws, tokenizer), top1


async def _bounded(ws: Sequence[Window], score: Callable[[int, Window], Awaitable[float]], concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, w: Window) -> float:
        async with gate:
            return await score(i, w)

    return sum(await asyncio.gather(*(one(i, w) for i, w in enumerate(ws))))


def _result(nll: float, ws: Sequence[Window], tokenizer: Any) -> EvalResult:
    return EvalResult(nll, sum(len(w.scored) for w in ws), score_bytes(tokenizer, ws), len(ws))


def check_fits(ws: Sequence[Window], max_context: int) -> None:
    longest = max((len(w.ids) for w in ws), default=0)
    if longest > max_context - 1:
        raise ValueError(f"eval windows of {longest} tokens do not fit the server's context of {max_context} tokens "
                         f"(with one generated token): use --window {max_context - 1} or less")  # fmt: skip


async def evaluate_grpc(
    target: str, ws: Sequence[Window], tokenizer: Any, *, concurrency: int = 4, client_kwargs: dict | None = None
) -> EvalResult:
    from inference_svc.client import AsyncTandemClient

    async with AsyncTandemClient(target, timeout=600, **(client_kwargs or {})) as client:
        check_fits(ws, (await client.model_info()).max_context)

        async def score(i: int, w: Window) -> float:
            r = await client.generate(w.ids, max_new_tokens=1, prompt_logprobs=0, request_id=f"eval-{i}")
            entries = r.prompt_logprobs  # one per prompt token after the first: entries[j] is token j + 1
            return -sum(e.logprob for e in entries[w.first_scored - 1 :])

        return _result(await _bounded(ws, score, concurrency), ws, tokenizer)


async def evaluate_http(
    base_url: str,
    ws: Sequence[Window],
    tokenizer: Any,
    *,
    concurrency: int = 4,
    api_key: str | None = None,
    max_context: int | None = None,
) -> EvalResult:
    import httpx2 as httpx

    if max_context is not None:
        check_fits(ws, max_context)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=600, headers=headers) as http:

        async def score(i: int, w: Window) -> float:
            body = {"prompt": w.ids, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
            r = await http.post("/v1/completions", json=body, headers={"X-Request-Id": f"eval-http-{i}"})
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.json().get('error', {}).get('message', r.text)}")
            lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]  # prompt tokens (first None), then one more
            return -sum(lps[w.first_scored : len(w.ids)])

        return _result(await _bounded(ws, score, concurrency), ws, tokenizer)
