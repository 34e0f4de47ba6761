"""Small parts of the OpenAI surface (issue 35, goal 6), against a real server on a loopback port: `GET
/v1/models/{id}` with the official `openai` SDK, OpenAI-shaped 404 and 405 for every unknown route or method, and
`tandem serve`'s vLLM spellings: the positional model folder and `--api-key KEY` (repeatable) beside
`--api-key-file`, with no flag taken by a prefix of its name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from inference_svc.cli import build_serve_config
from tests.inference_svc.server.conftest import ServerThread, make_server


@pytest.fixture(scope="module")
def named(bundle_dir: Path) -> Iterator[ServerThread]:
    srv = make_server(bundle_dir, http_port=0, served_model_name="org/tiny-model", api_keys=("k1", "k2"))
    yield srv
    srv.close()


def _base(srv: ServerThread) -> str:
    return f"http://127.0.0.1:{srv.server.http_port}"


def _sdk(srv: ServerThread, key: str = "k1") -> openai.OpenAI:
    return openai.OpenAI(base_url=_base(srv) + "/v1", api_key=key, max_retries=0)


def test_retrieve_a_model_by_id(named: ServerThread) -> None:
    with _sdk(named) as client:
        card = client.models.retrieve("org/tiny-model")  # a name with a slash, as hub names have
        assert (card.id, card.object, card.owned_by) == ("org/tiny-model", "model", "tandem")
        assert card.model_dump()["max_model_len"] == 128
        assert client.models.list().data[0].id == card.id
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve("gpt-4")
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "model" and "gpt-4" in body["message"]
    r = httpx.get(_base(named) + "/v1/models/gpt-4", headers={"Authorization": "Bearer k2"}, timeout=30)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == "NOT_FOUND"
    assert httpx.get(_base(named) + "/v1/models/org/tiny-model", timeout=30).status_code == 401  # keys apply


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/nothing", 404),
        ("POST", "/v1/embeddings/x/y", 404),
        ("GET", "/", 404),
        ("POST", "/v1/models", 405),
        ("DELETE", "/v1/models/org/tiny-model", 405),
        ("GET", "/v1/chat/completions", 405),
        ("PUT", "/tokenize", 405),
    ],
)
def test_unknown_routes_and_methods_answer_in_openai_shape(named: ServerThread, method, path, status) -> None:
    r = httpx.request(method, _base(named) + path, headers={"Authorization": "Bearer k1"}, timeout=30)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and path in error["message"]
    if status == 405:
        assert "allow" in r.headers


def test_api_key_flags_guard_http(named: ServerThread) -> None:
    for key in ("k1", "k2"):
        with _sdk(named, key) as client:
            assert client.completions.create(model="org/tiny-model", prompt="x", max_tokens=2).choices
    with _sdk(named, "k3") as client, pytest.raises(openai.AuthenticationError):
        client.completions.create(model="org/tiny-model", prompt="x", max_tokens=2)


def test_serve_flags_take_vllms_spellings(bundle_dir: Path, tmp_path: Path) -> None:
    folder = str(bundle_dir)
    assert build_serve_config([folder])[0].model == folder
    assert build_serve_config(["--model", folder])[0].model == folder
    assert build_serve_config([folder, "--model", folder])[0].model == folder
    keys_file = tmp_path / "keys"
    keys_file.write_text("from-file\n")
    settings = build_serve_config([folder, "--api-key", "abc", "--api-key", "def", "--api-key-file", str(keys_file)])[0]
    assert settings.api_keys == ("abc", "def")
    assert settings.read_keys() == (b"abc", b"def", b"from-file")
    assert build_serve_config([folder])[0].read_keys() == ()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{folder}", "--model", "/elsewhere"], "given twice"),
        ([], "a model folder is required"),
        (["{folder}", "--api-key-f", "x"], "unrecognized arguments: --api-key-f"),  # no prefix is a flag
        (["{folder}", "--api-key", " spaced "], "api_keys"),
    ],
)
def test_serve_flag_errors_name_what_is_wrong(bundle_dir: Path, capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        build_serve_config([a.format(folder=bundle_dir) for a in argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
