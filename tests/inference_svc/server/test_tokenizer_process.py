"""Long texts are tokenized in a child process: the same results as in the server's own process, errors that keep
their type and field, a lower CPU priority, a dead child replaced on the next call, and a fallback to the gate's
thread when no child can start. The jobs run in the child, which imports `tokenizer_test_jobs` by name."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import grpc
import pytest

from inference_svc import tokenizer_jobs, tokenizer_process
from inference_svc.chat_template import ChatTemplate
from inference_svc.client import NO_RETRY
from inference_svc.errors import InvalidRequestError, RequestFailedError
from inference_svc.settings import AdmissionLimits
from inference_svc.tokenize_gate import TokenizeGate
from inference_svc.tokenizer_process import TokenizerProcess
from shared_model.tokenizer import Tokenizer
from tests.inference_svc.server import tokenizer_test_jobs as jobs
from tests.inference_svc.server.conftest import engine_config, make_server

TEXT = "def f(x):\n    return x + 1  # <|eos|> stays a control token in a plain prompt\n" * 60  # 4,680 chars


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
    pid, priority = child.call(jobs.pid_and_priority)
    assert pid == child.pid != os.getpid()
    assert priority >= min(19, os.getpriority(os.PRIO_PROCESS, 0) + tokenizer_process.NICE)
    assert child.starts == 1


def test_errors_keep_their_type_and_field(child: TokenizerProcess) -> None:
    with pytest.raises(InvalidRequestError, match="messages: refused in the child") as info:
        child.call(jobs.refuse, "messages")
    assert info.value.field == "messages"
    with pytest.raises(RequestFailedError, match=r"the tokenizer failed on this text \(Unpicklable\)"):
        child.call(jobs.raise_unpicklable)
    assert child.call(tokenizer_jobs.decode, []) == ""  # the same child goes on
    assert child.starts == 1


def test_a_dead_child_fails_its_call_alone_and_is_replaced(
    child: TokenizerProcess, small_tokenizer: Tokenizer, caplog
) -> None:
    child.start()
    first = child.pid
    with caplog.at_level(logging.WARNING), pytest.raises(RequestFailedError, match="exit status 3"):
        child.call(jobs.die)
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
        return await gate.run(10, jobs.pid_and_priority), await gate.run(len(TEXT), jobs.pid_and_priority)

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
            pid, _ = asyncio.run(gate.run(len(TEXT), jobs.pid_and_priority))
        assert pid == os.getpid() and gate.process is None
        assert any("on the server's own thread instead" in r.getMessage() for r in caplog.records)
        assert asyncio.run(gate.encode(TEXT)) == small_tokenizer.encode(TEXT)
    finally:
        gate.close()


def test_a_hung_child_is_killed_after_its_timeout(child: TokenizerProcess, small_tokenizer: Tokenizer) -> None:
    with pytest.raises(RequestFailedError, match="signal SIGKILL"):
        child.call(jobs.hang, timeout=0.5)
    assert child.call(tokenizer_jobs.encode, TEXT, False) == small_tokenizer.encode(TEXT)
    assert child.starts == 2


def test_a_child_that_cannot_start_is_a_start_error(small_tokenizer: Tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(tokenizer_process, "_CHILD", "import sys; sys.exit(3)")
    process = TokenizerProcess(small_tokenizer)
    with pytest.raises(tokenizer_process.TokenizerProcessError, match="failed to start \\(exit status 3\\)"):
        process.start()
    assert process.pid is None and process.starts == 0


def test_the_child_leaves_sigterm_to_the_server(child: TokenizerProcess) -> None:
    child.start()
    os.kill(child.pid, signal.SIGTERM)  # what a process group's stop would send it
    assert child.call(tokenizer_jobs.decode, []) == "" and child.starts == 1


def test_close_ends_a_hung_job_instead_of_waiting_for_it(small_tokenizer: Tokenizer, monkeypatch) -> None:
    from inference_svc import tokenize_gate

    monkeypatch.setattr(tokenize_gate, "CLOSE_GRACE_S", 0.5)
    gate = TokenizeGate(small_tokenizer, max_pending_chars=10 * len(TEXT))

    async def hang_then_close() -> None:
        task = asyncio.ensure_future(gate.run(len(TEXT), jobs.hang))
        for _ in range(3000):  # bounded wait until the child runs the job
            if gate.process.calls == 0 and gate.process.pid is not None and gate.pending_chars:
                break
            await asyncio.sleep(0.01)
        await asyncio.to_thread(gate.close)  # returns: the child is killed after the grace
        with pytest.raises(RequestFailedError, match="exited while tokenizing"):
            await task

    asyncio.run(hang_then_close())
    assert gate.process.pid is None


def test_a_busy_tokenizer_refuses_large_texts_before_parsing(bundle_dir, tmp_path) -> None:
    """End to end: while a job holds 3,000 of the 4,000-character budget, a Tokenize or Generate whose bytes prove
    more than 1,000 characters gets RESOURCE_EXHAUSTED unparsed; the budget's owner is untouched and finishes."""
    srv = make_server(
        bundle_dir,
        max_request_bytes=64 * 1024,
        admission=AdmissionLimits(max_tokenizing_chars=4000),
        engine=engine_config(max_model_len=512),
    )
    try:
        engine = srv.server.engine
        gate = engine._tokenizer_gate
        assert engine.max_prompt_chars >= 2100  # so the context check passes a 2,100-character Generate prompt
        release = tmp_path / "release"
        held = srv.submit(gate.run(3000, jobs.wait_for_file, str(release), field="text"))
        for _ in range(3000):  # bounded wait until the job is accepted
            if gate.pending_chars == 3000:
                break
            time.sleep(0.01)
        assert gate.pending_chars == 3000
        with srv.client(timeout=60, retry=NO_RETRY) as client:
            for call in (client.tokenize, lambda text: client.generate(text, max_new_tokens=2)):
                with pytest.raises(grpc.RpcError) as info:
                    call("a" * 8400)  # at least 2,100 characters: 3,000 + 2,100 > 4,000
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "this text has at least 2100 characters" in info.value.details()
            assert gate.encoded_chars == 3000 and gate.refused == 2
            release.touch()
            assert held.result(60) == "released"
            # budget free again: 8,400 bytes of 4-byte characters are 2,100 characters, which pass
            assert len(client.tokenize("\U0001f600" * 2100).token_ids) > 0 and gate.encoded_chars == 5100
    finally:
        srv.close()


def test_the_childs_memory_is_capped_and_it_survives_the_cap(child: TokenizerProcess) -> None:
    too_much = tokenizer_process.MEMORY_HEADROOM_BYTES + 2**30
    with pytest.raises(MemoryError):
        child.call(jobs.allocate, too_much)
    pid = child.pid
    assert child.call(jobs.allocate, 10**6) == 10**6 and child.pid == pid  # the same child goes on


def test_chat_renders_never_run_inline_however_short(small_tokenizer: Tokenizer) -> None:
    gate = TokenizeGate(small_tokenizer, max_pending_chars=10 * len(TEXT))
    template = ChatTemplate("{{ messages[0]['content'] }}")
    chat = [{"role": "user", "content": "hi"}]

    async def render() -> list[int]:
        return await gate.run(2, tokenizer_jobs.chat_encode, template, chat, True)

    try:
        assert asyncio.run(render()) == small_tokenizer.encode("hi")
        assert gate.process is not None and gate.process.calls == 1  # it went to the child
    finally:
        gate.close()
