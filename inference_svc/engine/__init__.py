"""The inference engine: paged KV cache, continuous batching, prefix caching, sampling.

Use it from Python: `Engine.from_bundle(folder, EngineConfig(...))`, then `add_request` / `step` / `abort_request`,
or `generate(prompts, sampling)` to run to completion.
"""

from inference_svc.engine.config import EngineConfig, EngineConfigError, parse_bytes
from inference_svc.engine.engine import Engine
from inference_svc.engine.loader import kv_bytes_per_token
from inference_svc.engine.outputs import GenerationResult
from inference_svc.engine.types import (
    EngineInfo,
    EngineStats,
    FinishReason,
    RequestOutput,
    SamplingParams,
    Timing,
    Usage,
)

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
