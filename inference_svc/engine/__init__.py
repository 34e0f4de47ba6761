"""The inference engine: paged KV cache, continuous batching, prefix caching, sampling.

Use it from Python: `Engine.from_bundle(folder, EngineConfig(...))`, then `add_request` / `step` / `abort_request`,
or `generate(prompts, sampling)` to run to completion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inference_svc.engine.config import EngineConfig, EngineConfigError, parse_bytes
from inference_svc.engine.types import (
    EngineInfo,
    EngineStats,
    FinishReason,
    RequestOutput,
    SamplingParams,
    Timing,
    Usage,
)

if TYPE_CHECKING:
    from inference_svc.engine.engine import Engine
    from inference_svc.engine.loader import kv_bytes_per_token
    from inference_svc.engine.outputs import GenerationResult

_LAZY = {"Engine": "engine", "GenerationResult": "outputs", "kv_bytes_per_token": "loader"}
"""Imported on first use: the engine imports torch, and `tandem serve` parses its flags (this package's config)
before torch starts (`inference_svc.cli.set_omp_wait`)."""


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"inference_svc.engine.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineInfo",
    "EngineStats",
    "FinishReason",
    "GenerationResult",
    "RequestOutput",
    "SamplingParams",
    "Timing",
    "Usage",
    "kv_bytes_per_token",
    "parse_bytes",
]
