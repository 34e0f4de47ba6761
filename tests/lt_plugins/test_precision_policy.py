"""The precision policy keeps selected modules in fp32 under bf16 parameters and under autocast."""

from __future__ import annotations

import torch
from torch import nn

from lt_plugins.precision import PrecisionPolicy
from shared_model.model import RMSNorm


class _Probe(nn.Module):
    """Records the dtypes its forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, self.weight.dtype))
        return x * self.weight


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = RMSNorm(8, 1e-6)
        self.probe = _Probe()
        self.head = nn.Linear(8, 5)
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.head(self.probe(self.norm(self.proj(x)))), y)


def test_selected_modules_compute_in_fp32_with_bf16_parameters() -> None:
    net = _Net().to(torch.bfloat16)
    policy = PrecisionPolicy(names=("probe",))
    assert policy.apply(net) == ["norm", "probe", "loss_fn"]
    assert policy.apply(net) == ["norm", "probe", "loss_fn"]  # idempotent
    out: dict[str, torch.dtype] = {}
    net.probe.register_forward_hook(lambda m, i, o: out.update(dtype=o.dtype))
    loss = net(torch.randn(3, 8, dtype=torch.bfloat16), torch.tensor([0, 1, 2]))
    assert net.probe.seen == [(torch.float32, torch.float32)]  # inside: fp32 inputs and parameters
    assert out["dtype"] == torch.bfloat16  # outside: back to the caller's dtype
    assert loss.dtype == torch.float32  # losses stay fp32
    loss.backward()
    assert isinstance(net.probe.weight, nn.Parameter) and net.probe.weight.dtype == torch.bfloat16
    assert net.probe.weight.grad is not None and net.norm.weight.grad is not None


def test_policy_disables_autocast_inside() -> None:
    net = _Net()
    PrecisionPolicy(classes=(), names=("probe",)).apply(net)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = net.proj(torch.randn(2, 8))
        assert h.dtype == torch.bfloat16
        assert net.probe(h).dtype == torch.bfloat16
    assert net.probe.seen == [(torch.float32, torch.float32)]
