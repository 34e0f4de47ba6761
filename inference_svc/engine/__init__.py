"""The inference engine: paged KV cache, continuous batching, prefix caching, sampling.

Use it from Python: `Engine.from_bundle(folder, EngineConfig(...))`, then `add_request` / `step` / `abort_request`,
or `generate(prompts, sampling)` to run to completion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inference_svc.engine.config import EngineConfig, EngineConfigError, parse_bytes
from inference_svc.engine.types import EngineInfo, FinishReason, RequestOutput, SamplingParams, Timing, Usage

if TYPE_CHECKING:
    from inference_svc.engine.engine import Engine, EngineStats, GenerationResult, kv_bytes_per_token

_LAZY = ("Engine", "EngineStats", "GenerationResult", "kv_bytes_per_token")
"""Imported on first use: the engine imports torch, and `tandem serve` parses its flags (this package's config)
before torch starts (`inference_svc.cli.set_omp_wait`)."""


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from inference_svc.engine import engine

        return getattr(engine, name)
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
