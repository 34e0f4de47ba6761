"""MemoryLedger under a plain single-process strategy, and the byte-range accounting it measures with."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lt_plugins.errors import TrainingConfigError
from lt_plugins.ledger_callback import LedgerRow, LedgerSection, MemoryLedger
from lt_plugins.ledger_measure import ByteRanges
from lt_plugins.lora import LoraConfig, apply_lora
from lt_plugins.memory_model import ACTIVATIONS, FROZEN, GRADS, MASTER, MOMENTS, WEIGHTS
from shared_model.model import build_model
from tests.conftest import tiny_config


class _Lit(pl.LightningModule):
    def __init__(self, optimizer: str = "adamw", lora: LoraConfig | None = None) -> None:
        super().__init__()
        self.net = build_model(tiny_config(num_layers=2))
        self.optimizer = optimizer
        if lora is not None:  # any LightningModule: the public function, on the module's own layers
            apply_lora(self, lora)

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adamw":
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)
        return torch.optim.Adagrad(self.parameters(), lr=1e-3)


def _fit(tmp_path: Path, optimizer: str = "adamw", lora: LoraConfig | None = None) -> tuple[MemoryLedger, _Lit]:
    ledger = MemoryLedger(measure_at_step=1, report_dir=tmp_path)
    module = _Lit(optimizer, lora)
    data = torch.randint(0, 512, (6, 33), generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        callbacks=[ledger],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    return ledger, module


def test_plain_strategy_terms_match(tmp_path: Path) -> None:
    ledger, module = _fit(tmp_path)
    rows = {r.term: r for r in ledger.rows}
    size = sum(p.numel() * 4 for p in module.parameters())
    assert rows[WEIGHTS].measured == size and rows[GRADS].measured == size
    assert rows[MASTER].measured == 0 and rows[MOMENTS].measured >= 2 * size
    assert rows[ACTIVATIONS].measured == rows[ACTIVATIONS].predicted > 0
    assert all(not r.off_by_more_than(0.10) for r in ledger.rows)
    data = json.loads((tmp_path / "memory_ledger_rank0.json").read_text())
    assert data["layout"] is None and len(data["rows"]) == 7
    assert rows[FROZEN].predicted == rows[FROZEN].measured == 0  # full training: nothing frozen


@pytest.mark.parametrize("base_dtype", ["model", "bf16", "int8"])
def test_lora_terms_match_with_the_base_frozen_at_its_dtype(tmp_path: Path, base_dtype: str) -> None:
    """LoRA on a plain strategy: the frozen base is its own term at its dtype (fp32, bf16, or int8 + fp32 row
    scales), the trainable terms cover the adapters only; every term within 10% of its prediction."""
    from lt_plugins.lora import LoraLinear

    ledger, module = _fit(tmp_path, lora=LoraConfig(enabled=True, rank=4, base_dtype=base_dtype))
    rows = {r.term: r for r in ledger.rows}
    adapters = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert adapters == sum(m.rank * (m.in_features + m.out_features) for m in module.modules()
                           if isinstance(m, LoraLinear))  # fmt: skip
    assert rows[WEIGHTS].measured == rows[GRADS].measured == 4 * adapters  # fp32 adapters and their gradients
    steps = 8 * sum(1 for p in module.parameters() if p.requires_grad)  # AdamW's step counters
    assert 2 * 4 * adapters <= rows[MOMENTS].measured <= 2 * 4 * adapters + steps
    linears = [m for m in module.modules() if isinstance(m, LoraLinear)]
    base = sum(m.in_features * m.out_features for m in linears)
    rest = sum(p.numel() for n, p in module.named_parameters() if not p.requires_grad) - (
        base if base_dtype != "int8" else 0
    )
    per_element = {"model": 4, "bf16": 2}.get(base_dtype)
    expected = 4 * rest + (per_element * base if per_element else base + 4 * sum(m.out_features for m in linears))
    assert rows[FROZEN].measured == rows[FROZEN].predicted == expected
    assert all(not r.off_by_more_than(0.10) for r in ledger.rows), [r.to_dict() for r in ledger.rows]


def test_unknown_optimizer_leaves_moments_unpredicted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lt_plugins.ledger_callback"):
        ledger, _ = _fit(tmp_path, optimizer="adagrad")
    rows = {r.term: r for r in ledger.rows}
    assert rows[MOMENTS].predicted is None and rows[MOMENTS].ratio is None
    assert not caplog.records


def test_warns_when_a_term_is_off() -> None:
    row = LedgerRow("x", predicted=100.0, measured=111.0, rank=0)
    assert row.off_by_more_than(0.10) and not LedgerRow("x", 100.0, 109.0, 0).off_by_more_than(0.10)
    assert LedgerRow("x", 0.0, 0.0, 0).ratio == 1.0 and LedgerRow("x", 0.0, 1.0, 0).off_by_more_than(0.1)


def test_byte_ranges_count_views_once_and_shards_by_extent() -> None:
    flat = torch.zeros(100)
    ranges = ByteRanges()
    assert ranges.claim([flat[:50], flat[25:75]]) == 75 * 4
    assert ranges.claim([flat]) == 25 * 4  # only the bytes not covered yet
    assert ranges.claim([flat.view(10, 10).t()]) == 0
    assert ByteRanges().claim([flat.view(10, 10)[:, :2]]) == (9 * 10 + 2) * 4  # strided extent


def test_section_validation() -> None:
    with pytest.raises(TrainingConfigError, match=r"ledger\.measure_at_step"):
        LedgerSection(measure_at_step=0)
    with pytest.raises(TrainingConfigError, match=r"ledger\.tolerance"):
        LedgerSection(tolerance=2.0)
    with pytest.raises(TrainingConfigError, match=r"ledger\.measure_at_step"):
        MemoryLedger(measure_at_step=0)
