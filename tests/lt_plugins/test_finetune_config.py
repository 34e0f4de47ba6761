"""Config once: the `strategy` and `checkpointing` sections are derived from ZeroConfig and CheckpointingConfig
(`section_fields`), carry their defaults and docstrings, and build them back generically."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from omegaconf import OmegaConf

from inference_svc.dataclass_flags import field_docs
from lt_plugins.checkpointing import CheckpointingConfig
from lt_plugins.config import CheckpointingSection, StrategySection, build_from_section, load_config, section_fields
from lt_plugins.zero_config import ZeroConfig


def test_sections_carry_every_field_of_their_dataclass() -> None:
    for section, source in ((StrategySection, ZeroConfig), (CheckpointingSection, CheckpointingConfig)):
        assert {f.name for f in fields(source) if f.init} <= {f.name for f in fields(section)}
        docs, source_docs = field_docs(section), field_docs(source)
        for f in fields(source):
            if f.init and f.name != "mode":  # checkpointing.mode is re-declared to add `auto`
                assert docs[f.name] == source_docs[f.name]
    assert "auto" in field_docs(CheckpointingSection)["mode"]
    overrides = ["strategy.stage=3", "strategy.param_persistence_threshold=7", "strategy.timeout_s=60"]
    overrides += ["checkpointing.mode=full", "checkpointing.allow_direct_params=false", "checkpointing.every_n=2"]
    cfg = load_config("configs/tiny-cpu.yaml", overrides)
    assert cfg.strategy.zero_config() == ZeroConfig(stage=3, param_persistence_threshold=7, timeout_s=60)
    assert cfg.checkpointing.to_config() == CheckpointingConfig(mode="full", allow_direct_params=False, every_n=2)


def test_a_field_added_to_the_dataclass_is_a_yaml_key_with_its_default_and_docs() -> None:
    @dataclass(frozen=True)
    class Source:
        a: int = 1
        """The a."""
        b: tuple[str, ...] = ("x",)
        """The b."""
        c: str | None = None
        """The c."""
        d: dict[str, int] = field(default_factory=lambda: {"k": 1})
        """The d."""

    base = section_fields(Source, "SourceFields")

    @dataclass
    class Section(base):  # type: ignore[misc, valid-type]
        own: str = "mine"
        """Only here."""

    assert [f.name for f in fields(Section)] == ["a", "b", "c", "d", "own"]
    assert field_docs(Section) == {"a": "The a.", "b": "The b.", "c": "The c.", "d": "The d.", "own": "Only here."}
    first, second = Section(), Section()
    first.b.append("y")
    first.d["k"] = 2
    assert second.b == ["x"] and second.d == {"k": 1}  # fresh containers per instance, not a shared default
    merged = OmegaConf.merge(OmegaConf.structured(Section), OmegaConf.from_dotlist(["b=[p,q]", "c=z"]))
    section = OmegaConf.to_object(merged)
    assert build_from_section(Source, section) == Source(a=1, b=("p", "q"), c="z", d={"k": 1})
