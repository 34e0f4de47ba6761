"""Config once: the `strategy` and `checkpointing` sections mirror ZeroConfig and CheckpointingConfig field for field
(checked at import by `mirrors`), and build them generically; a drifting section is refused naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import pytest

from lt_plugins.checkpointing import CheckpointingConfig
from lt_plugins.config import CheckpointingSection, StrategySection, load_config, mirrors
from lt_plugins.strategy import ZeroConfig


def test_sections_carry_every_field_of_their_dataclass() -> None:
    for section, source in ((StrategySection, ZeroConfig), (CheckpointingSection, CheckpointingConfig)):
        assert {f.name for f in fields(source) if f.init} <= {f.name for f in fields(section)}
    overrides = ["strategy.stage=3", "strategy.param_persistence_threshold=7", "strategy.timeout_s=60"]
    overrides += ["checkpointing.mode=full", "checkpointing.allow_direct_params=false", "checkpointing.every_n=2"]
    cfg = load_config("configs/tiny-cpu.yaml", overrides)
    assert cfg.strategy.zero_config() == ZeroConfig(stage=3, param_persistence_threshold=7, timeout_s=60)
    assert cfg.checkpointing.to_config() == CheckpointingConfig(mode="full", allow_direct_params=False, every_n=2)


def test_a_section_missing_or_changing_a_field_is_refused() -> None:
    @dataclass(frozen=True)
    class Source:
        a: int = 1
        b: tuple[str, ...] = ("x",)

    @dataclass
    class Complete:
        a: int = 1
        b: list[str] = field(default_factory=lambda: ["x"])
        own: str = "mine"

    assert mirrors(Source)(Complete) is Complete

    @dataclass
    class Missing:
        a: int = 1

    with pytest.raises(TypeError, match="Missing lacks the field 'b' of Source"):
        mirrors(Source)(Missing)

    @dataclass
    class Drifted:
        a: int = 2
        b: list[str] = field(default_factory=lambda: ["x"])

    with pytest.raises(TypeError, match=r"Drifted\.a defaults to 2 but Source\.a to 1"):
        mirrors(Source)(Drifted)
