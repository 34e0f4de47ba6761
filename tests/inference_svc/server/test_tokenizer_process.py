"""Long texts are tokenized in a child process: the same results as in the server's own process, errors that keep
their type and field, a lower CPU priority, a dead child replaced on the next call, and a fallback to the gate's
thread when no child can start. The jobs below run in the child, which imports this module by name."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from inference_svc import tokenizer_jobs, tokenizer_process
from inference_svc.chat_template import ChatTemplate
from inference_svc.errors import InvalidRequestError, RequestFailedError
from inference_svc.tokenize_gate import TokenizeGate
from inference_svc.tokenizer_process import TokenizerProcess
from shared_model.tokenizer import Tokenizer

TEXT = "def f(x):\n    return x + 1  # <|eos|> stays a control token in a plain prompt\n" * 60  # 4,680 chars


def _pid_and_priority(tokenizer: Tokenizer) -> tuple[int, int]:
    return os.getpid(), os.getpriority(os.PRIO_PROCESS, 0)


def _refuse(tokenizer: Tokenizer, field: str) -> None:
    raise InvalidRequestError(field, "refused in the child")


def _die(tokenizer: Tokenizer) -> None:
    os._exit(3)


class _Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickle rebuilds exceptions from args: (a, b) is not what it saved
        super().__init__(f"{a}+{b}")


def _raise_unpicklable(tokenizer: Tokenizer) -> None:
    raise _Unpicklable(1, 2)


@pytest.fixture
def child(small_tokenizer: Tokenizer):
    process = TokenizerProcess(small_tokenizer)
    yield process
    process.close()


def test_jobs_give_the_same_results_in_the_child(child: TokenizerProcess, small_tokenizer: Tokenizer) -> None:
    assert child.call(tokenizer_jobs.encode, TEXT, True) == small_tokenizer.encode(TEXT, True)
    ids = small_tokenizer.encode(TEXT)
    assert small_tokenizer.eos_id in ids
    assert child.call(tokenizer_jobs.decode, ids) == TEXT
    assert child.call(tokenizer_jobs.tokenize_response, TEXT, False) == tokenizer_jobs.tokenize_response(
        small_tokenizer, TEXT
    )
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
        variables={"bos_token": "<|bos|>"},
    )
    messages = [{"role": "user", "content": TEXT}]
    in_child = child.call(tokenizer_jobs.chat_encode, template, messages, False)
    assert in_child == tokenizer_jobs.chat_encode(small_tokenizer, template, messages, False)
    assert small_tokenizer.eos_id not in in_child  # content stays literal in the child too
    pid, priority = child.call(_pid_and_priority)
    assert pid == child.pid != os.getpid()
    assert priority >= min(19, os.getpriority(os.PRIO_PROCESS, 0) + tokenizer_process.NICE)
    assert child.starts == 1


def test_errors_keep_their_type_and_field(child: TokenizerProcess) -> None:
    with pytest.raises(InvalidRequestError, match="messages: refused in the child") as info:
        child.call(_refuse, "messages")
    assert info.value.field == "messages"
    with pytest.raises(RequestFailedError, match=r"_raise_unpicklable.*1\+2"):
        child.call(_raise_unpicklable)
    assert child.call(tokenizer_jobs.decode, []) == ""  # the same child goes on
    assert child.starts == 1


def test_a_dead_child_fails_its_call_alone_and_is_replaced(
    child: TokenizerProcess, small_tokenizer: Tokenizer, caplog
) -> None:
    child.start()
    first = child.pid
    with caplog.at_level(logging.WARNING), pytest.raises(RequestFailedError, match="exit status 3"):
        child.call(_die)
    assert child.pid is None
    assert child.call(tokenizer_jobs.encode, TEXT, False) == small_tokenizer.encode(TEXT)
    assert child.starts == 2 and child.pid not in (None, first)
    assert any("exited while working" in r.getMessage() for r in caplog.records)
    assert any("restarted" in r.getMessage() for r in caplog.records)


def test_close_ends_the_child(small_tokenizer: Tokenizer) -> None:
    process = TokenizerProcess(small_tokenizer)
    process.start()
    pid = process.pid
    assert pid is not None
    process.close()
    assert process.pid is None
    with pytest.raises(ProcessLookupError):  # reaped: no such process any more
        os.kill(pid, 0)


def test_gate_runs_long_work_in_the_child_and_short_work_inline(small_tokenizer: Tokenizer) -> None:
    gate = TokenizeGate(small_tokenizer, max_pending_chars=10 * len(TEXT))

    async def both() -> tuple[tuple[int, int], tuple[int, int]]:
        return await gate.run(10, _pid_and_priority), await gate.run(len(TEXT), _pid_and_priority)

    try:
        (short_pid, _), (long_pid, _) = asyncio.run(both())
        assert short_pid == os.getpid() and long_pid == gate.process.pid != os.getpid()
        assert asyncio.run(gate.encode(TEXT)) == small_tokenizer.encode(TEXT)
    finally:
        gate.close()
    assert gate.process.pid is None


def test_gate_falls_back_to_its_thread_when_no_child_starts(small_tokenizer: Tokenizer, monkeypatch, caplog) -> None:
    monkeypatch.setattr(tokenizer_process.sys, "executable", "/nonexistent/python")
    gate = TokenizeGate(small_tokenizer, max_pending_chars=10 * len(TEXT))
    try:
        with caplog.at_level(logging.ERROR):
            pid, _ = asyncio.run(gate.run(len(TEXT), _pid_and_priority))
        assert pid == os.getpid() and gate.process is None
        assert any("on the server's own thread instead" in r.getMessage() for r in caplog.records)
        assert asyncio.run(gate.encode(TEXT)) == small_tokenizer.encode(TEXT)
    finally:
        gate.close()
