"""`tandem generate`: the prompt from stdin, `--json`, `--logprobs N` and `--chat` (through the server's HTTP API
and the folder's chat template), against a real server."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from inference_svc.generate_cli import generate_main
from tests.inference_svc.server.conftest import ServerThread, make_server

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def srv(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("generate") / "model"
    shutil.copytree(bundle_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    server = make_server(folder, http_port=0)
    yield server
    server.close()


def _run(
    srv: ServerThread, argv: list[str], capsys, stdin: str | None = None, monkeypatch=None
) -> tuple[int, str, str]:
    if stdin is not None:
        assert monkeypatch is not None
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = generate_main(["--target", srv.target, *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_stdin_and_json(srv, capsys, monkeypatch) -> None:
    prompt = "def add(a, b):\n    return"
    rc, out, _ = _run(srv, ["-", "--max-new-tokens", "6", "--ignore-eos", "--json"], capsys, prompt, monkeypatch)
    assert rc == 0
    record = json.loads(out)
    with srv.client() as c:
        ref = c.generate(prompt, max_new_tokens=6, ignore_eos=True)
    assert record["text"] == ref.text and record["token_ids"] == list(ref.token_ids)
    assert record["finish_reason"] == "LENGTH" and record["completion_tokens"] == 6
    assert record["ttft_ms"] > 0 and "logprobs" not in record


def test_logprobs_in_json_and_on_stderr(srv, capsys) -> None:
    rc, out, _ = _run(srv, ["import os", "--max-new-tokens", "4", "--ignore-eos", "--json", "--logprobs", "2"], capsys)
    assert rc == 0
    entries = json.loads(out)["logprobs"]
    assert len(entries) == 4 and all(len(e["top"]) == 2 and e["top"][0]["token_id"] == e["token_id"] for e in entries)
    rc, out, err = _run(srv, ["import os", "--max-new-tokens", "3", "--ignore-eos", "--logprobs", "0"], capsys)
    assert rc == 0
    lines = [line for line in err.splitlines() if line.startswith("--- token ")]
    assert len(lines) == 3 and all("logprob -" in line or "logprob 0" in line for line in lines)


def test_chat_goes_through_the_template(srv, capsys) -> None:
    rc, out, err = _run(srv, ["Say hi.", "--chat", "--system", "Be brief.", "--max-new-tokens", "5", "--json"], capsys)
    assert rc == 0, err
    record = json.loads(out)
    engine = srv.server.engine
    assert engine is not None
    rendered = "system: Be brief.\nuser: Say hi.\nassistant:"
    assert record["prompt_tokens"] == len(engine.engine.tokenizer.encode(rendered))
    with srv.client() as c:
        ref = c.generate(rendered, max_new_tokens=5)
    assert record["text"] == ref.text


def test_chat_without_http_is_one_line(bundle_dir, capsys) -> None:
    server = make_server(bundle_dir)
    try:
        rc, _, err = _run(server, ["hi", "--chat"], capsys)
    finally:
        server.close()
    assert rc == 1 and "--no-http" in err and "Traceback" not in err
