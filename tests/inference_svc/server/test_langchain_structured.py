"""`langchain-openai`'s `ChatOpenAI.with_structured_output` in each of its three modes against a real server on a
loopback port (random weights): `json_schema` (response_format json_schema), `function_calling` (a forced tool call,
parsed by the hermes parser) and `json_mode` (response_format json_object)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pydantic
import pytest

from tests.inference_svc.server.conftest import ServerThread, engine_config, make_server
from tests.inference_svc.server.test_tool_calls_http import QWEN3_STYLE

langchain_openai = pytest.importorskip("langchain_openai")
pytest.importorskip("xgrammar")


class Weather(pydantic.BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Oslo", "Lima"]
    rain: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, long_bundle: Path) -> Iterator[ServerThread]:
    bundle = long_bundle
    folder = tmp_path_factory.mktemp("langchain") / "lc-model"
    shutil.copytree(bundle, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_STYLE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    srv = make_server(
        folder, http_port=0, tool_call_parser="hermes",
        engine=engine_config(kv_cache_memory="8MiB", max_new_tokens_limit=256, max_model_len=2048),
    )  # fmt: skip
    yield srv
    srv.close()


def _chat(srv: ServerThread, **kw) -> object:
    return langchain_openai.ChatOpenAI(
        model="lc-model", base_url=f"http://127.0.0.1:{srv.server.http_port}/v1", api_key="unused",
        max_retries=0, temperature=0, max_tokens=200, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_pydantic_modes(server: ServerThread, method: str) -> None:
    out = _chat(server).with_structured_output(Weather, method=method).invoke("Weather in Paris?")
    assert isinstance(out, Weather)


def test_json_mode(server: ServerThread) -> None:
    close = server.server.engine.engine.tokenizer.encode("}")[0]  # the object closes early when it may
    llm = _chat(server, logit_bias={close: 30})
    out = llm.with_structured_output(None, method="json_mode").invoke("Weather in Paris, as JSON?")
    assert isinstance(out, dict)
