"""The sampling surface over gRPC: n completions, top and prompt logprobs, penalties, logit_bias, min_tokens and the
matched stop, through the typed Python client (enum members, not protobuf integers)."""

from __future__ import annotations

import pytest

from inference_svc.engine.types import FinishReason

PROMPT = "def read(self, size=-1):\n    "


def test_n_choices_over_unary_and_stream(client) -> None:
    whole = client.generate(PROMPT, max_new_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.text == whole.choices[0].text and whole.token_ids == whole.choices[0].token_ids
    assert whole.usage.completion_tokens == 18
    assert all(c.finish_reason is FinishReason.LENGTH for c in whole.choices)
    texts: dict[int, str] = {}
    finished = set()
    for chunk in client.generate_stream(PROMPT, max_new_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True):
        texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
        if chunk.finished:
            finished.add(chunk.index)
            assert chunk.usage is not None and chunk.usage.completion_tokens == 6
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]  # seeded: the same three completions
    alone = client.generate(PROMPT, max_new_tokens=6, temperature=1.0, seed=13, ignore_eos=True)
    assert alone.token_ids == whole.choices[2].token_ids  # completion i uses seed + i


def test_top_and_prompt_logprobs(client) -> None:
    ids = list(client.tokenize(PROMPT).token_ids)
    r = client.generate(ids, max_new_tokens=5, top_logprobs=3, prompt_logprobs=1, ignore_eos=True)
    assert len(r.top_logprobs) == 5 and len(r.logprobs) == 5
    for tok, lp, entry in zip(r.token_ids, r.logprobs, r.top_logprobs, strict=True):
        assert entry.token_id == tok and entry.logprob == lp and len(entry.top) == 3
        assert entry.top[0] == (tok, pytest.approx(lp))  # greedy: the chosen token is the best
    assert [e.token_id for e in r.prompt_logprobs] == ids[1:]
    assert all(e.logprob <= 0 and len(e.top) == 1 for e in r.prompt_logprobs)
    first = next(iter(client.generate_stream(ids, max_new_tokens=2, prompt_logprobs=0)))
    assert [e.token_id for e in first.prompt_logprobs] == ids[1:]
    assert [e.logprob for e in first.prompt_logprobs] == pytest.approx([e.logprob for e in r.prompt_logprobs])


def test_logit_bias_min_tokens_and_the_matched_stop(client) -> None:
    forced = client.generate(PROMPT, max_new_tokens=4, logit_bias={100: 100.0}, ignore_eos=True)
    assert forced.token_ids == (100, 100, 100, 100)
    stopped = client.generate(PROMPT, max_new_tokens=8, logit_bias={100: 100.0}, stop_token_ids=[100], min_tokens=2)
    assert len(stopped.token_ids) == 3 and stopped.token_ids[-1] == 100 and 100 not in stopped.token_ids[:2]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.stop_reason == 100
    plain = client.generate(PROMPT, max_new_tokens=12, ignore_eos=True)
    needle = plain.text[2:5]
    by_string = client.generate(PROMPT, max_new_tokens=12, stop=[needle], ignore_eos=True)
    assert by_string.stop_reason == needle and by_string.finish_reason is FinishReason.STOP
    last = list(client.generate_stream(PROMPT, max_new_tokens=12, stop=[needle], ignore_eos=True))[-1]
    assert last.stop_reason == needle


def test_penalties_change_the_output_and_bad_values_name_the_field(client) -> None:
    import grpc

    plain = client.generate(PROMPT, max_new_tokens=16, ignore_eos=True)
    penalized = client.generate(PROMPT, max_new_tokens=16, frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True)
    assert len(set(penalized.token_ids)) >= len(set(plain.token_ids))
    for kwargs, field in (
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
        ({"min_tokens": 99, "max_new_tokens": 4}, "min_tokens"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            client.generate(PROMPT, **kwargs)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(field)
