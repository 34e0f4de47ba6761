"""The precision policy keeps selected modules in fp32 under bf16 parameters and under autocast."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

from lt_plugins.precision import PrecisionPolicy, PrecisionPolicyCallback
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


class _BuiltLate(pl.LightningModule):
    """A user module that creates its layers in `configure_model`, after the callbacks' `setup` has run."""

    def __init__(self) -> None:
        super().__init__()
        self.net: _Net | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = _Net()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(*batch)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.net(*batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_callback_covers_layers_built_in_configure_model() -> None:
    data = [(torch.randn(8), torch.tensor(1)) for _ in range(4)]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    module = _BuiltLate()
    callback = PrecisionPolicyCallback(PrecisionPolicy(names=("net.probe",)))
    trainer = pl.Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader, loader)
    assert callback.wrapped == ["net.norm", "net.probe", "net.loss_fn"]
    # every forward, the sanity check's included, saw fp32 inside the probe despite bf16 autocast around it
    assert len(module.net.probe.seen) >= 3
    assert set(module.net.probe.seen) == {(torch.float32, torch.float32)}
