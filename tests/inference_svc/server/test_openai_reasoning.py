"""Thinking over the OpenAI API: `chat_template_kwargs` reach the chat template (a Qwen3-style `enable_thinking`
switch), and a reasoning parser moves a `<think>…</think>` block into `reasoning_content`.

- The parser unit-wise: the whole-text split for both parsers, and streams cut at every point (and at the small
  BPE tokenizer's token boundaries, which split the tags into several tokens) give the same split as the whole.
- End to end over HTTP with the official `openai` SDK: a tokenizer with `<think>` and `</think>` as tokens and an
  output forced by `logit_bias` plus a repetition penalty to `<think>` X `</think>` Y, with the parser on (whole
  and streamed) and off.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch
from tokenizers import AddedToken

from inference_svc.openai_api.reasoning import END, START, ReasoningSplitter, split
from inference_svc.settings import OpenAIApiSettings
from shared_model.bundle import save_bundle, tokenizer_id_bound
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer
from tests.conftest import tiny_config
from tests.inference_svc.server.conftest import ServerThread, make_server

QWEN3_LIKE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
"""Qwen3's switch: `enable_thinking: false` writes an empty think block into the prompt."""
MESSAGES = [{"role": "user", "content": "Is 7 prime?"}]


# ---------------------------------------------------------------------------------------- the parser, unit-wise
@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        ("qwen3", "<think>\nhmm</think>\n\nYes.", "\nhmm", "\n\nYes."),
        ("qwen3", "  \n<think>a</think>b", "a", "b"),
        ("qwen3", "Yes.", None, "Yes."),
        ("qwen3", "Yes <think>a</think>", None, "Yes <think>a</think>"),  # not at the start: content
        ("qwen3", "<think>never closed", "never closed", None),
        ("qwen3", "<think>a</think>", "a", None),
        ("qwen3", "<thin", None, "<thin"),
        ("qwen3", "", None, ""),
        ("deepseek_r1", "hmm</think>Yes.", "hmm", "Yes."),
        ("deepseek_r1", "<think>hmm</think>Yes.", "hmm", "Yes."),
        ("deepseek_r1", "never closed</thi", "never closed</thi", None),
        ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    ],
)
def test_whole_split(name: str, text: str, reasoning: str | None, content: str | None) -> None:
    assert split(name, text) == (reasoning, content)


def _streamed(name: str, pieces: list[str]) -> tuple[str, str, int]:
    """(reasoning, content) of a stream fed `pieces`, and the most characters held back after any feed."""
    s = ReasoningSplitter(name)
    r_all, c_all, held = "", "", 0
    for piece in pieces:
        r, c = s.feed(piece)
        r_all, c_all = r_all + r, c_all + c
        held = max(held, len(s._pending))
    r, c = s.finish()
    return r_all + r, c_all + c, held


TEXTS = ["<think>\nLet me see: 7 < 8</think>\n\nYes, 7 is prime.", "  <think></think>x", "a </thin k</think></think>z"]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", TEXTS)
def test_streams_cut_anywhere_split_as_the_whole(name: str, text: str) -> None:
    whole_r, whole_c = split(name, text)
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        r, c, held = _streamed(name, [text[:i], text[i:j], text[j:]])
        assert (r, c) == (whole_r or "", whole_c or ""), (i, j)
    _, _, held = _streamed(name, list(text))
    if not text[0].isspace():  # (leading whitespace waits, with the start, for whether `<think>` opens the output)
        assert held <= len(END) - 1  # only a tag's possible start is held back


def test_tags_split_over_real_token_boundaries(small_tokenizer: Tokenizer) -> None:
    text = TEXTS[0]
    ids = small_tokenizer.encode(text)
    pieces = [small_tokenizer.decode([i]) for i in ids]
    assert "".join(pieces) == text
    assert START not in pieces and END not in pieces  # the tags span several tokens here
    for name in ("qwen3", "deepseek_r1"):
        r, c, _ = _streamed(name, pieces)
        assert (r, c) == ("\nLet me see: 7 < 8", "\n\nYes, 7 is prime.")


# ---------------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def think_bundle(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's tokenizer plus `<think>` and `</think>` as (non-special) tokens, as Qwen3's vocabulary has
    them, a random model over it and the Qwen3-like template."""
    tok = Tokenizer.load(bundle_dir)
    tok._tk.add_tokens([AddedToken(START, normalized=False), AddedToken(END, normalized=False)])
    config = tiny_config(vocab_size=tokenizer_id_bound(tok))
    model = build_model(config, seed=0)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(3))
    folder = save_bundle(tmp_path_factory.mktemp("think") / "think-model", config, model, tok)
    config_path = folder / "tokenizer_config.json"
    cfg = json.loads(config_path.read_text())
    cfg["chat_template"] = QWEN3_LIKE
    config_path.write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def parsed(think_bundle: Path) -> Iterator[ServerThread]:
    srv = make_server(think_bundle, http_port=0, openai_api=OpenAIApiSettings(reasoning_parser="qwen3"))
    yield srv
    srv.close()


def _base(srv: ServerThread) -> str:
    return f"http://127.0.0.1:{srv.server.http_port}"


def _sdk(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=_base(srv) + "/v1", api_key="unused", max_retries=0)


def _tokenize(srv: ServerThread, **body) -> list[int]:
    r = httpx.post(_base(srv) + "/tokenize", json={"messages": MESSAGES, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _forced(srv: ServerThread) -> tuple[dict, str, str]:
    """Request fields forcing `<think>` X `</think>` Y (biases 100 > 80 > 60 > 40; a repetition penalty of 100
    brings each token below the next once it is written), and the texts of X and Y."""
    tok = srv.server.engine.engine.tokenizer  # type: ignore[union-attr]
    think, end = tok._tk.token_to_id(START), tok._tk.token_to_id(END)
    prompt = set(_tokenize(srv))
    words = [i for i in range(3, 500) if i not in prompt and tok.decode([i]).isalpha() and len(tok.decode([i])) > 2]
    x, y = words[0], words[1]
    bias = {str(think): 100, str(x): 80, str(end): 60, str(y): 40}
    body = {"logit_bias": bias, "repetition_penalty": 100.0, "temperature": 0, "max_tokens": 4}
    return body, tok.decode([x]), tok.decode([y])


def test_chat_template_kwargs_reach_the_template(parsed: ServerThread) -> None:
    thinking = _tokenize(parsed)
    off = _tokenize(parsed, chat_template_kwargs={"enable_thinking": False})
    r = httpx.post(_base(parsed) + "/detokenize", json={"tokens": off}, timeout=30)
    assert r.json()["prompt"].endswith("assistant:\n<think>\n\n</think>\n\n")
    assert off[: len(thinking)] == thinking and len(off) > len(thinking)
    with _sdk(parsed) as client:
        on = client.chat.completions.create(model="think-model", messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
        no = client.chat.completions.create(
            model="think-model", messages=MESSAGES, max_tokens=1,  # type: ignore[arg-type]
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )  # fmt: skip
    assert on.usage is not None and no.usage is not None
    assert (on.usage.prompt_tokens, no.usage.prompt_tokens) == (len(thinking), len(off))


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "tools", "bos_token", "limits"])
def test_chat_template_kwargs_may_not_replace_the_servers_variables(parsed: ServerThread, key: str) -> None:
    for route in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(
            _base(parsed) + route, json={"messages": MESSAGES, "chat_template_kwargs": {key: True}}, timeout=30
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"chat_template_kwargs.{key}"


def test_reasoning_moves_into_reasoning_content(parsed: ServerThread) -> None:
    body, x, y = _forced(parsed)
    with _sdk(parsed) as client:
        whole = client.chat.completions.create(model="think-model", messages=MESSAGES, extra_body=body)  # type: ignore[arg-type]
        message = whole.choices[0].message
        assert (getattr(message, "reasoning_content", None), message.content) == (x, y)
        chunks = list(
            client.chat.completions.create(model="think-model", messages=MESSAGES, stream=True, extra_body=body)  # type: ignore[arg-type]
        )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (x, y)
    assert not any(START in (d.content or "") or END in (d.content or "") for d in deltas)
    dropped = httpx.post(
        _base(parsed) + "/v1/chat/completions",
        json={"messages": MESSAGES, "include_reasoning": False, **body},
        timeout=30,
    ).json()["choices"][0]["message"]
    assert dropped["content"] == y and dropped["reasoning_content"] is None


def test_without_a_parser_the_block_stays_in_the_content(think_bundle: Path, parsed: ServerThread) -> None:
    body, x, y = _forced(parsed)
    srv = make_server(think_bundle, http_port=0)
    try:
        r = httpx.post(_base(srv) + "/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=30)
        message = r.json()["choices"][0]["message"]
        assert message["content"] == f"{START}{x}{END}{y}" and "reasoning_content" not in message
    finally:
        srv.close()
