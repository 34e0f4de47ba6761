"""Structured outputs over HTTP (the official `openai` SDK) and gRPC against a real server on a loopback port, from
a random-weight model: `response_format` json_schema (parsed by the SDK and validated with `jsonschema`) and
json_object, vLLM's `structured_outputs` (choice, regex, EBNF grammar), streaming, `n` > 1, and the 400 /
INVALID_ARGUMENT naming the parameter for a grammar the server cannot compile."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import grpc
import openai
import pydantic
import pytest

from inference_svc.proto_gen import inference_pb2 as pb
from tests.inference_svc.server.conftest import ServerThread, engine_config, make_server

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "rain": {"type": "boolean"},
        "level": {"enum": ["low", "mid", "high"]},
    },
    "required": ["city", "rain", "level"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Weather in Paris as JSON?"}]


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    rain: bool
    level: Literal["low", "mid", "high"]


@pytest.fixture(scope="module")
def http_server(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    folder = tmp_path_factory.mktemp("structured") / "chat-model"
    shutil.copytree(bundle_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    srv = make_server(
        folder, http_port=0, engine=engine_config(kv_cache_memory="8MiB", max_new_tokens_limit=256, max_model_len=512)
    )
    yield srv
    srv.close()


def _sdk(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server.http_port}/v1", api_key="unused", max_retries=0)


def test_sdk_parse_with_a_pydantic_model_validates(http_server: ServerThread) -> None:
    with _sdk(http_server) as client:
        out = client.chat.completions.parse(
            model="chat-model", messages=MESSAGES, response_format=Weather, max_completion_tokens=200, n=3,
            temperature=1.0, seed=5,
        )  # fmt: skip
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Weather)
        jsonschema.validate(json.loads(choice.message.content), Weather.model_json_schema())


def test_json_schema_and_json_object_unary_and_streamed(http_server: ServerThread) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    with _sdk(http_server) as client:
        unary = client.chat.completions.create(
            model="chat-model", messages=MESSAGES, response_format=fmt, max_completion_tokens=200, temperature=0
        )
        jsonschema.validate(json.loads(unary.choices[0].message.content), SCHEMA)
        stream = client.chat.completions.create(
            model="chat-model",
            messages=MESSAGES,
            response_format=fmt,
            max_completion_tokens=200,
            temperature=0,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == unary.choices[0].message.content
        close = http_server.server.engine.engine.tokenizer.encode("}")[0]  # biased up: the object closes early
        anyobj = client.chat.completions.create(
            model="chat-model", messages=MESSAGES, response_format={"type": "json_object"}, max_completion_tokens=200,
            temperature=0, logit_bias={str(close): 30},
        )  # fmt: skip
        assert anyobj.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(anyobj.choices[0].message.content), dict)
        plain = client.chat.completions.create(
            model="chat-model", messages=MESSAGES, response_format={"type": "text"}, max_completion_tokens=5,
            temperature=0, logit_bias={str(close): 30},
        )  # fmt: skip
        assert plain.choices[0].message.content == "}" * 5  # "text" constrains nothing


def test_structured_outputs_choice_regex_grammar_on_completions(http_server: ServerThread) -> None:
    choices = ["alpha", "beta", "gamma delta"]
    regex = r"[A-Z][a-z]{1,4} [0-9]{2}"
    ebnf = 'root ::= item ("," item)?\nitem ::= "x" | "y" | "[" [0-9] "]"'
    with _sdk(http_server) as client:
        out = client.completions.create(
            model="chat-model", prompt="Pick one:", max_tokens=30, n=4, temperature=1.0, seed=1,
            extra_body={"structured_outputs": {"choice": choices}},
        )  # fmt: skip
        assert all(c.text in choices for c in out.choices), [c.text for c in out.choices]
        out = client.completions.create(
            model="chat-model", prompt="Code:", max_tokens=30, n=4, temperature=1.0, seed=2,
            extra_body={"structured_outputs": {"regex": regex}},
        )  # fmt: skip
        assert all(re.fullmatch(regex, c.text) for c in out.choices), [c.text for c in out.choices]
        out = client.chat.completions.create(
            model="chat-model", messages=MESSAGES, max_completion_tokens=30, n=3, temperature=1.0, seed=3,
            extra_body={"structured_outputs": {"grammar": ebnf}},
        )  # fmt: skip
        pattern = r"(x|y|\[[0-9]\])(,(x|y|\[[0-9]\]))?"
        assert all(re.fullmatch(pattern, c.message.content) for c in out.choices), out.choices
        out = client.completions.create(
            model="chat-model",
            prompt="Pick:",
            max_tokens=30,
            extra_body={"guided_choice": ["on", "off"]},
            temperature=0,
        )
        assert out.choices[0].text in ("on", "off")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
         "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": 'root ::= "a" missing'}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "structured_outputs.regex"),
    ],
)  # fmt: skip
def test_an_uncompilable_or_ambiguous_constraint_is_a_400_naming_it(
    http_server: ServerThread, body: dict, param: str
) -> None:
    with _sdk(http_server) as client, pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="chat-model", messages=MESSAGES, max_completion_tokens=8, extra_body=body)
    assert err.value.param == param, err.value.body
    with _sdk(http_server) as client:  # the server still serves
        assert client.completions.create(model="chat-model", prompt="x", max_tokens=2).choices[0].text is not None


def test_grpc_structured_output(http_server: ServerThread) -> None:
    with http_server.client() as c:
        so = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
        out = c.generate("Weather:", max_new_tokens=200, temperature=1.0, seed=4, n=2, structured_output=so)
        texts = [ch.text for ch in out.choices] if out.choices else [out.text]
        assert len(texts) == 2
        for t in texts:
            jsonschema.validate(json.loads(t), SCHEMA)
        choice = pb.StructuredOutput(choice=pb.ChoiceList(choices=["red", "green"]))
        assert c.generate("Colour:", max_new_tokens=10, structured_output=choice).text in ("red", "green")
        with pytest.raises(grpc.RpcError) as err:
            c.generate("x", max_new_tokens=4, structured_output=pb.StructuredOutput(regex="(unclosed"))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_output" in (err.value.details() or "")


def test_n_completions_are_what_single_requests_give(http_server: ServerThread) -> None:
    """Each of n constrained completions owns its grammar state: completion i of a seeded request equals a single
    request with seed + i, and greedy completions all equal the single greedy answer."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    kw = dict(model="chat-model", messages=MESSAGES, response_format=fmt, max_completion_tokens=200)
    with _sdk(http_server) as client:
        many = client.chat.completions.create(**kw, n=3, temperature=1.0, seed=10)
        singles = [client.chat.completions.create(**kw, temperature=1.0, seed=10 + i) for i in range(3)]
        assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
        greedy = client.chat.completions.create(**kw, n=2, temperature=0)
        one = client.chat.completions.create(**kw, temperature=0)
    assert [c.message.content for c in greedy.choices] == [one.choices[0].message.content] * 2
