"""Chat templates without bounds (issue 34): a render is stopped at its size bound before it has made more than
that, at its time bound, or when it runs out of the tokenizer process's memory, each as a 400 naming
`chat_template`; on a real server the render runs in the tokenizer process, so `/health` answers meanwhile, and the
server serves chats again afterwards.

The templates are the issue's attacks: `lipsum(n=60000)` (seconds of work), ten million words (50 MB of output),
`tojson(indent=100000000)` (gigabytes in one call), plus a loop that would run for hours (the time bound alone:
no machine finishes 10^10 iterations within it, so nothing here depends on speed).
"""

from __future__ import annotations

import json
import shutil
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from inference_svc.chat_template import ChatTemplate, RenderLimits
from inference_svc.errors import InvalidRequestError
from inference_svc.settings import HttpLimits
from tests.inference_svc.server.conftest import ServerThread, make_server

LIPSUM = "{{ lipsum(n=60000) }}"
FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
WORDS = "{% for i in range(100000) %}{% for j in range(100) %}word {% endfor %}{% endfor %}"
INDENT = "{{ messages | tojson(indent=100000000) }}"
REPEAT = "{{ 'word ' * 10000000000 }}"
DOUBLING = "{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}"
CONCAT = "{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
MACRO = "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}{% endmacro %}{{ f('ab', 64) }}"
CENTER = "{{ 'x' | center(10000000000) }}"
INDENT_FILTER = "{{ (('a\n' * 5000) | indent(1000000)) }}"
REPLACE = "{{ ('x' * 5000) | replace('x', 'y' * 1000000) }}"
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
CHAT = [{"role": "user", "content": "hi"}]
MAX_CHARS = 10_000
PEAK_BYTES = 4 * 1024 * 1024
"""What a refused render may allocate at its peak (the bound is 10,000 characters; the attacks want gigabytes)."""


SIZE_ATTACKS = {"words": WORDS, "indent": INDENT, "repeat": REPEAT, "doubling": DOUBLING, "concat": CONCAT,
                "macro": MACRO, "center": CENTER, "indent-filter": INDENT_FILTER, "replace": REPLACE}  # fmt: skip


@pytest.mark.parametrize("source", list(SIZE_ATTACKS.values()), ids=list(SIZE_ATTACKS))
def test_a_render_over_its_size_bound_is_refused_before_it_grows(source: str) -> None:
    template = ChatTemplate(source)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequestError) as info:
            template.render(CHAT, limits=RenderLimits(MAX_CHARS))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.field == "chat_template" and f"more than {MAX_CHARS} characters" in str(info.value)
    assert peak < PEAK_BYTES, peak


@pytest.mark.parametrize(
    "source",
    ["{{ 'x' | center(100000000) }}", "{{ '%100000000s' | format(1) }}", "{{ {'a': 1} | tojson(indent=100000000) }}"],
    ids=["center", "format", "tojson"],
)
def test_compiling_a_template_runs_none_of_it(source: str) -> None:
    """Jinja evaluates filters of constants while it compiles, outside any bound (100 MB each on the old code)."""
    tracemalloc.start()
    try:
        ChatTemplate(source)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, peak


def test_a_render_past_its_time_bound_is_interrupted() -> None:
    with pytest.raises(InvalidRequestError) as info:
        ChatTemplate(FOREVER).render(CHAT, limits=RenderLimits(MAX_CHARS, timeout=0.3))
    assert info.value.field == "chat_template" and "within 0.3 s" in str(info.value)


def test_renders_within_the_bounds_are_unchanged() -> None:
    extras = (
        "{{ messages | tojson(indent=2) }}{{ '-' * 10 }}{{ 'a' ~ 'b' }}{{ 'ab' | center(9) }}{{ 'a\nb' | indent(2) }}"
    )
    template = ChatTemplate(PLAIN + extras + "{{ 'abc' | replace('b', 'xyz') }}")
    bounded = template.render(CHAT, limits=RenderLimits(MAX_CHARS, timeout=30))
    assert bounded == template.render(CHAT) and "ab" in bounded and "axyzc" in bounded


# ---------------------------------------------------------------------------------------- a real server
ATTACKS = {"lipsum": LIPSUM, "forever": FOREVER, "words": WORDS, "indent": INDENT}
DISPATCH = (
    "".join(f"{{% {'if' if i == 0 else 'elif'} messages[0]['content'] == '{name}' %}}{src}"
            for i, (name, src) in enumerate(ATTACKS.items()))
    + "{% else %}" + PLAIN + "{% endif %}"
)  # fmt: skip


@pytest.fixture(scope="module")
def srv(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    folder = tmp_path_factory.mktemp("template-bounds") / "chat-model"
    shutil.copytree(bundle_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = DISPATCH
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    server = make_server(folder, http_port=0, http=HttpLimits(chat_template_timeout=1.0))
    yield server
    server.close()


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack_templates_get_400_while_health_answers(srv: ServerThread, attack: str) -> None:
    base = f"http://127.0.0.1:{srv.server.http_port}"
    body = {"messages": [{"role": "user", "content": attack}], "max_tokens": 1}
    result: list[httpx.Response] = []
    t = threading.Thread(target=lambda: result.append(httpx.post(base + "/v1/chat/completions", json=body,
                                                                 timeout=120)))  # fmt: skip
    t.start()
    polls = 0
    while t.is_alive() or polls == 0:  # the event loop stays free while the template renders
        r = httpx.get(base + "/health", timeout=10)
        assert r.status_code == 200 and r.json() == {"status": "serving"}
        polls += 1
    t.join(120)
    (r,) = result
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "chat_template" and r.json()["error"]["code"] == "INVALID_ARGUMENT"
    ok = httpx.post(base + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}, timeout=120)
    assert ok.status_code == 200, ok.text[:300]


def test_the_tokenizer_process_does_not_grow_with_the_attacks(srv: ServerThread) -> None:
    """The renders happen in the tokenizer process and stop at the bound: its peak resident memory stays near its
    working set however often the attacks come (the issue saw 5.5 GB in the server for one of them)."""
    engine = srv.server.engine
    assert engine is not None
    base = f"http://127.0.0.1:{srv.server.http_port}"
    for attack in ("words", "indent") * 3:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": attack}]},
                       timeout=120)  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    process = engine._tokenizer_gate.process
    assert process is not None and process.pid is not None
    status = Path(f"/proc/{process.pid}/status").read_text()
    peak_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    assert peak_kib < 300 * 1024, f"tokenizer process peak RSS {peak_kib} KiB"
