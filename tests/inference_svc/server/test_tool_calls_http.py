"""Tool calling on /v1/chat/completions against a real server on a loopback port, with the official `openai` SDK
and a random-weight model, under templates written for these tests after Qwen3's (hermes `<tool_call>` blocks) and
Llama 3.1's (JSON calls) published tool formats: forced calls (`tool_choice` required or a named function) whose
arguments validate against the function's schema, streamed `delta.tool_calls` that reassemble to the unary answer,
tool results rendered through the template, and the 400s for a tool choice the server cannot honour."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from inference_svc.chat_template import ChatTemplate
from inference_svc.openai_api import tool_calls
from tests.inference_svc.server.conftest import ServerThread, engine_config, make_server

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

QWEN3_STYLE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% continue %}
{%- elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for tc in m.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA31_STYLE = """\
<|start_header_id|>system<|end_header_id|>

Environment: ipython
{% if tools %}Given the following functions, please respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use \
variables.

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{% endif %}<|eot_id|>
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for tc in m.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}\
{% endfor %}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
    "required": ["hour", "loud"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
MESSAGES = [{"role": "user", "content": "Is it raining in Paris?"}]


def _server(bundle_dir: Path, tmp: Path, template: str, parser: str) -> ServerThread:
    folder = tmp / "tool-model"
    shutil.copytree(bundle_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return make_server(
        folder, http_port=0, tool_call_parser=parser,
        engine=engine_config(kv_cache_memory="8MiB", max_new_tokens_limit=256, max_model_len=2048),
    )  # fmt: skip


@pytest.fixture(scope="module")
def hermes(long_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    srv = _server(long_bundle, tmp_path_factory.mktemp("hermes"), QWEN3_STYLE, "hermes")
    yield srv
    srv.close()


def _sdk(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server.http_port}/v1", api_key="unused", max_retries=0)


def _check_calls(calls, only: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert only is None or call.function.name == only
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_validate(hermes: ServerThread, parallel: bool) -> None:
    with _sdk(hermes) as client:
        out = client.chat.completions.create(
            model="tool-model", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=3, temperature=1.0,
            seed=2, max_completion_tokens=250, parallel_tool_calls=parallel,
        )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        _check_calls(choice.message.tool_calls)
        assert parallel or len(choice.message.tool_calls) == 1
        assert choice.message.content is None


def test_named_function_is_the_one_called(hermes: ServerThread) -> None:
    named = {"type": "function", "function": {"name": "set_alarm"}}
    with _sdk(hermes) as client:
        out = client.chat.completions.create(
            model="tool-model", messages=MESSAGES, tools=TOOLS, tool_choice=named, n=2, temperature=1.0, seed=4,
            max_completion_tokens=250,
        )  # fmt: skip
    for choice in out.choices:
        _check_calls(choice.message.tool_calls, only="set_alarm")


def test_streamed_tool_call_deltas_reassemble_to_the_unary_answer(hermes: ServerThread) -> None:
    kw = dict(model="tool-model", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0,
              max_completion_tokens=250)  # fmt: skip
    with _sdk(hermes) as client:
        unary = client.chat.completions.create(**kw).choices[0]
        calls: dict[int, dict] = {}
        content, finish = "", None
        for chunk in client.chat.completions.create(**kw, stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                for d in c.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
                finish = c.finish_reason or finish
    assert finish == unary.finish_reason == "tool_calls"
    assert content.strip() == (unary.message.content or "")
    assert [calls[i] for i in sorted(calls)] == [
        {"name": t.function.name, "arguments": t.function.arguments} for t in unary.message.tool_calls
    ]


def test_tool_round_trip_renders_through_the_template(hermes: ServerThread) -> None:
    history = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"rain": false}'},
    ]  # fmt: skip
    as_objects = [dict(m) for m in history]  # transformers passes arguments as objects; the server converts them
    as_objects[1] = {**history[1], "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]}  # fmt: skip
    text = ChatTemplate(QWEN3_STYLE).render(as_objects, with_tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert '<tool_response>\n{"rain": false}\n</tool_response>' in text
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    with _sdk(hermes) as client:
        out = client.chat.completions.create(
            model="tool-model", messages=history, tools=TOOLS, tool_choice="auto", temperature=0,
            max_completion_tokens=8,
        )  # fmt: skip
        plain = client.chat.completions.create(
            model="tool-model", messages=history, temperature=0, max_completion_tokens=8
        )
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools reached the prompt
    base = f"http://127.0.0.1:{hermes.server.http_port}"
    ids = httpx.post(f"{base}/tokenize", json={"messages": history}, timeout=30).json()["tokens"]
    served = httpx.post(f"{base}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in served  # arguments as objects
    assert out.choices[0].message.tool_calls is None  # auto: this model wrote no call


def test_tool_choice_errors(hermes: ServerThread, long_bundle: Path, tmp_path: Path) -> None:
    with _sdk(hermes) as client:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="tool-model", messages=MESSAGES, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "nope"}},
            )  # fmt: skip
        assert err.value.param == "tool_choice"
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="tool-model", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                response_format={"type": "json_object"},
            )  # fmt: skip
        assert err.value.param == "tool_choice"
    plain = _server(long_bundle, tmp_path, QWEN3_STYLE, None)  # type: ignore[arg-type]
    try:
        with _sdk(plain) as client:
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="tool-model", messages=MESSAGES, tools=TOOLS)
            assert err.value.param == "tool_choice" and "--tool-call-parser" in err.value.message
            out = client.chat.completions.create(
                model="tool-model", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_completion_tokens=4
            )
            assert out.choices[0].message.tool_calls is None
    finally:
        plain.close()


def test_llama3_json_required_calls_validate(long_bundle: Path, tmp_path: Path) -> None:
    srv = _server(long_bundle, tmp_path, LLAMA31_STYLE, "llama3_json")
    try:
        with _sdk(srv) as client:
            out = client.chat.completions.create(
                model="tool-model", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=2, temperature=1.0,
                seed=6, max_completion_tokens=250,
            )  # fmt: skip
            for choice in out.choices:
                assert choice.finish_reason == "tool_calls"
                _check_calls(choice.message.tool_calls)
            kw = dict(model="tool-model", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0,
                      max_completion_tokens=250)  # fmt: skip
            unary = client.chat.completions.create(**kw).choices[0].message.tool_calls
            streamed = [d for chunk in client.chat.completions.create(**kw, stream=True)
                        for c in chunk.choices for d in c.delta.tool_calls or []]  # fmt: skip
            assert [(d.function.name, d.function.arguments) for d in streamed] == [
                (t.function.name, t.function.arguments) for t in unary
            ]
    finally:
        srv.close()


def test_parsers_on_written_text() -> None:
    text = 'ok <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call> <tool_call>\nnot json\n</tool_call>'
    content, calls = tool_calls.parse("hermes", text)
    assert [c["function"] for c in calls] == [{"name": "a", "arguments": '{"x": 1}'}]
    assert content == "ok  <tool_call>\nnot json\n</tool_call>"
    content, calls = tool_calls.parse("llama3_json", '<|python_tag|>{"name": "b", "parameters": {"y": [1]}}')
    assert content is None and calls[0]["function"] == {"name": "b", "arguments": '{"y": [1]}'}
    assert tool_calls.parse("llama3_json", "Hello {") == ("Hello {", [])
