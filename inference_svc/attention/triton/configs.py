"""Launch policy for the Triton attention kernels: execution mode, tile sizes, split counts, autotuning.

Contract:
- The kernels hold no policy. Every launch takes its tile sizes from a function of the shapes defined here
  (`prefill_config`, `decode_config`, `decode_num_splits`), so a reader finds every tuning decision in one file.
- Interpreter or compiler: Triton fixes the mode of its own language library (tl.zeros, tl.max, ...) when
  `triton` is first imported, from ``TRITON_INTERPRET``; setting the variable later has no effect on it.
  `interpret_mode()` therefore reports the mode triton.language was built in, and `LazyKernel` jits each kernel
  in that same mode at its first launch. `interpreter_requested()` reads the variable now, so callers can tell
  "asked too late" apart from "not asked".
- `@triton.autotune` wraps a kernel only when the caller asks (`autotune=True`: the engine's
  `EngineConfig.triton_autotune`, recorded in its load plan; the kernels' own default is off), CUDA is present
  and nothing is interpreted: autotuning times several configs on the device, which fails without a GPU.
  Elsewhere one heuristic config is used (reproducible, and nothing to time at the first launch).
- In the interpreter, q, k and v are upcast to fp32 on load (`UPCAST`): Triton 3.9's interpreter stores bf16 as
  raw uint16 and does bf16 arithmetic wrongly, and fp32 numpy is also the fastest path there. Compiled, they are
  upcast (and the dots run in fp32, `dot_precision(float32)`) when the cache is stored in another dtype than q
  (`--kv-cache-dtype`: fp8/int8, or a float of another width).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

MAX_HEAD_DIM = 256
"""Largest head_dim the kernels accept; smaller non-powers of two are padded to the next power of two."""

MIN_KEYS_PER_SPLIT = 256
"""Split-KV decode never gives a split fewer keys than this: below it the merge costs more than it saves."""

MAX_SPLITS = 32
"""Upper bound on decode splits (the merge kernel keeps all splits of one head in registers)."""


def interpreter_requested() -> bool:
    """True when ``TRITON_INTERPRET`` is set to a true value in the environment now."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def interpret_mode() -> bool:
    """True when triton.language was imported in interpreter mode (``TRITON_INTERPRET=1`` before import)."""
    return isinstance(tl.zeros, InterpretedFunction)


def autotune_possible() -> bool:
    """Autotuning can run: a real CUDA device, and the kernels compiled rather than interpreted."""
    return not interpret_mode() and torch.cuda.is_available()


def pad_pow2(n: int, minimum: int = 16) -> int:
    """Next power of two ≥ n and ≥ minimum (tl.dot needs every dimension ≥ 16)."""
    return max(minimum, triton.next_power_of_2(n))


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: true fp32 for fp32 inputs (no TF32 rounding), the default for half types."""
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------------------------------------
# Prefill / extend
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillConfig:
    """One launch config of the prefill kernel."""

    block_m: int
    """Rows of one query tile: BLOCK_M // group query tokens × group query heads (GQA packing), a power of two."""
    block_n: int
    """Keys per inner-loop tile (any power of two; a tile may span several cache blocks)."""
    num_warps: int = 4
    num_stages: int = 2


def prefill_config(head_dim_pad: int, group: int, interpret: bool) -> PrefillConfig:
    """Heuristic prefill tiles from head_dim (padded) and the GQA group size."""
    if interpret:
        # Each program is interpreted op by op; fewer, larger tiles are much faster there.
        return PrefillConfig(block_m=max(128, pad_pow2(group)), block_n=128)
    if head_dim_pad <= 64:
        cfg = PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    elif head_dim_pad <= 128:
        cfg = PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    else:
        cfg = PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if cfg.block_m < group:
        cfg = PrefillConfig(pad_pow2(group), cfg.block_n, cfg.num_warps, cfg.num_stages)
    return cfg


def prefill_autotune_configs() -> list[triton.Config]:
    """The search space for prefill on CUDA (small: every config is compiled and timed once per key);
    `prune_prefill_configs` drops what a shape cannot use."""
    space = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in space]


def prune_prefill_configs(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list:
    """Keep configs whose query tile holds at least one full GQA group and whose tiles fit in shared memory."""
    group = int(kwargs.get("GROUP", named_args.get("GROUP", 1)))
    d = int(kwargs.get("HEAD_DIM_PAD", named_args.get("HEAD_DIM_PAD", 128)))
    kept = [
        c
        for c in configs
        if c.kwargs["BLOCK_M"] >= group and (d < 256 or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64)
    ]
    return kept or configs[:1]


# ----------------------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    """One launch config of the split-KV decode kernel."""

    block_n: int
    """Keys per inner-loop tile."""
    num_warps: int = 4
    num_stages: int = 2


def decode_config(head_dim_pad: int, interpret: bool) -> DecodeConfig:
    """Heuristic decode tile from head_dim (padded)."""
    if interpret:
        return DecodeConfig(block_n=128)
    if head_dim_pad <= 128:
        return DecodeConfig(block_n=64, num_warps=4, num_stages=3)
    return DecodeConfig(block_n=32, num_warps=4, num_stages=2)


def decode_autotune_configs() -> list[triton.Config]:
    """The search space for decode on CUDA (small: every config is compiled and timed once per key)."""
    space = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2)]
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in space]


def prune_decode_configs(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list:
    """Drop the largest key tiles for head_dim 256 (register pressure)."""
    d = int(kwargs.get("HEAD_DIM_PAD", named_args.get("HEAD_DIM_PAD", 128)))
    kept = [c for c in configs if d < 256 or c.kwargs["BLOCK_N"] <= 64]
    return kept or configs[:1]


def device_parallelism(device: torch.device) -> int:
    """How many programs keep the device busy: 2 per SM on CUDA; a fixed stand-in elsewhere."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 64


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, parallelism: int) -> int:
    """Split-KV count from the lengths: enough programs to fill the device, never < MIN_KEYS_PER_SPLIT each.

    `max_context` is an upper bound on the batch's context lengths that the host knows without reading the
    device (the block table's width × block size): a short batch gets 1 split (no merge pass); a few long
    sequences get many. Within one launch each sequence divides its own length by this count, so shorter
    sequences get shorter splits (and may leave trailing splits empty, which the merge ignores).
    """
    programs = max(1, num_seqs * num_kv_heads)
    want = triton.cdiv(parallelism, programs)
    most = max(1, max_context // MIN_KEYS_PER_SPLIT)
    return int(max(1, min(want, most, MAX_SPLITS)))


# ----------------------------------------------------------------------------------------------------------
# Lazy jitting
# ----------------------------------------------------------------------------------------------------------


class LazyKernel:
    """A kernel body jitted at first launch, interpreted or compiled (and autotuned) as `interpret_mode()` says.

    `autotune` is (configs factory, key argument names, prune function); it is applied only when a launch asks
    for it and `autotune_possible()`. `tuned(asked)` tells the launcher whether to pass the tile sizes itself.
    """

    def __init__(
        self,
        fn: Callable[..., None],
        autotune: tuple[Callable[[], list[triton.Config]], list[str], Callable[..., list]] | None = None,
    ) -> None:
        self._fn = fn
        self._autotune = autotune
        self._built: dict[tuple[bool, bool], Any] = {}

    def tuned(self, asked: bool) -> bool:
        """Whether a launch that `asked` for autotuning gets the autotuned kernel."""
        return asked and self._autotune is not None and autotune_possible()

    def get(self, autotune: bool = False) -> Any:
        """The jitted (and, on CUDA when asked, autotuned) kernel for the current mode; indexed as kernel[grid](...)."""
        mode = (interpret_mode(), self.tuned(autotune))
        if not mode[0] and not torch.cuda.is_available():
            why = "TRITON_INTERPRET=1 was set after triton was imported" if interpreter_requested() else "no CUDA"
            raise RuntimeError(f"Triton kernels cannot run here ({why}); see triton_backend.triton_available()")
        if mode not in self._built:
            kernel = InterpretedFunction(self._fn) if mode[0] else JITFunction(self._fn)
            if mode[1]:
                assert self._autotune is not None
                configs, key, prune = self._autotune
                kernel = triton.autotune(configs=configs(), key=key, prune_configs_by={"early_config_prune": prune})(
                    kernel
                )
            self._built[mode] = kernel
        return self._built[mode]
