"""The parts of speculative decoding on their own: the rejection sampler's distribution, prompt lookup, back-off.

The statistical tests draw from fixed seeds, so they are deterministic; each compares an empirical distribution
with the target by a chi-square test and fails when the p-value is below 1e-4, i.e. with random seeds a correct
sampler would fail one such check in 10,000 runs.
"""

from __future__ import annotations

import torch

from inference_svc.engine.detokenizer import IncrementalDetokenizer
from inference_svc.engine.rejection import verify
from inference_svc.engine.sampler import Sampler, SampleRequest, probabilities
from inference_svc.engine.sequence import Sequence
from inference_svc.engine.speculative import NgramProposer, SpeculationPolicy, best_k, expected_tokens
from inference_svc.engine.types import SamplingParams

V = 6
TRIALS = 6000
P_FLOOR = 1e-4


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of counts [V] against probs [V] (cells with probability 0 must be empty)."""
    n = counts.sum().item()
    live = probs > 0
    assert counts[~live].sum() == 0, f"drew tokens of probability 0: {counts.tolist()}"
    expected = probs[live].double() * n
    stat = ((counts[live].double() - expected) ** 2 / expected).sum()
    dof = int(live.sum()) - 1
    return float(1 - torch.special.gammainc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def _rows(seed: int) -> torch.Tensor:
    return torch.randn(3, V, generator=torch.Generator().manual_seed(seed)) * 1.5  # [K+1 = 3, V]


def _requests(params: SamplingParams, generator: torch.Generator) -> list[SampleRequest]:
    return [SampleRequest(params, [0] * (1 + i), generator) for i in range(3)]


def test_rejection_sampling_with_point_drafts_keeps_the_target_distribution():
    """n-gram drafts are point masses: the first token must still follow p0, the second p1 given the first."""
    logits = _rows(0)
    params = SamplingParams(temperature=0.8, top_k=5, seed=1)
    target = probabilities(logits, _requests(params, torch.Generator()))  # [3, V]
    drafts = [int(target[0].argmax()), int(target[1].argmin())]  # a likely draft, then a masked-out one
    gen = torch.Generator().manual_seed(1234)
    sampler = Sampler(seed=0)
    first = torch.zeros(V, dtype=torch.int64)
    second = torch.zeros(V, dtype=torch.int64)
    for _ in range(TRIALS):
        out = verify(sampler, logits, _requests(params, gen), drafts)
        first[out.tokens[0]] += 1
        if len(out.tokens) > 1:
            assert out.tokens[0] == drafts[0] and out.num_accepted >= 1
            second[out.tokens[1]] += 1
    assert _chi_square_p(first, target[0]) > P_FLOOR
    assert second.sum() > TRIALS * target[0, drafts[0]] * 0.8
    assert second[drafts[1]] == 0  # top-k masked it: never kept
    assert _chi_square_p(second, target[1]) > P_FLOOR


def test_rejection_sampling_with_a_draft_distribution_keeps_the_target_distribution():
    """Drafts sampled from another distribution q (a draft model's): the emitted tokens still follow p."""
    logits = _rows(1)
    params = SamplingParams(temperature=1.0, seed=2)
    target = probabilities(logits, _requests(params, torch.Generator()))
    q = torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(9)), dim=-1)  # [K = 2, V]
    draw = torch.Generator().manual_seed(77)
    gen = torch.Generator().manual_seed(5)
    sampler = Sampler(seed=0)
    first = torch.zeros(V, dtype=torch.int64)
    accepted = 0
    for _ in range(TRIALS):
        drafts = [int(torch.multinomial(q[i], 1, generator=draw)) for i in range(2)]
        out = verify(sampler, logits, _requests(params, gen), drafts, draft_probs=q)
        first[out.tokens[0]] += 1
        accepted += out.num_accepted
    assert _chi_square_p(first, target[0]) > P_FLOOR
    assert accepted > 0
    # the chance of keeping draft 0 is sum_x min(p(x), q(x)): the empirical rate must be close to it
    keep0 = float(torch.minimum(target[0], q[0]).sum())
    assert accepted / TRIALS >= keep0 * 0.9


def test_greedy_verify_keeps_the_agreeing_prefix_and_adds_the_target_token():
    logits = torch.full((4, V), -1.0)
    for row, best in enumerate([3, 1, 4, 2]):
        logits[row, best] = 2.0
    requests = [SampleRequest(SamplingParams(), [0] * (1 + i), None) for i in range(4)]
    assert verify(Sampler(), logits, requests, [3, 1, 5]).tokens == [3, 1, 4]  # third draft wrong: target's 4
    assert verify(Sampler(), logits, requests, [3, 1, 4]).tokens == [3, 1, 4, 2]  # all kept, plus the bonus
    assert verify(Sampler(), logits, requests, [0, 1, 4]).tokens == [3]
    nan = logits.clone()
    nan[2, 0] = float("nan")
    assert verify(Sampler(), nan, requests, [3, 1, 4]).failed


def test_verify_applies_penalties_with_each_rows_own_history():
    """Row 1's history includes draft 0: a repetition penalty there changes row 1's choice, as plain decoding
    would after emitting that draft."""
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0, 0.0, 0.0], [0.0, 3.0, 2.9, 0.0, 0.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0)
    requests = [SampleRequest(params, [5], None), SampleRequest(params, [5, 1], None)]
    assert verify(Sampler(), logits, requests, [1]).tokens == [1, 2]


def _seq(tokens: list[int]) -> Sequence:
    tok = type("T", (), {"decode": lambda self, ids: ""})()
    return Sequence("r", 0, list(tokens), len(tokens), SamplingParams(), 0.0, IncrementalDetokenizer(tok, ()),
                    frozenset())  # fmt: skip


def test_prompt_lookup_proposes_what_followed_the_longest_latest_match():
    p = NgramProposer(ngram_min=1, ngram_max=3)
    seq = _seq([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert p.propose(seq, 2).tokens == (7, 8)  # "2 3" last occurred before 7 8 (the longest suffix found: "2 3")
    seq.token_ids += [7]
    assert p.propose(seq, 3).tokens == (8, 5, 2)  # "2 3 7" → 8 5 2 (index caught up incrementally)
    assert p.propose(_seq([4, 5, 6]), 3).tokens == ()
    assert p.propose(_seq([1, 2, 3]), 0).tokens == ()


def test_prompt_lookup_continues_a_loop_past_the_end():
    p = NgramProposer(ngram_min=1, ngram_max=4)
    assert p.propose(_seq([7, 1, 2, 1, 2, 1, 2]), 5).tokens == (1, 2, 1, 2, 1)


def test_back_off_stops_drafting_when_drafts_are_rejected_and_recovers():
    policy = SpeculationPolicy(verify_cost=0.1)
    drafted_steps = 0
    for _ in range(200):  # every draft rejected
        k = policy.num_drafts("r", 4)
        if k:
            drafted_steps += 1
            policy.observe("r", k, 0)
    assert drafted_steps < 20  # pauses double up to 64 steps: a handful of probes in 200 steps
    for _ in range(100):  # drafts kept again: the first probe after a pause brings K back up
        k = policy.num_drafts("r", 4)
        if k:
            policy.observe("r", k, k)
    assert policy.num_drafts("r", 4) == 4


def test_cost_model_prefers_long_drafts_only_when_they_are_kept():
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == 1.75
    assert best_k(0.9, 8, 0.1)[0] > best_k(0.5, 8, 0.1)[0]
    assert best_k(0.05, 8, 0.1)[1] < 1.0  # below the break-even rate nothing pays
