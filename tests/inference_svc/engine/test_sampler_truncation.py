"""Truncation thresholds (top-k, top-p, min-p) by the C++ selection against the sorted rule, and the inverse-CDF
draw: what the sampler keeps and draws, on flat and peaked rows, ties, zeros and the engine's vocabulary size."""

from __future__ import annotations

import pytest
import torch

from inference_svc.engine import cpu_sampling
from inference_svc.engine.sampler import Sampler, SampleRequest, _thresholds_torch, probabilities
from inference_svc.engine.types import SamplingParams

native = cpu_sampling.extension()
needs_native = pytest.mark.skipif(native is None, reason="needs Tandem's CPU kernels (AVX-512 VNNI and a compiler)")


def _rows(seed: int, vocab: int) -> torch.Tensor:
    """Probability rows from flat to peaked, one with zeros (a masked vocabulary) and one with ties."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=g) * torch.tensor([0.1, 1.0, 3.0, 8.0, 2.0, 1.0])[:, None]
    logits[4, : vocab // 2] = float("-inf")  # half the vocabulary impossible
    logits[5] = torch.randint(0, 4, (vocab,), generator=g).float()  # four values, each many times
    return torch.softmax(logits, dim=-1)


def _kept(probs: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    return probs >= tau[:, None]


CASES = [
    ([0] * 6, [0.95] * 6, [0.0] * 6),
    ([0] * 6, [0.5, 0.9, 0.1, 0.999, 0.7, 0.6], [0.0] * 6),
    ([40] * 6, [1.0] * 6, [0.0] * 6),
    ([1, 2, 100, 5000, 8191, 3], [0.8] * 6, [0.0] * 6),
    ([0] * 6, [1.0] * 6, [0.05, 0.1, 0.2, 0.5, 0.01, 0.3]),
    ([64] * 6, [0.9] * 6, [0.02] * 6),
]  # fmt: skip
"""(top_k, top_p, min_p) per row: top-p alone, top-k alone, both, min-p alone, all three."""


@needs_native
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("top_k", "top_p", "min_p"), CASES)
def test_the_selection_keeps_exactly_what_the_sorted_rule_keeps(seed, top_k, top_p, min_p) -> None:
    probs = _rows(seed, 8192)
    tau = native.truncation_thresholds(
        probs, torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float64), torch.tensor(min_p, dtype=torch.float64)
    )
    expected = _thresholds_torch(probs, top_k, top_p, min_p)
    assert torch.equal(_kept(probs, tau), _kept(probs, expected))


@needs_native
@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [CASES[0], CASES[3], CASES[5]])
def test_the_selection_keeps_what_the_sorted_rule_keeps_over_a_real_vocabulary(top_k, top_p, min_p) -> None:
    # Qwen's 151,936 tokens: most of a peaked row lies under the floor the selection narrows to first, a flat row's
    # does not (rows 0 and 3 of `_rows`)
    probs = _rows(2, 151936)
    args = (torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float64), torch.tensor(min_p, dtype=torch.float64))
    tau = native.truncation_thresholds(probs, *args)
    assert torch.equal(_kept(probs, tau), _kept(probs, _thresholds_torch(probs, top_k, top_p, min_p)))


def test_the_sorted_rule_keeps_the_smallest_set_reaching_top_p_and_every_tie_at_its_boundary() -> None:
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1, 0.0], [0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0]])
    # row 0: 0.4 + 0.2 reaches 0.5, and the other 0.2 is tied with it: both kept; row 1: 0.5 + 0.25 reaches 0.7
    tau = _thresholds_torch(probs, [0, 0], [0.5, 0.7], [0.0, 0.0])
    assert _kept(probs, tau).tolist() == [
        [True, True, True, False, False, False],
        [True, True, False, False, False, False],
    ]
    # top-k 1 keeps the best; min-p 0.3 keeps what has at least 0.3 x the best
    assert _kept(probs, _thresholds_torch(probs, [1, 1], [1.0, 1.0], [0.0, 0.0]))[:, 0].all()
    assert _kept(probs, _thresholds_torch(probs, [1, 1], [1.0, 1.0], [0.0, 0.0])).sum().item() == 2
    assert _kept(probs, _thresholds_torch(probs, [0, 0], [1.0, 1.0], [0.3, 0.3])).sum(dim=1).tolist() == [3, 2]
    if native is not None:
        for k, p, m in (
            ([0, 0], [0.5, 0.7], [0.0, 0.0]),
            ([1, 1], [1.0, 1.0], [0.0, 0.0]),
            ([0, 0], [1.0, 1.0], [0.3, 0.3]),
        ):
            got = native.truncation_thresholds(probs, torch.tensor(k), torch.tensor(p, dtype=torch.float64),
                                               torch.tensor(m, dtype=torch.float64))  # fmt: skip
            assert torch.equal(_kept(probs, got), _kept(probs, _thresholds_torch(probs, k, p, m)))


@needs_native
def test_min_p_rounds_its_threshold_as_the_sorted_rule_does() -> None:
    # 0.3 x 0.7 in fp64 (0.21) and in fp32 (0.3f x 0.7f) differ by a float step: the token between is kept by both
    # rules or by neither
    probs = torch.tensor([[0.7, 0.20999999, 0.05, 0.04]])
    args = ([0], [1.0], [0.3])
    want = _thresholds_torch(probs, *args)
    got = native.truncation_thresholds(
        probs,
        torch.tensor(args[0]),
        torch.tensor(args[1], dtype=torch.float64),
        torch.tensor(args[2], dtype=torch.float64),
    )
    assert torch.equal(got, want)


def test_probabilities_are_renormalized_over_what_truncation_keeps() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    req = SampleRequest(SamplingParams(temperature=1.0, top_p=0.7, min_p=0.0), [], None)
    probs = probabilities(logits, [req])
    assert torch.allclose(probs, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]))
    req = SampleRequest(SamplingParams(temperature=1.0, min_p=0.5), [], None)  # min-p too: a distribution
    assert torch.allclose(probabilities(logits, [req]), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_a_draw_never_picks_a_token_of_weight_zero_and_follows_the_weights() -> None:
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0]]).repeat(20000, 1)
    reqs = [SampleRequest(SamplingParams(temperature=1.0), [], None)] * 20000
    tokens = Sampler(seed=5).draw(weights, reqs)
    counts = torch.bincount(tokens, minlength=5)
    assert counts[0] == counts[2] == counts[4] == 0
    assert abs(counts[1].item() / 20000 - 0.75) < 0.02
    edge = torch.tensor([[0.0, 0.0, 1e-30, 0.0]])  # the only positive weight, however small
    assert Sampler(seed=0).draw(edge, reqs[:1]).tolist() == [2]


def test_a_seeded_draw_repeats_and_ignores_the_batch() -> None:
    weights = torch.softmax(torch.randn(3, 1000, generator=torch.Generator().manual_seed(2)), dim=-1)
    seeded = [SampleRequest(SamplingParams(temperature=1.0, seed=7), [], torch.Generator().manual_seed(7))]
    alone = Sampler().draw(weights[1:2], seeded)
    shared = SampleRequest(SamplingParams(temperature=1.0), [], None)
    again = [
        shared,
        SampleRequest(SamplingParams(temperature=1.0, seed=7), [], torch.Generator().manual_seed(7)),
        shared,
    ]
    assert Sampler().draw(weights, again)[1] == alone[0]


def _mixed_batch(trial: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Rows of every scale, one with a masked vocabulary and one with a NaN; greedy, tiny-temperature, seeded and
    unseeded rows, each truncation alone and together."""
    g = torch.Generator().manual_seed(trial)
    rows, vocab = 1 + trial % 5, (7, 100, 8192)[trial % 3]
    logits = torch.randn(rows, vocab, generator=g) * (0.1, 1.0, 5.0, 30.0)[trial % 4]
    if trial % 7 == 0:
        logits[0, ::3] = float("-inf")  # not finite: the sampler fails the row
    if trial % 11 == 0 and rows > 1:
        logits[1, 2] = float("nan")
    params = [
        SamplingParams(
            temperature=(0.0, 0.5, 1.0, 1e-30, 2.0)[(trial + i) % 5],
            top_k=(0, 1, 5, 50)[(trial + 2 * i) % 4],
            top_p=(1.0, 0.9, 0.5)[(trial + i) % 3],
            min_p=(0.0, 0.05)[(trial + i) % 2],
            seed=None if (trial + i) % 2 else trial + i,
        )
        for i in range(rows)
    ]
    return logits, params


def _three_steps(logits: torch.Tensor, params: list[SamplingParams], native_on: bool) -> list:
    """Tokens (failed rows as -1) and failed rows of three sampling steps of a fresh sampler (`native`: the load
    plan's `cpu_kernels` choice)."""
    sampler = Sampler(seed=3, native=native_on)
    requests = [
        SampleRequest(p, [1], None if p.seed is None else torch.Generator().manual_seed(p.seed)) for p in params
    ]
    steps = [sampler.sample(logits, requests) for _ in range(3)]
    return [([-1 if j in s.failed else t for j, t in enumerate(s.tokens)], s.failed) for s in steps]


@needs_native
@pytest.mark.parametrize("trial", range(24))
def test_the_one_call_sampler_draws_the_tokens_of_the_torch_path(trial) -> None:
    logits, params = _mixed_batch(trial)
    assert _three_steps(logits, params, True) == _three_steps(logits, params, False)


@needs_native
def test_the_one_call_sampler_refuses_per_row_lists_of_the_wrong_length() -> None:
    with pytest.raises(RuntimeError, match="every per-row list needs 2 entries, got 1"):
        native.sample_rows(torch.zeros(2, 8), [1.0], [False, False], [0, 0], [1.0, 1.0], [0.0, 0.0], [0.5, 0.5])


@needs_native
@pytest.mark.parametrize("trial", range(12))
def test_an_all_greedy_batch_takes_the_torch_paths_tokens_in_one_call(trial) -> None:
    logits, params = _mixed_batch(trial)
    logits[0, 1:4] = logits[0].max() + 1.0  # a tie for the largest value: the first index wins, as torch.argmax
    greedy = [SamplingParams(temperature=0.0, seed=p.seed) for p in params]
    assert _three_steps(logits, greedy, True) == _three_steps(logits, greedy, False)
    tokens, failed = native.greedy_rows(logits)
    finite = torch.isfinite(logits).all(dim=-1)
    assert failed == (~finite).nonzero()[:, 0].tolist()
    assert tokens == [int(row.argmax()) if ok else 0 for row, ok in zip(logits, finite, strict=True)]
    assert tokens[0] == 1 or 0 in failed


@needs_native
@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 31, 8192, 8203])
def test_the_greedy_rows_are_torch_argmax_at_every_width(vocab) -> None:
    """The kernel reads 16 lanes at a time: widths around and off a multiple of 16, rows of many ties (small
    integers), of +0 and -0 only, and rows with a NaN or an infinity (refused: token 0)."""
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(6):
        rows = torch.randint(-3, 4, (6, vocab), generator=gen).float()  # [6, V], ties for the largest value
        rows[1] = torch.randn(vocab, generator=gen)
        rows[2] = 0.0
        rows[2, ::2] = -0.0
        rows[3, (trial * 7) % vocab] = float("nan")
        rows[4, -1 - (trial % vocab)] = float("inf") if trial % 2 else -float("inf")
        tokens, failed = native.greedy_rows(rows)
        finite = torch.isfinite(rows).all(dim=-1)
        assert failed == (~finite).nonzero()[:, 0].tolist()
        assert tokens == [int(row.argmax()) if ok else 0 for row, ok in zip(rows, finite, strict=True)], trial


@needs_native
def test_the_greedy_rows_refuse_what_is_not_fp32_rows() -> None:
    with pytest.raises(RuntimeError, match="greedy_rows: logits must be a CPU fp32"):
        native.greedy_rows(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="greedy_rows: the vocabulary is empty"):
        native.greedy_rows(torch.zeros(2, 0))
