"""Sampling transforms and incremental detokenization."""

from __future__ import annotations

import torch

from inference_svc.engine.detokenizer import IncrementalDetokenizer
from inference_svc.engine.sampler import Sampler, SampleRequest
from inference_svc.engine.types import SamplingParams


def _req(seed=None, **kw) -> SampleRequest:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SampleRequest(SamplingParams(**kw), [], gen)


def test_greedy_top_k_1_and_min_p_1_pick_the_argmax():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1).tolist()
    s = Sampler(seed=0)
    assert s.sample(logits, [_req()] * 4)[0] == best
    assert s.sample(logits, [_req(temperature=1.0, top_k=1)] * 4)[0] == best
    assert s.sample(logits, [_req(temperature=1.0, min_p=1.0)] * 4)[0] == best
    assert s.sample(logits, [_req(temperature=1.0, top_p=1e-6)] * 4)[0] == best


def test_top_k_top_p_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 2000)
    s = Sampler(seed=1)
    toks = set(s.sample(logits, [_req(temperature=1.0, top_k=2)] * 2000)[0])
    assert toks == {0, 1}
    # p(0)=0.64, p(1)=0.24: top_p 0.8 keeps exactly {0, 1}
    toks = set(s.sample(logits, [_req(temperature=1.0, top_p=0.8)] * 2000)[0])
    assert toks == {0, 1}


def test_sampling_matches_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(20000, 1)
    toks = torch.tensor(Sampler(seed=3).sample(logits, [_req(temperature=1.0)] * 20000)[0])
    freq = torch.bincount(toks, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.02)


def test_seeded_rows_ignore_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(9)
    row = torch.randn(1, 50, generator=g)
    other = torch.randn(5, 50, generator=g)
    alone = Sampler().sample(row, [_req(seed=42, temperature=1.0)])[0]
    batch = torch.cat([other[:2], row, other[2:]])
    reqs = [_req(temperature=1.0)] * 2 + [_req(seed=42, temperature=1.0)] + [_req(temperature=0.5)] * 3
    assert Sampler().sample(batch, reqs)[0][2] == alone[0]


def test_repetition_penalty_and_logprobs():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    req = SampleRequest(SamplingParams(repetition_penalty=2.0, logprobs=True), [0], None)
    toks, lps, failed, _ = Sampler().sample(logits, [req])
    assert failed == []
    assert toks == [1]  # 2.0 / 2 = 1.0 < 1.9
    assert abs(lps[0] - torch.log_softmax(logits, -1)[0, 1].item()) < 1e-6  # raw-model log-probability


def test_multibyte_characters_stream_exactly(small_tokenizer):
    text = "héllo wörld — 世界 🎉🎉 naïve ✓ done"
    ids = small_tokenizer.encode(text)
    assert len(ids) > len(text) / 2  # rare characters split into byte tokens
    d = IncrementalDetokenizer(small_tokenizer)
    deltas = [d.add(t) for t in ids]
    deltas.append(d.flush())
    assert "".join(deltas) == text == small_tokenizer.decode(ids)
    assert all("\ufffd" not in x for x in deltas)


def test_stop_string_across_tokens_is_stripped(small_tokenizer):
    text = "alpha beta STOP gamma"
    ids = small_tokenizer.encode(text)
    d = IncrementalDetokenizer(small_tokenizer, stop=("ta ST", "zzz"))
    deltas = []
    for t in ids:
        deltas.append(d.add(t))
        if d.stopped:
            break
    deltas.append(d.flush())
    assert d.stopped
    assert "".join(deltas) == "alpha be"
    assert d.final_text() == "alpha be"


def test_partial_character_is_flushed_at_the_end(small_tokenizer):
    ids = small_tokenizer.encode("🎉")
    d = IncrementalDetokenizer(small_tokenizer)
    deltas = [d.add(t) for t in ids[:-1]]
    deltas.append(d.flush())
    assert "".join(deltas) == small_tokenizer.decode(ids[:-1])
