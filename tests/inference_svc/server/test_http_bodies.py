"""Bodies JSON allows but a request cannot hold (issue 34), against a real server on a loopback port: each gets a 400
in the OpenAI shape naming the field, never a 500 with a traceback, and the server logs a bounded amount for it;
unknown routes and methods, and a failure no route handles, answer in the same JSON shape.

Over gRPC the same inputs cannot be sent as such (protobuf strings are UTF-8 and there is no JSON): a surrogate
written in UTF-8's way (CESU bytes) is refused as INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest

from inference_svc.bounded_log import MAX_MESSAGE_CHARS, MAX_TRACEBACK_CHARS, log_failure
from inference_svc.openai_api.json_body import MAX_DEPTH
from tests.inference_svc.server.conftest import ServerThread, make_server

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
SURROGATE = '"\\ud800"'


def _with(template: str) -> str:
    """`template` with its `@` replaced by a JSON string holding a lone surrogate."""
    return template.replace("@", SURROGATE)


LOG_BOUND = 20_000
"""Characters the server may log for all the bad bodies of one test together (it logged 203 KB for one)."""


@pytest.fixture(scope="module")
def srv(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    folder = tmp_path_factory.mktemp("bodies") / "chat-model"
    shutil.copytree(bundle_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    server = make_server(folder, http_port=0, max_request_bytes=4 * 1024 * 1024)
    yield server
    server.close()


def _post(srv: ServerThread, route: str, raw: str) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{srv.server.http_port}{route}",
        content=raw.encode(),
        headers={"content-type": "application/json"},
        timeout=60,
    )


def _chat(content: str = '"hi"', role: str = '"user"', extra: str = "") -> str:
    return '{"messages": [{"role": ' + role + ', "content": ' + content + extra + '}], "max_tokens": 1}'


CASES = {
    "nested-100000-deep": ("/v1/completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "prompt"),
    "integer-5000-digits": ("/v1/completions", '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}", "max_tokens"),
    "surrogate-prompt": ("/v1/completions", _with('{"prompt": @, "max_tokens": 1}'), "prompt"),
    "surrogate-prompt-list": ("/v1/completions", _with('{"prompt": ["ok", @]}'), "prompt[1]"),
    "surrogate-content": ("/v1/chat/completions", _chat(content=SURROGATE), "messages[0].content"),
    "surrogate-role": ("/v1/chat/completions", _chat(role=SURROGATE), "messages[0].role"),
    "surrogate-model": ("/v1/completions", _with('{"prompt": "x", "model": @}'), "model"),
    "surrogate-tokenize": ("/tokenize", _with('{"prompt": @}'), "prompt"),
    "surrogate-key": ("/v1/completions", _with('{"prompt": "x", "logit_bias": {@: 1}}'), "logit_bias"),
    "extra-field-900-deep": (
        "/v1/chat/completions",
        _chat(extra=', "extra": ' + "[" * 900 + "]" * 900),
        "messages[0].extra[0]",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_bodies_get_a_400_naming_the_field_and_a_bounded_log(
    srv: ServerThread, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    route, raw, field = CASES[case]
    with caplog.at_level(logging.INFO):
        r = _post(srv, route, raw)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "INVALID_ARGUMENT", error
    assert "Traceback" not in r.text
    assert sum(len(rec.getMessage()) for rec in caplog.records) < LOG_BOUND


def test_nesting_up_to_the_limit_is_accepted(srv: ServerThread) -> None:
    deep = "[" * (MAX_DEPTH - 3) + "]" * (MAX_DEPTH - 3)
    r = _post(srv, "/v1/chat/completions", _chat(extra=', "extra": ' + deep))
    assert r.status_code == 200, r.text[:500]
    r = _post(srv, "/v1/completions", '{"prompt": "x", "max_tokens": 1, "user": "\\ud83d\\ude00"}')  # a pair: text
    assert r.status_code == 200, r.text[:500]


def test_unknown_routes_methods_and_failures_answer_json(srv: ServerThread) -> None:
    base = f"http://127.0.0.1:{srv.server.http_port}"
    r = httpx.get(base + "/v2/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"
    r = httpx.get(base + "/v1/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert "POST" in r.headers["allow"]


def test_failure_logs_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    def recurse(n: int) -> None:
        if n == 0:
            raise ValueError("x" * 100_000)  # an error quoting a huge input
        recurse(n - 1)

    try:
        recurse(500)
    except ValueError as exc:
        with caplog.at_level(logging.ERROR):
            log_failure(logging.getLogger("test"), "a request failed", exc)
    (record,) = caplog.records
    text = record.getMessage()
    assert len(text) < MAX_MESSAGE_CHARS + MAX_TRACEBACK_CHARS + 500
    assert "recurse" in text and "ValueError" in text  # still says where and what


@pytest.mark.parametrize("method,payload", [
    ("Generate", b"\x12\x03\xed\xa0\x80"),  # GenerateRequest.prompt = the UTF-8-style bytes of U+D800
    ("Tokenize", b"\x0a\x03\xed\xa0\x80"),  # TokenizeRequest.text
])  # fmt: skip
def test_grpc_refuses_a_surrogate_as_invalid_argument(srv: ServerThread, method: str, payload: bytes) -> None:
    with grpc.insecure_channel(srv.target) as channel:
        call = channel.unary_unary(f"/tandem.inference.v1.Inference/{method}")
        with pytest.raises(grpc.RpcError) as info:
            call(payload, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


# ---------------------------------------------------------------------------------------- the documented contract
def _json(srv: ServerThread, route: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{srv.server.http_port}{route}", json=body, headers=headers, timeout=60)


CONTRACT = {
    "empty-content-list": ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]},
                           "messages[0].content", "empty"),
    "bool-token-ids": ("/v1/completions", {"prompt": [True, False]}, "prompt", ""),
    "bool-token-id-lists": ("/v1/completions", {"prompt": [[1, True]]}, "prompt", ""),
    "bool-detokenize": ("/detokenize", {"tokens": [True]}, "tokens[0]", ""),
    "bool-stop-token-ids": ("/v1/completions", {"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids[0]", ""),
    "arabic-digit-key": ("/v1/completions", {"prompt": "x", "logit_bias": {"٥": 1}}, "logit_bias", "'٥'"),
    "underscore-key": ("/v1/completions", {"prompt": "x", "logit_bias": {"1_0": 1}}, "logit_bias", "'1_0'"),
    "leading-zero-key": ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1, "05": 2}}, "logit_bias", "'05'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CONTRACT))
def test_what_the_docs_refuse_is_refused(srv: ServerThread, case: str) -> None:
    route, body, field, words = CONTRACT[case]
    r = _json(srv, route, body)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == field and words in error["message"], error


def test_a_key_twice_in_one_object_is_refused(srv: ServerThread) -> None:
    r = _post(srv, "/v1/completions", '{"prompt": "x", "logit_bias": {"5": 1, "5": -100}}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text[:300]
    assert "'5' appears more than once" in r.json()["error"]["message"]
    r = _json(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1, "logit_bias": {"5": 1, "0": -1}})
    assert r.status_code == 200, r.text[:300]


def test_request_id_limit_speaks_of_what_the_client_sent(srv: ServerThread) -> None:
    body = {"prompt": ["a", "b"], "max_tokens": 1}
    r = _json(srv, "/v1/completions", body, **{"X-Request-Id": "r" * 127})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"
    message = r.json()["error"]["message"]
    assert "has 127 characters" in message and "at most 126" in message and "129" not in message
    assert _json(srv, "/v1/completions", body, **{"X-Request-Id": "r" * 126}).status_code == 200
    assert (
        _json(srv, "/v1/completions", {"prompt": "a", "max_tokens": 1}, **{"X-Request-Id": "s" * 128}).status_code
        == 200
    )


def test_min_tokens_with_every_id_a_stop_token_is_refused(srv: ServerThread) -> None:
    engine = srv.server.engine
    assert engine is not None
    vocab = engine.engine.model_config.vocab_size
    every = {"prompt": "x", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": list(range(vocab))}
    r = _json(srv, "/v1/completions", every)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text[:300]
    all_but_one = {**every, "stop_token_ids": list(range(1, vocab)), "ignore_eos": True}
    assert _json(srv, "/v1/completions", all_but_one).status_code == 200
    from inference_svc.client import NO_RETRY

    with srv.client(retry=NO_RETRY) as c, pytest.raises(grpc.RpcError) as info:
        c.generate("x", max_new_tokens=4, min_tokens=2, stop_token_ids=list(range(vocab)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in info.value.details()
