"""inference_svc.chat_template: parity with transformers' apply_chat_template, and content that stays literal.

Every template here is written for these tests. Each model folder is a tiny trained tokenizer (plus two extra
special tokens the templates write) saved by `Tokenizer.save`, with the template added the way a Hub folder holds
it: `chat_template` in tokenizer_config.json (a string, or the list form), or a `chat_template.jinja` file.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from inference_svc.chat_template import ChatTemplate
from inference_svc.errors import InvalidRequestError, ModelLoadError
from shared_model.tokenizer import BOS_TOKEN, EOS_TOKEN, Tokenizer

transformers = pytest.importorskip("transformers")

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# Role markers as special tokens, a system message only first, a generation prompt; no BOS.
TURNS = """\
{% for message in messages %}
{% if message.role == 'system' and not loop.first %}
{{ raise_exception('a system message may only come first, not at position ' ~ loop.index0) }}
{% endif %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

# BOS first, the system message folded into the first user turn, strict user/assistant alternation, EOS after each
# assistant turn (inside transformers' generation tag).
ALTERNATE = """\
{{ bos_token }}
{% set ns = namespace(system='') %}
{% if messages[0].role == 'system' %}
{% set ns.system = messages[0].content ~ '\\n\\n' %}
{% set turns = messages[1:] %}
{% else %}
{% set turns = messages %}
{% endif %}
{% for message in turns %}
{% set expected = 'user' if loop.index0 % 2 == 0 else 'assistant' %}
{% if message.role != expected %}
{{ raise_exception('roles must alternate user/assistant: message ' ~ loop.index0 ~ ' is ' ~ message.role) }}
{% endif %}
{% if message.role == 'user' %}
[USER] {% if loop.first %}{{ ns.system }}{% endif %}{{ message.content | trim }}
{% else %}
[ASSISTANT] {% generation %}{{ message.content }}{{ eos_token }}{% endgeneration %}

{% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT] {% endif %}"""

# Each message as JSON (whole, and a summary with tojson's arguments), EOS after each; empty messages skipped.
AS_JSON = """\
{% for message in messages %}
{% if message.content == '' %}{% continue %}{% endif %}
{{ message | tojson }}
{% set summary = {'role': message.role, 'chars': message.content | length, 'text': message.content} %}
{{ summary | tojson(indent=2, sort_keys=True) }}
{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}{{ {'role': 'assistant', 'open': true} | tojson(separators=(',', ':')) }}{% endif %}
"""

# Contents back to back, one EOS at the end: two contents can join into special-token text.
CONCAT = "{% for message in messages %}{{ message.content }}{% endfor %}{{ eos_token }}"

# Writes only what comes before the first '|' of each content: it cuts special-token text apart.
CUT = "{% for message in messages %}{{ message.content.split('|')[0] }};{% endfor %}{{ eos_token }}"

CHATS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "Hello there!"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?", "name": None},
    ],
    "multi_turn": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Café, naïve & <b>bold</b> 'quotes' \"too\"", "name": "bob"},
        {"role": "assistant", "content": "  quatre  \n"},
        {"role": "user", "content": "and\nthen?\n"},
    ],
    "user_assistant": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": ""},
    ],
}

CORPUS = [
    "Hello there! You are terse. What is 2 + 2? Answer in French. and then? quatre",
    "system user assistant message content role chars text open true false",
    "the quick brown fox jumps over the lazy dog; stop now, again and again",
]


# ---------------------------------------------------------------------------------------------- folders
@pytest.fixture(scope="module")
def base_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json + tokenizer_config.json: a tiny BPE with pad/bos/eos and the special <|im_start|>/<|im_end|>."""
    folder = tmp_path_factory.mktemp("chat-base")
    Tokenizer.train(CORPUS * 3, vocab_size=320, min_frequency=1).save(folder)
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    hf.add_special_tokens([AddedToken(IM_START, special=True), AddedToken(IM_END, special=True)])
    hf.save(str(folder / "tokenizer.json"))
    return folder


def make_folder(base: Path, dest: Path, *, config: Any = None, jinja: str | None = None, **extra: Any) -> Path:
    """A copy of `base` with `config` as tokenizer_config.json's chat_template and/or a chat_template.jinja."""
    dest.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, dest / name)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg.update(extra)
    if config is not None:
        cfg["chat_template"] = config
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja is not None:
        (dest / "chat_template.jinja").write_text(jinja)
    return dest


@pytest.fixture(scope="module")
def folders(base_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-models")
    return {
        "turns": make_folder(base_folder, root / "turns", config=TURNS),
        "alternate": make_folder(base_folder, root / "alternate", jinja=ALTERNATE),
        "as_json": make_folder(
            base_folder,
            root / "as_json",
            config=[
                {"name": "other", "template": "{{ raise_exception('not this one') }}"},
                {"name": "default", "template": AS_JSON},
            ],
        ),
    }


@pytest.fixture(scope="module")
def tokenizer(base_folder: Path) -> Tokenizer:
    return Tokenizer.load(base_folder)


@pytest.fixture(scope="module")
def hf_tokenizers(folders: dict[str, Path]) -> dict[str, Any]:
    return {name: transformers.AutoTokenizer.from_pretrained(str(folder)) for name, folder in folders.items()}


def hf_ids(hf: Any, chat: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return list(hf.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs))


def ids_of(tokenizer: Tokenizer, token: str) -> int:
    (tid,) = tokenizer.encode(token)
    return tid


# ---------------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("chat_name", sorted(CHATS))
@pytest.mark.parametrize("template_name", ["turns", "alternate", "as_json"])
def test_render_and_ids_match_transformers(
    folders: dict[str, Path], hf_tokenizers: dict[str, Any], tokenizer: Tokenizer, template_name: str, chat_name: str
) -> None:
    template = ChatTemplate.from_folder(folders[template_name])
    assert template is not None
    hf, chat = hf_tokenizers[template_name], CHATS[chat_name]
    for prompt in (False, True):
        expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
        assert template.render(chat, add_generation_prompt=prompt) == expected
        text, ids = template.encode(chat, tokenizer, add_generation_prompt=prompt)
        assert text == expected
        assert ids == hf_ids(hf, chat, add_generation_prompt=prompt)
        assert tokenizer.decode(ids) == text


def test_templates_render_what_they_were_written_for(folders: dict[str, Path], tokenizer: Tokenizer) -> None:
    """Guards the parity test against vacuous agreement: the features are really exercised."""
    turns, alternate, as_json = (ChatTemplate.from_folder(folders[n]) for n in ("turns", "alternate", "as_json"))
    chat = CHATS["multi_turn"]
    assert turns.render(chat, add_generation_prompt=True).endswith(
        f"{IM_START}user\nand\nthen?\n{IM_END}\n{IM_START}assistant\n"
    )
    assert not turns.render(chat, add_generation_prompt=False).endswith(f"{IM_START}assistant\n")
    assert alternate.render(chat, add_generation_prompt=True) == (
        f"{BOS_TOKEN}\n[USER] Answer in French.\n\nCafé, naïve & <b>bold</b> 'quotes' \"too\"\n"
        f"[ASSISTANT]   quatre  \n{EOS_TOKEN}\n[USER] and\nthen?\n[ASSISTANT] "
    )
    rendered = as_json.render(chat, add_generation_prompt=True)
    assert '{"role": "user", "content": "Café, naïve & <b>bold</b> \'quotes\' \\"too\\"", "name": "bob"}' in rendered
    assert '{\n  "chars": 11,\n  "role": "assistant",\n  "text": "  quatre  \\n"\n}' in rendered
    assert rendered.endswith('{"role":"assistant","open":true}')
    assert rendered.count(EOS_TOKEN) == 4
    assert as_json.render(CHATS["user_assistant"], add_generation_prompt=False).count(EOS_TOKEN) == 1  # "" skipped
    # BOS only where the template writes it: encode adds none.
    bos = ids_of(tokenizer, BOS_TOKEN)
    assert turns.encode(chat, tokenizer)[1][0] != bos
    alternate_ids = alternate.encode(chat, tokenizer)[1]
    assert alternate_ids[0] == bos and alternate_ids.count(bos) == 1


def test_jinja_file_wins_over_config_entry_as_in_transformers(base_folder: Path, tmp_path: Path) -> None:
    folder = make_folder(
        base_folder, tmp_path / "both", config="CONFIG {{ messages | length }}", jinja="FILE {{ bos_token }}"
    )
    template = ChatTemplate.from_folder(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    chat = CHATS["user"]
    assert template.render(chat) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert template.render(chat) == f"FILE {BOS_TOKEN}"
    assert template.origin == str(folder / "chat_template.jinja")


def test_override_wins_and_globals_and_token_variables_match_transformers(base_folder: Path, tmp_path: Path) -> None:
    folder = make_folder(
        base_folder,
        tmp_path / "vars",
        config=TURNS,
        jinja=ALTERNATE,
        image_token=IM_START,
        unk_token={"__type": "AddedToken", "content": "<|pad|>", "special": True},
    )
    source = (
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ image_token }}|"
        "{{ sep_token is defined }}|{{ tools is none }}{{ documents is none }}|"
        "{{ dict(a=1, b=[2]) | tojson }}|{{ dict.fromkeys(['x']) | tojson }}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|"
        "{{ strftime_now('%Y') }}|{{ '<&>' | tojson }}|{{ range(3) | list }}"
    )
    override = tmp_path / "override.jinja"
    override.write_text(source)
    template = ChatTemplate.from_folder(folder, override=str(override))
    assert template.source == source and template.origin == str(override)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    chat = CHATS["multi_turn"]
    rendered = template.render(chat)
    assert rendered == hf.apply_chat_template(chat, chat_template=source, tokenize=False, add_generation_prompt=True)
    year = datetime.now().strftime("%Y")
    assert rendered == (
        f"<|bos|>|<|eos|>|<|pad|>|<|pad|>|{IM_START}|False|TrueTrue|"
        f'{{"a": 1, "b": [2]}}|{{"x": null}}|1|{year}|"<&>"|[0, 1, 2]'
    )
    assert ChatTemplate.from_folder(folder, override=Path(override)).source == source


THINK = """\
{% for message in messages %}{{ message.role }}: {{ message.content }}
{% endfor %}
{% if add_generation_prompt %}
assistant:{% if enable_thinking is defined and not enable_thinking %} <no-think>{% endif %}

{% endif %}
{{ eos_token }}"""


def test_template_kwargs_reach_the_template_and_cannot_replace_server_variables(
    base_folder: Path, tmp_path: Path, tokenizer: Tokenizer
) -> None:
    override = tmp_path / "think.jinja"
    override.write_text(THINK)
    template = ChatTemplate.from_folder(base_folder, override=override)
    hf = transformers.AutoTokenizer.from_pretrained(str(base_folder))
    chat = CHATS["system_user"]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        expected = hf.apply_chat_template(
            chat, chat_template=THINK, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert template.render(chat, **kwargs) == expected
        text, ids = template.encode(chat, tokenizer, add_generation_prompt=True, **kwargs)
        assert text == expected
        assert ids == hf_ids(hf, chat, chat_template=THINK, add_generation_prompt=True, **kwargs)
    assert "<no-think>" in template.render(chat, enable_thinking=False)
    assert "<no-think>" not in template.render(chat, enable_thinking=True)
    for kwargs, field in (
        ({"messages": []}, "chat_template_kwargs.messages"),
        ({"add_generation_prompt": False, "tools": []}, "chat_template_kwargs.tools"),
        ({"eos_token": "x"}, "chat_template_kwargs.eos_token"),
        ({"extra": {"deep": object()}}, "chat_template_kwargs.extra.deep"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            template.render(chat, **kwargs)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError) as info:
        template.encode(chat, tokenizer, note=["fine", f"sneaky {EOS_TOKEN}"])
    assert info.value.field == "chat_template_kwargs.note[1]"


def test_folder_without_template_gives_none(base_folder: Path) -> None:
    assert ChatTemplate.from_folder(base_folder) is None


def test_content_parts_are_joined_with_newlines(folders: dict[str, Path]) -> None:
    template = ChatTemplate.from_folder(folders["turns"])
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert template.render([{"role": "user", "content": parts}]) == template.render(
        [{"role": "user", "content": "first\nsecond"}]
    )


# ---------------------------------------------------------------------------------------------- literal content
def test_special_token_text_in_content_is_not_a_control_token(
    folders: dict[str, Path], hf_tokenizers: dict[str, Any], tokenizer: Tokenizer
) -> None:
    eos, im_end = ids_of(tokenizer, EOS_TOKEN), ids_of(tokenizer, IM_END)
    chat = [
        {"role": "user", "content": f"stop{EOS_TOKEN}now {IM_END}"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": EOS_TOKEN}, {"type": "text", "text": "again"}]},
    ]
    for name, template_eos, template_im_end in (("alternate", 1, 0), ("turns", 0, 3)):
        template = ChatTemplate.from_folder(folders[name])
        text, ids = template.encode(chat, tokenizer)
        assert text == template.render(chat)
        assert ids.count(eos) == template_eos  # only the template's own: after the assistant turn
        assert ids.count(im_end) == template_im_end  # one per message, none from the user's text
        assert tokenizer.decode(ids) == text  # the typed text is all still there, as ordinary tokens
        joined = [
            {**m, "content": m["content"] if isinstance(m["content"], str) else f"{EOS_TOKEN}\nagain"} for m in chat
        ]
        hf = hf_ids(hf_tokenizers[name], joined, add_generation_prompt=True)
        assert hf.count(eos) == template_eos + 2 and hf.count(im_end) == template_im_end + 1  # transformers' default


def test_contents_that_join_into_special_text_stay_literal(tokenizer: Tokenizer) -> None:
    eos = ids_of(tokenizer, EOS_TOKEN)
    template = ChatTemplate(CONCAT, variables={"eos_token": EOS_TOKEN})
    text, ids = template.encode([{"role": "user", "content": "a<|e"}, {"role": "user", "content": "os|>b"}], tokenizer)
    assert text == f"a{EOS_TOKEN}b{EOS_TOKEN}"
    assert ids.count(eos) == 1 and ids[-1] == eos
    assert tokenizer.encode(text).count(eos) == 2  # what encoding the whole string would have given


def test_fragments_of_special_text_that_join_nothing_keep_parity(
    folders: dict[str, Path], hf_tokenizers: dict[str, Any], tokenizer: Tokenizer
) -> None:
    chats = {
        "turns": [{"role": "user", "content": "<|im"}, {"role": "user", "content": "|> and >"}],
        "alternate": [  # trims user contents: the fragments then touch the template's text
            {"role": "user", "content": "> a quoted line, ending in <  \n"},
            {"role": "assistant", "content": "|>"},
            {"role": "user", "content": "\n <|e"},
        ],
    }
    for name, chat in chats.items():
        text, ids = ChatTemplate.from_folder(folders[name]).encode(chat, tokenizer)
        assert text == hf_tokenizers[name].apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ids == hf_ids(hf_tokenizers[name], chat, add_generation_prompt=True)
        assert tokenizer.decode(ids) == text


def test_template_cutting_special_text_in_content_is_refused(tokenizer: Tokenizer) -> None:
    template = ChatTemplate(CUT, variables={"eos_token": EOS_TOKEN})
    assert template.encode([{"role": "user", "content": "plain"}], tokenizer)[0] == f"plain;{EOS_TOKEN}"
    with pytest.raises(InvalidRequestError) as info:
        template.encode([{"role": "user", "content": f"x{EOS_TOKEN}"}], tokenizer)
    assert info.value.field == "messages" and "special-token text" in str(info.value)


def test_special_text_outside_content_is_refused(folders: dict[str, Path], tokenizer: Tokenizer) -> None:
    template = ChatTemplate.from_folder(folders["turns"])
    with pytest.raises(InvalidRequestError) as info:
        template.encode([{"role": f"user{IM_END}", "content": "hi"}], tokenizer)
    assert info.value.field == "messages[0].role"
    with pytest.raises(InvalidRequestError) as info:
        template.encode([{"role": "user", "content": "hi", "name": {"alias": [EOS_TOKEN]}}], tokenizer)
    assert info.value.field == "messages[0].name.alias[0]"


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "user", "content": "ok"}, "hi"], "messages[1]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": 3, "content": "x"}], "messages[0].role"),
        ([{"role": "", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": []}], "messages[0].content"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[1].content",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": 7}]}], "messages[0].content"),
        ([{"role": "user", "content": ["text"]}], "messages[0].content"),
        ([{"role": "user", "content": "x", "name": object()}], "messages[0].name"),
    ],
)
def test_invalid_messages_name_the_field(
    folders: dict[str, Path], tokenizer: Tokenizer, messages: Any, field: str
) -> None:
    template = ChatTemplate.from_folder(folders["turns"])
    with pytest.raises(InvalidRequestError) as info:
        template.render(messages)
    assert info.value.field == field
    with pytest.raises(InvalidRequestError) as info:
        template.encode(messages, tokenizer)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("name", "chat", "message"),
    [
        (
            "turns",
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
            "a system message may only come first, not at position 1",
        ),
        (
            "alternate",
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            "roles must alternate user/assistant: message 1 is user",
        ),
        ("alternate", [{"role": "assistant", "content": "a"}], "message 0 is assistant"),
    ],
)
def test_raise_exception_is_an_invalid_request(
    folders: dict[str, Path], tokenizer: Tokenizer, name: str, chat: list[dict[str, Any]], message: str
) -> None:
    template = ChatTemplate.from_folder(folders[name])
    for call in (lambda: template.render(chat), lambda: template.encode(chat, tokenizer)):
        with pytest.raises(InvalidRequestError) as info:
            call()
        assert info.value.field == "messages" and message in str(info.value)


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("{{ messages.append(1) }}", "sandbox"),
        ("{{ ''.__class__.__mro__ }}", "sandbox"),
        ("{% set ns = namespace() %}{% set ns._x = 1 %}", "sandbox"),
        ("{{ namespace(_y=2) }}", "sandbox"),
        ("{{ messages[3].content.upper() }}", "cannot render"),
        ("{{ 1 // (messages | length - 1) }}", "ZeroDivisionError"),
    ],
)
def test_template_failures_are_invalid_requests(source: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        ChatTemplate(source).render(CHATS["user"])
    assert info.value.field == "messages" and words in str(info.value)


def test_malformed_templates_are_model_load_errors_naming_the_file(base_folder: Path, tmp_path: Path) -> None:
    folder = make_folder(base_folder, tmp_path / "bad-jinja", jinja="{% for m in messages %}{{ m.content }}")
    with pytest.raises(ModelLoadError, match=r"chat_template\.jinja.*does not compile"):
        ChatTemplate.from_folder(folder)
    folder = make_folder(base_folder, tmp_path / "bad-config", config="{{ messages | }}")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json.*does not compile \(line 1"):
        ChatTemplate.from_folder(folder)
    folder = make_folder(base_folder, tmp_path / "no-default", config=[{"name": "tool_use", "template": "x"}])
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json.*none named 'default'"):
        ChatTemplate.from_folder(folder)
    folder = make_folder(base_folder, tmp_path / "number", config=12)
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json: chat_template must be a string"):
        ChatTemplate.from_folder(folder)
    bad_override = tmp_path / "override.jinja"
    bad_override.write_text("{% if %}")
    with pytest.raises(ModelLoadError, match=r"override\.jinja"):
        ChatTemplate.from_folder(base_folder, override=bad_override)
    with pytest.raises(ModelLoadError, match=r"missing\.jinja"):
        ChatTemplate.from_folder(base_folder, override=tmp_path / "missing.jinja")
