"""The OpenAI-compatible HTTP API against a real server on a loopback port, with the official `openai` SDK as the
client (sync, async, streaming), raw HTTP where the SDK hides what is tested (status codes, disconnects), and gRPC
on the same engine at the same time.

Exactness: greedy text over HTTP equals gRPC's for the same prompt, and stays so under 64 concurrent SSE streams of
which 20% disconnect mid-stream; every disconnect frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from inference_svc.client import AsyncTandemClient
from inference_svc.client_results import GenerateResult
from tests.inference_svc.server.conftest import ServerThread, engine_config, make_server, metric_value, wait_idle

PROMPT = "def read(self, size=-1):\n    "


@pytest.fixture(scope="module")
def http_server(chat_bundle: Path) -> Iterator[ServerThread]:
    srv = make_server(chat_bundle, http_port=0, metrics_port=0, engine=engine_config(kv_cache_memory="4MiB"))
    yield srv
    srv.close()


def _base(srv: ServerThread) -> str:
    return f"http://127.0.0.1:{srv.server.http_port}"


def _sdk(srv: ServerThread, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=_base(srv) + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


@pytest.fixture
def slow(http_server: ServerThread) -> Iterator[None]:
    """Test-only fault hook: 30 ms per increment of requests whose id starts with 'slow-' (X-Request-Id)."""
    engine = http_server.server.engine
    assert engine is not None
    engine.fault_hook = lambda out: time.sleep(0.03) if out.request_id.startswith("slow-") else None
    yield
    engine.fault_hook = None


def _grpc_greedy(srv: ServerThread, prompt: str | list[int], n: int) -> GenerateResult:
    with srv.client() as c:
        return c.generate(prompt, max_new_tokens=n, ignore_eos=True)


# ---------------------------------------------------------------------------------------- completions
def test_completion_equals_grpc_and_reports_usage(http_server: ServerThread) -> None:
    ref = _grpc_greedy(http_server, PROMPT, 12)
    with _sdk(http_server) as client:
        out = client.completions.create(
            model="chat-model", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
    assert out.model == "chat-model" and out.object == "text_completion"
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens and out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.usage.prompt_tokens_details is not None and out.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_concatenates_to_the_whole(http_server: ServerThread) -> None:
    with _sdk(http_server) as client:
        whole = client.completions.create(prompt=PROMPT, model="chat-model", max_tokens=10, temperature=0, seed=3)
        chunks = list(
            client.completions.create(
                prompt=PROMPT, model="chat-model", max_tokens=10, temperature=0, seed=3, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_prompt_forms_echo_and_logprobs(http_server: ServerThread) -> None:
    with http_server.client() as c:
        ids = list(c.tokenize(PROMPT).token_ids)
    with _sdk(http_server) as client:
        by_text = client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=4, temperature=0)
        by_ids = client.completions.create(model="chat-model", prompt=ids, max_tokens=4, temperature=0)
        assert by_ids.choices[0].text == by_text.choices[0].text
        two = client.completions.create(model="chat-model", prompt=[PROMPT, "import os\n"], max_tokens=4, temperature=0)
        assert [ch.index for ch in two.choices] == [0, 1]
        assert two.choices[0].text == by_text.choices[0].text
        echo = client.completions.create(
            model="chat-model", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2
        )
    choice = echo.choices[0]
    assert choice.text == PROMPT + by_text.choices[0].text
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # greedy: each generated token is its position's best, so its logprob is the top one
    for v, top in zip(lp.token_logprobs[len(ids) :], lp.top_logprobs[len(ids) :], strict=True):
        assert v == pytest.approx(max(top.values()), abs=1e-6)


def test_n_choices_and_seeds(http_server: ServerThread) -> None:
    with _sdk(http_server) as client:
        out = client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=7)
        again = client.completions.create(model="chat-model", prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [c.text for c in again.choices]
    assert out.usage is not None and out.usage.completion_tokens == 24


# ---------------------------------------------------------------------------------------- chat
def test_chat_uses_the_folder_template(http_server: ServerThread) -> None:
    from inference_svc.chat_template import ChatTemplate

    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Write a loop."}]
    engine = http_server.server.engine
    assert engine is not None
    template = ChatTemplate.from_folder(http_server.server.settings.model)
    assert template is not None
    text, ids = template.encode(messages, engine.engine.tokenizer)
    ref = _grpc_greedy(http_server, ids, 8)
    with _sdk(http_server) as client:
        out = client.chat.completions.create(
            model="chat-model", messages=messages, max_completion_tokens=8, temperature=0,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True}, logprobs=True, top_logprobs=2,
        )  # fmt: skip
        stream = client.chat.completions.create(
            model="chat-model", messages=messages, max_tokens=8, temperature=0, stream=True,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = list(stream)
    assert text.startswith("<|bos|>system: Be terse.\n")
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref.text
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 8
    assert all(len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text


def test_chat_without_template_is_a_400_saying_so(bundle_dir: Path) -> None:
    srv = make_server(bundle_dir, http_port=0)
    try:
        with _sdk(srv) as client, pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="bundle", messages=[{"role": "user", "content": "hi"}])
        assert "chat template" in info.value.message and "--chat-template" in info.value.message
        body = info.value.body
        assert isinstance(body, dict) and body.get("param") == "messages"
    finally:
        srv.close()


async def _async_chat(srv: ServerThread) -> tuple[str, str]:
    client = openai.AsyncOpenAI(base_url=_base(srv) + "/v1", api_key="unused", max_retries=0)
    try:
        msgs = [{"role": "user", "content": "hello"}]
        whole = await client.chat.completions.create(model="chat-model", messages=msgs, max_tokens=6, temperature=0)
        parts = []
        async for chunk in await client.chat.completions.create(
            model="chat-model", messages=msgs, max_tokens=6, temperature=0, stream=True
        ):
            parts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
        return whole.choices[0].message.content or "", "".join(parts)
    finally:
        await client.close()


def test_async_sdk_whole_and_streamed_agree(http_server: ServerThread) -> None:
    whole, streamed = asyncio.run(_async_chat(http_server))
    assert whole == streamed


# ---------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "logprobs": 9}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": []}, 400, "functions"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {}}, 400,
         "response_format.type"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_completion_tokens": 0}, 400,
         "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages[0].content"),
    ],
)  # fmt: skip
def test_errors_have_openai_shape_and_name_the_parameter(http_server, path, body, status, param) -> None:
    r = httpx.post(_base(http_server) + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert param.split("[")[0] in err["message"] or status == 404


def test_body_limits_and_malformed_json(bundle_dir: Path) -> None:
    srv = make_server(bundle_dir, http_port=0, max_request_bytes=4096)
    try:
        base = _base(srv)
        big = httpx.post(base + "/v1/completions", content=b'{"prompt": "' + b"x" * 8000 + b'"}', timeout=30)
        assert big.status_code == 413 and big.json()["error"]["param"] == "body"

        def chunked():  # no Content-Length: the limit is counted while reading
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}'

        streamed = httpx.post(base + "/v1/completions", content=chunked(), timeout=30)
        assert streamed.status_code == 413
        bad = httpx.post(base + "/v1/completions", content=b'{"prompt": ', timeout=30)
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
        assert httpx.post(base + "/v1/completions", json=["x"], timeout=30).status_code == 400
    finally:
        srv.close()


def test_api_keys_guard_http_like_grpc(bundle_dir: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# comment\nsecret-1\n")
    srv = make_server(bundle_dir, http_port=0, api_key_file=str(keys))
    try:
        base = _base(srv)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret-1"}):
            r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        assert httpx.get(base + "/v1/models", timeout=30).status_code == 401
        assert httpx.get(base + "/health", timeout=30).status_code == 200  # open, as gRPC health is
        with _sdk(srv, api_key="secret-1") as client:
            assert client.completions.create(model="bundle", prompt="x", max_tokens=2).usage.completion_tokens >= 1  # type: ignore[union-attr]
    finally:
        srv.close()


def test_queue_full_is_429(bundle_dir: Path) -> None:
    from inference_svc.settings import AdmissionLimits

    srv = make_server(bundle_dir, http_port=0, admission=AdmissionLimits(max_queued_requests=1))
    release, entered = threading.Event(), threading.Event()

    def park() -> None:
        entered.set()
        release.wait(30)

    try:
        assert srv.server.engine is not None
        srv.submit(srv.server.engine.run_in_engine(park))  # the engine thread is busy: nothing leaves the queue
        assert entered.wait(10)
        first = srv.submit(_post_async(_base(srv), {"prompt": "x", "max_tokens": 2}))
        deadline = time.monotonic() + 30
        while srv.server.engine.num_in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = httpx.post(_base(srv) + "/v1/completions", json={"prompt": "y", "max_tokens": 2}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
        release.set()
        assert first.result(30) == 200
    finally:
        release.set()
        srv.close()


async def _post_async(base: str, body: dict) -> int:
    async with httpx.AsyncClient(timeout=30) as c:
        return (await c.post(base + "/v1/completions", json=body)).status_code


# ---------------------------------------------------------------------------------------- operations
def test_health_models_and_metrics(http_server: ServerThread) -> None:
    base = _base(http_server)
    assert httpx.get(base + "/health", timeout=30).json() == {"status": "serving"}
    with _sdk(http_server) as client:
        models = client.models.list().data
    assert [m.id for m in models] == ["chat-model"]
    metrics = httpx.get(base + "/metrics", timeout=30)
    assert metrics.status_code == 200 and "tandem_request_errors" in metrics.text
    with http_server.client() as c:
        info = c.model_info()
    assert info.http_port == http_server.server.http_port and info.metrics_port == http_server.server.metrics_port
    assert info.model_name == "chat-model"
    # the load plan: one record, reported alike by GetModelInfo, GET /v1/models and /metrics
    plan = http_server.server.engine_info().load_plan
    card = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]
    assert card["tandem_load_plan"] == plan.as_dicts() and len(plan) >= 7
    assert [{"lever": c.lever, "value": c.value, "reason": c.reason} for c in info.load_plan] == plan.as_dicts()
    for choice in plan:
        assert metric_value(metrics.text, "tandem_load_choice", lever=choice.lever, value=choice.value) == 1


def test_health_is_503_while_draining_and_when_broken(chat_bundle: Path) -> None:
    srv = make_server(chat_bundle, http_port=0)
    base = _base(srv)
    release, entered = threading.Event(), threading.Event()

    def park() -> None:
        entered.set()
        release.wait(30)

    try:
        assert srv.server.engine is not None
        srv.submit(srv.server.engine.run_in_engine(park))  # the engine thread is parked: the request stays in flight
        assert entered.wait(10)
        in_flight = srv.submit(_post_async(base, {"prompt": "x", "max_tokens": 2}))
        deadline = time.monotonic() + 30
        while srv.server.engine.num_in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        stopping = srv.submit(srv.server.shutdown(30.0))
        while httpx.get(base + "/health", timeout=30).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = httpx.get(base + "/health", timeout=30)
        assert r.status_code == 503 and r.json() == {"status": "draining"}
        r = httpx.post(base + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "UNAVAILABLE"
        release.set()
        assert in_flight.result(30) == 200  # the in-flight request finished within the grace period
        assert stopping.result(30) == 0
    finally:
        release.set()
        srv.close()


def test_a_broken_engine_turns_health_off_without_polling(chat_bundle: Path) -> None:
    srv = make_server(chat_bundle, http_port=0)
    try:
        engine = srv.server.engine
        assert engine is not None

        def boom() -> list:
            raise RuntimeError("injected step failure")

        engine.engine.step = boom  # every step fails: after three in a row the engine is declared broken
        r = httpx.post(_base(srv) + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
        deadline = time.monotonic() + 30
        while srv.server.lifecycle.state.value != "broken" and time.monotonic() < deadline:
            time.sleep(0.01)
        health = httpx.get(_base(srv) + "/health", timeout=30)
        assert health.status_code == 503 and health.json() == {"status": "broken"}
        with srv.client() as c:
            assert c.health() == "NOT_SERVING"
    finally:
        srv.close()


def test_disconnect_mid_stream_frees_blocks(http_server: ServerThread, slow) -> None:
    before = http_server.stats().generation_tokens_total
    body = {"prompt": PROMPT, "max_tokens": 60, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", _base(http_server) + "/v1/completions", json=body, headers={"X-Request-Id": "slow-sse"}) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert http_server.stats().kv_blocks_used > 0
    st = wait_idle(http_server)  # closing the response closed the connection: the request is aborted
    assert st.generation_tokens_total - before < 60, "the request ran to its end instead of being aborted"


def test_disconnect_of_a_whole_request_frees_blocks(http_server: ServerThread, slow) -> None:
    before = http_server.stats().generation_tokens_total
    body = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(_base(http_server) + "/v1/completions", json=body, headers={"X-Request-Id": "slow-whole"},
                   timeout=httpx.Timeout(30, read=0.3))  # fmt: skip
    st = wait_idle(http_server)
    assert st.generation_tokens_total - before < 60, "the request ran to its end instead of being aborted"


def test_deadline_ends_a_stream_with_an_error_event(http_server: ServerThread, slow) -> None:
    before = http_server.stats().generation_tokens_total
    body = {"prompt": PROMPT, "max_tokens": 60, "stream": True, "ignore_eos": True, "timeout": 0.4}
    with (
        httpx.Client(timeout=30) as c,
        c.stream(
            "POST", _base(http_server) + "/v1/completions", json=body, headers={"X-Request-Id": "slow-deadline"}
        ) as r,
    ):
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "DEADLINE_EXCEEDED" and err["type"] == "timeout"
    assert wait_idle(http_server).generation_tokens_total - before < 60


# ---------------------------------------------------------------------------------------- load
LOAD_PROMPTS = ["import os\nimport sys\n\ndef main(argv):\n    ", "class Queue:\n    def __init__(self):\n        ",
                "for i in range(10):\n    print(", "try:\n    import json\nexcept ImportError:\n    "]  # fmt: skip


def test_64_sse_streams_with_disconnects_and_grpc_alongside(http_server: ServerThread) -> None:
    rng = random.Random(99)
    max_new = {i: 8 + 3 * i for i in range(len(LOAD_PROMPTS))}
    alone = {i: _grpc_greedy(http_server, p, max_new[i]).text for i, p in enumerate(LOAD_PROMPTS)}
    kinds = ["disconnect"] * 13 + ["normal"] * 51
    rng.shuffle(kinds)
    plan = [(k, rng.randrange(len(LOAD_PROMPTS)), rng.randint(1, 4)) for k in kinds]

    async def one(client: openai.AsyncOpenAI, kind: str, p: int, cut: int) -> tuple[str, str]:
        text, chunks = "", 0
        stream = await client.completions.create(
            model="chat-model", prompt=LOAD_PROMPTS[p], max_tokens=max_new[p], temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            chunks += 1
            if kind == "disconnect" and chunks >= cut:
                await stream.close()  # drops the connection mid-stream
                return "disconnected", text
        return "done", text

    async def grpc_side() -> list[str]:
        async with AsyncTandemClient(http_server.target, timeout=120) as c:
            outs = []
            for i, p in enumerate(LOAD_PROMPTS):
                text = ""
                async for msg in c.generate_stream(p, max_new_tokens=max_new[i], ignore_eos=True):
                    text += msg.text
                outs.append(text)
            return outs

    async def main() -> tuple[list[tuple[str, str]], list[str]]:
        client = openai.AsyncOpenAI(base_url=_base(http_server) + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            http = asyncio.gather(*(one(client, *args) for args in plan))
            return await asyncio.gather(http, grpc_side())
        finally:
            await client.close()

    results, grpc_texts = asyncio.run(main())
    for (kind, p, _), (outcome, text) in zip(plan, results, strict=True):
        if kind == "normal":
            assert outcome == "done" and text == alone[p], (p, text, alone[p])
        else:
            assert alone[p].startswith(text), (p, text, alone[p])
    assert grpc_texts == [alone[i] for i in range(len(LOAD_PROMPTS))]
    wait_idle(http_server)


# ---------------------------------------------------------------------------------------- hostile clients
def test_a_stalled_body_gets_408_and_the_server_goes_on(bundle_dir: Path) -> None:
    import socket

    srv = make_server(bundle_dir, http_port=0, http_body_timeout=0.5)
    try:
        with socket.create_connection(("127.0.0.1", srv.server.http_port), timeout=30) as sock:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(head + b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')  # 11 of 100 bytes, then silence
            reply = b""
            while b"\r\n\r\n" not in reply:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        ok = httpx.post(_base(srv) + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert ok.status_code == 200
    finally:
        srv.close()


def test_a_prompt_longer_than_the_context_is_refused_before_tokenizing(http_server: ServerThread) -> None:
    engine = http_server.server.engine
    assert engine is not None
    gate = engine._tokenizer_gate
    before = gate.encoded_chars
    text = "x" * (engine.max_prompt_chars + 1)
    r = httpx.post(_base(http_server) + "/v1/completions", json={"prompt": text}, timeout=60)
    assert r.status_code == 400 and "refused before tokenizing" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"
    chat = {"messages": [{"role": "user", "content": text}]}
    r = httpx.post(_base(http_server) + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert gate.encoded_chars == before  # nothing reached the tokenizer


def test_tokenize_and_detokenize_routes(http_server: ServerThread) -> None:
    base = _base(http_server)
    with http_server.client() as c:
        ids = list(c.tokenize(PROMPT).token_ids)
    r = httpx.post(base + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] > 0
    assert httpx.post(base + "/detokenize", json={"tokens": ids}, timeout=30).json() == {"prompt": PROMPT}
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30).json()
    engine = http_server.server.engine
    assert engine is not None
    assert chat["tokens"] == engine.engine.tokenizer.encode("<|bos|>user: hi\nassistant:")
    bad = httpx.post(base + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
