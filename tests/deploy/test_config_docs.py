"""docs/configuration.md is generated from the structured configs; it must match what the generator writes now."""

from __future__ import annotations

import importlib.util
import runpy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def generator() -> dict:
    if importlib.util.find_spec("omegaconf") is None or importlib.util.find_spec("lightning") is None:
        pytest.skip("the training extra (lt_plugins' schema) is not installed")
    return runpy.run_path(str(REPO / "scripts/gen_config_docs.py"))


def test_configuration_doc_is_current(generator: dict) -> None:
    committed = (REPO / "docs/configuration.md").read_text()
    assert committed == generator["render"](), "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


def test_every_config_field_is_documented(generator: dict) -> None:
    import dataclasses

    from inference_svc.engine.config import EngineConfig
    from inference_svc.settings import AdmissionLimits, ServerSettings
    from lt_plugins.config import TrainConfig

    text = (REPO / "docs/configuration.md").read_text()
    classes = [ServerSettings, AdmissionLimits, EngineConfig, TrainConfig]
    classes += [
        type(f.default_factory())
        for f in dataclasses.fields(TrainConfig)
        if f.default_factory is not dataclasses.MISSING
    ]
    for cls in classes:
        docs = generator["field_docs"](cls)
        for f in dataclasses.fields(cls):
            factory = f.default_factory
            if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory()):
                continue  # a section: it has its own table
            assert f"{f.name}`" in text, f"{cls.__name__}.{f.name} missing from docs/configuration.md"
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring under it"
    for variable in ("TANDEM_MODEL_DIR", "TANDEM_GRPC_PORT", "TANDEM_KV_CACHE_MEMORY", "TANDEM_API_KEYS_FILE"):
        assert f"`{variable}`" in text
