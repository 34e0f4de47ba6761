"""LitCausalLM's optimizer: AdamW through torch's multi-tensor (foreach) implementation, which torch picks on CUDA
but not on a CPU, where it takes about half the per-tensor loop's time on the demo's model (docs/benchmarks.md §46).
The choice must not change a trained bit: the same updates as the per-tensor loop, over both parameter groups."""

from __future__ import annotations

import torch

from lt_plugins.config import OptimSection
from lt_plugins.lit_module import LitCausalLM
from tests.conftest import tiny_config


def _module() -> LitCausalLM:
    module = LitCausalLM(tiny_config(), OptimSection(lr=5e-3, weight_decay=0.1), seed=0)
    module.configure_model()
    return module


def test_adamw_runs_foreach_with_the_per_tensor_loops_bits() -> None:
    ours, reference = _module(), _module()
    optimizer = ours.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["foreach"] is True
    name_of = {id(p): n for n, p in ours.named_parameters()}
    theirs = dict(reference.named_parameters())
    groups = [  # the same groups over the reference's parameters, through the per-tensor loop
        {**{k: v for k, v in g.items() if k != "params"}, "params": [theirs[name_of[id(p)]] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    assert len(groups) == 2 and {g["weight_decay"] for g in groups} == {0.0, 0.1}  # matrices decay, vectors not
    loop = torch.optim.AdamW(groups, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for name, a in ours.named_parameters():
            a.grad = torch.randn(a.shape, generator=gen)
            theirs[name].grad = a.grad.clone()
        optimizer.step()
        loop.step()
    for name, a in ours.named_parameters():
        assert torch.equal(a, theirs[name]), name
