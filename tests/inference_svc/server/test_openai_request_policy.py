"""The OpenAI API's lenient request policy (request_policy.py) and vLLM's `continuous_usage_stats`, against a real
server on a loopback port with the official `openai` SDK and raw HTTP.

- Fields the SDK sends that change nothing here (`store`, `metadata`, `service_tier`, `reasoning_effort`) are
  accepted; an unknown field is ignored and named once in the log per name, not per request; vLLM fields that
  would change the output at a value other than Tandem's (`use_beam_search: true`) are refused naming the field;
  `--strict-request-fields` restores the 400 for unknown fields.
- guidellm's request shape (streaming with `stream_options: {include_usage, continuous_usage_stats}`) gets usage
  in every chunk, counting up to the final usage chunk's figures.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from inference_svc.errors import InvalidRequestError
from inference_svc.openai_api import request_policy
from inference_svc.openai_api.request_policy import RequestPolicy
from tests.inference_svc.server.conftest import ServerThread, make_server

MESSAGES = [{"role": "user", "content": "def read(self, size=-1):"}]


@pytest.fixture(scope="module")
def http_server(chat_bundle: Path) -> Iterator[ServerThread]:
    srv = make_server(chat_bundle, http_port=0)
    yield srv
    srv.close()


def _base(srv: ServerThread) -> str:
    return f"http://127.0.0.1:{srv.server.http_port}"


def _sdk(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=_base(srv) + "/v1", api_key="unused", max_retries=0)


def _policy_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tandem.request_policy"]


# ---------------------------------------------------------------------------------------- the policy, unit-wise
def test_unknown_names_are_logged_once_per_name_and_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    policy = RequestPolicy(interval=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "tandem.request_policy"):
        for _ in range(5):
            policy.unknown(["frobnicate", "stream_options.x"])
        policy.unknown(["other"])
        assert _policy_warnings(caplog) == [
            "ignored request fields this server does not know: 'frobnicate'; 'stream_options.x'",
            "ignored request fields this server does not know: 'other'",
        ]
        now[0] = 61.0
        policy.unknown(["frobnicate"])
        assert _policy_warnings(caplog)[-1].endswith("'frobnicate' (sent by 5 requests since)")
        assert len(_policy_warnings(caplog)) == 3


def test_tracked_names_are_bounded(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_policy, "MAX_TRACKED_NAMES", 3)
    policy = RequestPolicy(interval=60.0, clock=lambda: 0.0)
    with caplog.at_level(logging.WARNING, "tandem.request_policy"):
        for i in range(10):
            policy.unknown([f"f{i}"])
    lines = _policy_warnings(caplog)
    assert len(lines) == 4  # three names, then one line for everything beyond them
    assert "beyond the 3 names tracked" in lines[-1]
    assert len(policy._seen) == 3


def test_strict_refuses_and_default_only_fields_refuse_other_values() -> None:
    with pytest.raises(InvalidRequestError) as err:
        RequestPolicy(strict=True).unknown(["frobnicate"])
    assert err.value.field == "frobnicate"
    policy = RequestPolicy()
    assert policy.prepare({"prompt"}, {"prompt": "x", "store": True, "use_beam_search": False}) == {"prompt": "x"}
    assert policy.prepare({"prompt"}, {"prompt": "x", "length_penalty": 1}) == {"prompt": "x"}
    assert policy.prepare({"prompt"}, {"prompt": "x", "bad_words": [], "cache_salt": None}) == {"prompt": "x"}
    assert policy.prepare({"prompt"}, {"prompt": "x", "modalities": ["text"]}) == {"prompt": "x"}
    for field, value in [("bad_words", ["x"]), ("cache_salt", "tenant-a"), ("allowed_token_ids", [1, 2]),
                         ("modalities", ["text", "audio"])]:  # fmt: skip
        with pytest.raises(InvalidRequestError) as err:
            policy.prepare({"prompt"}, {"prompt": "x", field: value})
        assert err.value.field == field
    with pytest.raises(InvalidRequestError) as err:
        policy.prepare({"prompt"}, {"prompt": "x", "use_beam_search": True})
    assert err.value.field == "use_beam_search"
    # a field the model declares itself is the model's, not the policy's (/tokenize's add_special_tokens)
    assert policy.prepare({"add_special_tokens"}, {"add_special_tokens": True}) == {"add_special_tokens": True}


# ---------------------------------------------------------------------------------------- over HTTP
def test_sdk_fields_that_change_nothing_are_accepted(http_server: ServerThread) -> None:
    with _sdk(http_server) as client:
        plain = client.chat.completions.create(model="chat-model", messages=MESSAGES, max_tokens=6, temperature=0)
        hinted = client.chat.completions.create(
            model="chat-model", messages=MESSAGES, max_tokens=6, temperature=0, store=True,
            metadata={"team": "a"}, service_tier="auto", reasoning_effort="low", user="u1",
            prompt_cache_key="k", modalities=["text"], extra_body={"priority": 3, "skip_special_tokens": True},
        )  # fmt: skip
        assert hinted.choices[0].message.content == plain.choices[0].message.content
        done = client.completions.create(
            model="chat-model", prompt="x", max_tokens=2, user="u1", extra_body={"store": True, "metadata": {}}
        )
    assert done.choices[0].text is not None


def test_unknown_fields_are_ignored_and_logged_once(http_server: ServerThread, caplog) -> None:
    url = _base(http_server) + "/v1/completions"
    body = {"prompt": "x", "max_tokens": 3, "temperature": 0, "frobnicate": {"a": 1},
            "stream_options": None, "zz_unknown_once": 1}  # fmt: skip
    with caplog.at_level(logging.WARNING, "tandem.request_policy"):
        first = httpx.post(url, json=body, timeout=30)
        second = httpx.post(url, json=body, timeout=30)
        streamed = {"prompt": "x", "max_tokens": 3, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True, "zz_nested": 1}}  # fmt: skip
        nested = httpx.post(url, json=streamed, timeout=30)
    assert first.status_code == second.status_code == nested.status_code == 200, (first.text, nested.text)
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    lines = [line for line in _policy_warnings(caplog) if "zz_unknown_once" in line]
    assert len(lines) == 1 and "'frobnicate'" in lines[0]
    assert any("'stream_options.zz_nested'" in line for line in _policy_warnings(caplog))
    assert nested.text.rstrip().endswith("data: [DONE]")


def test_default_only_fields_at_another_value_are_refused(http_server: ServerThread) -> None:
    url = _base(http_server) + "/v1/chat/completions"
    for field, value in [("use_beam_search", True), ("include_stop_str_in_output", True), ("echo", True),
                         ("chat_template", "{{ 1 }}")]:  # fmt: skip
        r = httpx.post(url, json={"messages": MESSAGES, field: value}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field


def test_strict_request_fields_refuses_unknown_fields(chat_bundle: Path) -> None:
    from inference_svc.settings import OpenAIApiSettings

    srv = make_server(chat_bundle, http_port=0, openai_api=OpenAIApiSettings(strict_request_fields=True))
    try:
        url = _base(srv) + "/v1/completions"
        r = httpx.post(url, json={"prompt": "x", "frobnicate": 1}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
        r = httpx.post(url, json={"prompt": "x", "stream": True, "stream_options": {"zz": 1}}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.zz"
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 2, "store": False, "metadata": {}}, timeout=30)
        assert r.status_code == 200, r.text  # known and ignored, strict or not
    finally:
        srv.close()


def _events(response: httpx.Response) -> list[dict]:
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_request_shape_gets_usage_in_every_chunk(http_server: ServerThread, route: str) -> None:
    """guidellm 0.8's default request: stream with include_usage and continuous_usage_stats (and no model)."""
    body: dict = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                  "max_tokens": 12, "ignore_eos": True, "temperature": 0}  # fmt: skip
    body.update({"prompt": "def read(self, size=-1):"} if route == "/v1/completions" else {"messages": MESSAGES})
    r = httpx.post(_base(http_server) + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    events = _events(r)
    assert events and all("usage" in e and e["usage"] is not None for e in events), events
    final = events[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    running = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert running == sorted(running) and running[-1] == 12
    assert all(e["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"] for e in events)
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
               for e in events)  # fmt: skip
    # without continuous_usage_stats only the last chunk has usage (OpenAI's include_usage)
    body["stream_options"] = {"include_usage": True}
    plain = _events(httpx.post(_base(http_server) + route, json=body, timeout=60))
    assert [("usage" in e) for e in plain] == [False] * (len(plain) - 1) + [True]


def test_inter_token_latency_counts_every_gap_of_a_stream(chat_bundle: Path) -> None:
    """guidellm's ITL and Tandem's agree only if Tandem observes every gap: 12 tokens one per step, 11 gaps (the
    last increment, which also finishes the request, included)."""
    from tests.inference_svc.server.conftest import metric_value

    srv = make_server(chat_bundle, http_port=0, metrics_port=0)
    try:
        url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"

        def gaps() -> float:
            text = httpx.get(url, timeout=30).text
            return metric_value(text, "tandem_inter_token_latency_seconds_count", model_name="chat-model")

        before = gaps()
        body = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "max_tokens": 12, "ignore_eos": True, "temperature": 0, "prompt": "x",
                "num_speculative_tokens": 0}  # fmt: skip
        r = httpx.post(_base(srv) + "/v1/completions", json=body, timeout=60)
        assert _events(r)[-1]["usage"]["completion_tokens"] == 12
        assert gaps() - before == 11
    finally:
        srv.close()
