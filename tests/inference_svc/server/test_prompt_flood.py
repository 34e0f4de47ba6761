"""A flood of large text prompts cannot stall the service: text that cannot fit the context is refused before it
is tokenized, and tokenization is bounded (one worker, metered in characters; beyond the limit RESOURCE_EXHAUSTED
before any work). Mechanisms are tested here; the latency and memory figures are in benchmarks/hostile_input.py."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from inference_svc.errors import CapacityError, InvalidRequestError
from inference_svc.tokenize_gate import TokenizeGate
from shared_model.tokenizer import Tokenizer
from tests.inference_svc.server.conftest import make_server, metric_value


def _code(fn, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value.code(), info.value.details()


def test_prompt_longer_than_the_context_could_hold_is_refused_unread(client, server) -> None:
    engine = server.server.engine
    assert engine is not None
    limit = engine.max_prompt_chars
    before = engine._tokenizer_gate.encoded_chars
    code, details = _code(client.generate, "a" * (limit + 1), max_new_tokens=2)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in details and "refused before tokenizing" in details and str(limit) in details
    assert engine._tokenizer_gate.encoded_chars == before  # not one character was tokenized
    ok = client.generate("a" * 40, max_new_tokens=2, ignore_eos=True)  # the service is unharmed
    assert len(ok.token_ids) == 2


def test_prompt_whose_bytes_prove_it_cannot_fit_is_refused_before_parsing(bundle_dir) -> None:
    srv = make_server(bundle_dir, max_request_bytes=256 * 1024)  # room for prompts of 4x the character limit
    try:
        engine = srv.server.engine
        assert engine is not None
        limit = engine.max_prompt_chars
        with srv.client(timeout=60) as client:
            for prompt in ("a" * (4 * limit + 1), "\u00e9" * (2 * limit + 1)):  # 1- and 2-byte characters
                code, details = _code(client.generate, prompt, max_new_tokens=2)
                assert code == grpc.StatusCode.INVALID_ARGUMENT
                assert "prompt" in details and "refused before parsing" in details and str(limit) in details
            assert engine._tokenizer_gate.encoded_chars == 0
            # bytes that do not prove it (4-byte characters could still fit) go through the parser and its check
            code, details = _code(client.generate, "a" * (4 * limit), max_new_tokens=2)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "refused before tokenizing" in details
            assert len(client.generate("a" * 40, max_new_tokens=2, ignore_eos=True).token_ids) == 2
    finally:
        srv.close()


def test_text_beyond_the_tokenizer_budget_is_refused_before_parsing(bundle_dir) -> None:
    from inference_svc.settings import AdmissionLimits

    srv = make_server(bundle_dir, max_request_bytes=64 * 1024, admission=AdmissionLimits(max_tokenizing_chars=4000))
    try:
        gate = srv.server.engine._tokenizer_gate
        with srv.client(timeout=60) as client:
            code, details = _code(client.tokenize, "a" * 20000)  # 20,000 bytes: at least 5,000 characters
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert details == "text: at least 5000 characters are more than the server tokenizes at once (4000)"
            assert gate.encoded_chars == 0
            # 8,800 bytes (more than the prescreen skips) of 4-byte characters: 2,200 characters, which pass
            emoji = "\U0001f600" * 2200
            assert len(client.tokenize(emoji).token_ids) > 0 and gate.encoded_chars == 2200
    finally:
        srv.close()


def test_last_field_length_reads_the_wire_as_the_parser_keeps_it() -> None:
    from inference_svc.grpc_service.wire_guard import INPUT_FIELDS, PROMPT_FIELD, last_field_length
    from inference_svc.proto_gen import inference_pb2 as pb

    def length(message: pb.GenerateRequest | bytes, max_fields: int = 64) -> int | None:
        raw = message if isinstance(message, bytes) else message.SerializeToString()
        return last_field_length(raw, PROMPT_FIELD, INPUT_FIELDS, max_fields)

    sampling = pb.SamplingParams(temperature=0.5, max_new_tokens=7, stop=["x" * 300])
    text = pb.GenerateRequest(request_id="r1", prompt="h\u00e9llo" * 100, sampling=sampling)
    assert length(text) == len(text.prompt.encode())
    tokens = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=sampling)
    assert length(tokens) is None  # no text prompt
    assert length(pb.GenerateRequest(request_id="only")) is None
    # a field repeated on the wire: the parser keeps the last one, and so does the scan
    long_text = pb.GenerateRequest(prompt="a" * 1000).SerializeToString()
    twice = long_text + pb.GenerateRequest(prompt="b").SerializeToString()
    assert pb.GenerateRequest.FromString(twice).prompt == "b" and length(twice) == 1
    then_ids = long_text + tokens.SerializeToString()
    assert pb.GenerateRequest.FromString(then_ids).WhichOneof("input") == "prompt_token_ids"
    assert length(then_ids) is None
    raw = text.SerializeToString()
    assert length(raw[:-5]) is None  # truncated: the parser decides
    assert length(b"\xff" * 20) is None  # not wire data
    assert length(b"\x10\x05" + raw) is None  # the prompt's number with a varint: the parser decides
    assert length(b"\x00\x01" + raw) is None  # field number 0 is invalid
    many = b"".join(pb.GenerateRequest(request_id="x").SerializeToString() for _ in range(70)) + raw
    assert length(many) is None and length(many, max_fields=200) == len(text.prompt.encode())


def test_gate_refuses_beyond_its_budget_before_any_work(small_tokenizer: Tokenizer) -> None:
    text = "def f(x):\n    return x + 1\n" * 300  # 8,100 characters: above the inline size
    gate = TokenizeGate(small_tokenizer, max_pending_chars=len(text) + 10)

    async def flood() -> None:
        first = asyncio.create_task(gate.encode(text))
        await asyncio.sleep(0)  # `first` is accepted: its characters are pending until its work ends
        assert gate.pending_chars == len(text)
        with pytest.raises(CapacityError, match="tokenizer is busy"):
            await gate.encode(text)
        assert gate.refused == 1 and gate.encoded_chars == len(text)  # the refused text was never tokenized
        # the same answer from a lower bound on the length (a request's wire bytes), before anything is parsed
        bound = gate.refusal(2100, at_least=True)
        assert isinstance(bound, CapacityError) and "this text has at least 2100 characters" in str(bound)
        assert gate.refusal(2048, at_least=True) is None  # short texts run inline, unmetered
        assert gate.refused == 2
        assert await first == small_tokenizer.encode(text)
        await asyncio.sleep(0)  # the release is posted from the worker thread
        for _ in range(100):
            if gate.pending_chars == 0:
                break
            await asyncio.sleep(0.01)
        assert gate.pending_chars == 0
        assert await gate.encode(text) == small_tokenizer.encode(text)  # budget free again

    asyncio.run(flood())
    gate.close()


class _HeldTokenizer:
    """The real tokenizer, whose long encodes wait for `release` once they have started (so a test can act while
    one is provably running). Short texts pass straight through."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.started = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        self.started.set()
        assert self.release.wait(30), "the test never released the encode"
        return self._tok.encode(text, add_bos)


def test_cancelled_caller_keeps_its_work_metered_until_it_ends(small_tokenizer: Tokenizer) -> None:
    text = "x = [i * i for i in range(10)]\n" * 400
    held = _HeldTokenizer(small_tokenizer)
    gate = TokenizeGate(held, max_pending_chars=len(text) + 10, process=False)  # type: ignore[arg-type]

    async def cancel_one() -> None:
        task = asyncio.create_task(gate.encode(text))
        assert await asyncio.to_thread(held.started.wait, 30)  # the encode is running on the worker
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.pending_chars == len(text)  # still running: still counted, and the budget still taken
        with pytest.raises(CapacityError):
            await gate.encode(text)
        held.release.set()
        for _ in range(500):  # bounded wait for the worker to finish the cancelled caller's encode
            if gate.pending_chars == 0:
                break
            await asyncio.sleep(0.01)
        assert gate.pending_chars == 0

    asyncio.run(cancel_one())
    gate.close()


def test_long_text_encodes_the_same_through_the_gil_free_path(small_tokenizer: Tokenizer) -> None:
    text = "héllo <|eos|> wörld\n" * 1000  # 20,000 characters: the batch path
    ids = small_tokenizer.encode(text)
    assert ids == small_tokenizer._tk.encode(text, add_special_tokens=False).ids  # the GIL-holding single path
    assert small_tokenizer.eos_id in ids  # plain prompts keep special-token text as control tokens (transformers)
    literal = small_tokenizer.encode(text, literal=True)
    assert small_tokenizer.eos_id not in literal and small_tokenizer.decode(literal) == text


def test_text_longer_than_the_whole_budget_is_invalid_not_retryable(small_tokenizer: Tokenizer) -> None:
    gate = TokenizeGate(small_tokenizer, max_pending_chars=5000)
    with pytest.raises(InvalidRequestError, match="text: 6000 characters are more than"):
        asyncio.run(gate.encode("a" * 6000, field="text"))
    assert gate.encoded_chars == 0 and gate.refused == 0
    gate.close()


def test_tokenize_rpc_builds_its_response_through_the_gate(client, server) -> None:
    engine = server.server.engine
    before = engine._tokenizer_gate.encoded_chars
    calls = engine._tokenizer_gate.process.calls
    text = "for i in range(3):\n    print(i)\n" * 100  # 3,200 characters: above the inline size, in the child
    r = client.tokenize(text)
    assert list(r.token_ids) == engine.engine.tokenizer.encode(text)
    tok = engine.engine.tokenizer
    assert list(r.tokens) == [tok.id_to_token(i) for i in r.token_ids] and all(r.tokens)
    assert engine._tokenizer_gate.encoded_chars == before + len(text)
    assert engine._tokenizer_gate.process.calls == calls + 1  # long work went to the tokenizer process


def test_long_prompt_from_the_tokenizer_process_is_refused_by_its_token_count(client, server) -> None:
    """A prompt tokenized in the child comes back as one compact array, and one too long for the context is
    refused by its token count, with the engine's own context message."""
    engine = server.server.engine
    gate = engine._tokenizer_gate
    text = "x = [1, 2]\n" * 150  # 1,650 characters, far more tokens than the 128-token context
    n = len(engine.engine.tokenizer.encode(text))
    assert n >= engine.engine.max_model_len and len(text) <= engine.max_prompt_chars
    before, inline, calls = gate.encoded_chars, gate.inline_chars, gate.process.calls
    gate.inline_chars = 100  # so this text goes to the tokenizer process
    try:
        code, details = _code(client.generate, text, max_new_tokens=2)
    finally:
        gate.inline_chars = inline
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the prompt has {n} tokens; this engine's context holds {engine.engine.max_model_len}" in details
    assert gate.encoded_chars == before + len(text) and gate.process.calls == calls + 1


def test_tokenizer_work_is_metered_in_prometheus(client, server) -> None:
    metrics = server.server.metrics

    def total() -> float:
        return metric_value(metrics.render(), "tandem_tokenized_chars_total")

    before = total()
    client.tokenize("def f():\n    return 1\n" * 10)
    assert total() == before + len("def f():\n    return 1\n" * 10)
    assert metric_value(metrics.render(), "tandem_tokenizer_pending_chars", model_name="bundle") == 0.0


def test_serve_flag_sets_the_tokenizer_budget(bundle_dir) -> None:
    from inference_svc.cli import build_serve_config

    settings, _, _ = build_serve_config(["--model", str(bundle_dir), "--max-tokenizing-chars", "12345"])
    assert settings.admission.max_tokenizing_chars == 12345
    with pytest.raises(SystemExit):
        build_serve_config(["--model", str(bundle_dir), "--max-tokenizing-chars", "0"])
