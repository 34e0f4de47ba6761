"""Autocast compute over fp32 training state: `trainer.autocast`, resolved when a run starts and recorded.

Contract:
- `trainer.autocast` is `none`, `bf16` or `auto` (`AUTOCAST_MODES`). `bf16` runs the matmuls (Linear) of the
  forward and backward in bf16 under `torch.autocast` while the weights, gradients and optimizer state keep
  `trainer.precision=32-true`: the parameters, gradient partitions and optimizer state are fp32's bytes. At ZeRO-1/2
  DeepSpeed adds a reduce bucket for the bf16 Linear gradients beside the fp32 one (one bucket per gradient dtype,
  `reduce_bucket_size` elements each), which the ledger's bucket term does not count. It needs 32-true
  (`check_autocast`): `bf16-mixed` already computes in bf16, with DeepSpeed's 16-bit weights.
- `resolve_autocast(mode, precision, accelerator, cpu_capabilities)` is the rule behind `auto`, returned with its
  reason: bf16 on a CPU with AMX-BF16 tiles or AVX-512 BF16 dot products (`vdpbf16ps`), where oneDNN's bf16
  matmuls run natively (the demo's steps at 1.4-1.6x fp32's with tiles, docs/benchmarks.md §37; with the dot
  products alone, on an AMD Zen 4, §48), or on a CUDA device with native bf16 (emulated bf16, as on V100 or T4, is
  not counted); none on a CPU with neither, where bf16 matmuls are emulated (DeepSpeed's bf16 mode there ran
  several times slower than fp32), and none whenever the precision is not 32-true. `resolved_config(cfg)` returns
  the config with `auto` replaced and logs the reason, so the run's config.yaml says what ran. Each attempt
  resolves again: a run resumed on another machine may continue under the other choice (its state is fp32 either
  way), and its log line says so.
- Under ZeroStrategy the choice is DeepSpeed's own `torch_autocast` section (`deepspeed_section`): DeepSpeed opens
  the autocast region around the forward and reduces the Linear gradients in bf16 (its `comm_dtype`). Under `ddp`
  it is Lightning's `bf16-mixed` precision plugin, which is torch.autocast over fp32 weights (`lightning_precision`).
- `fp32_classes(mode, accelerator)`: the modules the precision policy (lt_plugins.precision) keeps in fp32 under bf16
  autocast besides its defaults. On CPU that is the attention core (`CoreAttention`: scores, softmax, weighted sum):
  torch's bf16 flash-attention backward on CPU ran slower than the fp32 one (docs/benchmarks.md §37), and the
  softmax is the part mixed precision keeps in fp32 anyway. On CUDA nothing is added: the bf16 flash kernels are
  the fast path there.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lt_plugins.errors import TrainingConfigError

AUTOCAST_MODES = ("none", "bf16", "auto")
CPU_FP32_CLASSES = ("CoreAttention",)
"""Kept in fp32 under CPU autocast, on top of PrecisionPolicy's defaults (see the module docstring)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutocastChoice:
    """What `trainer.autocast` resolved to on this machine, and why."""

    mode: str
    """none | bf16."""
    reason: str


def check_autocast(mode: str, precision: str) -> None:
    """Raise TrainingConfigError for a value outside AUTOCAST_MODES or bf16 over a precision other than 32-true."""
    if mode not in AUTOCAST_MODES:
        raise TrainingConfigError(f"trainer.autocast must be one of {', '.join(AUTOCAST_MODES)}, got {mode!r}")
    if mode == "bf16" and precision != "32-true":
        raise TrainingConfigError(
            f"trainer.autocast=bf16 needs trainer.precision=32-true (fp32 weights, bf16 matmuls); "
            f"trainer.precision={precision!r} sets the compute dtype itself: set trainer.autocast=none"
        )


def resolve_autocast(
    mode: str, precision: str, accelerator: str, cpu_capabilities: Mapping[str, Any] | None = None
) -> AutocastChoice:
    """The rule behind `auto` (bf16 and none are returned as given). `cpu_capabilities` is
    `torch.cpu.get_capabilities()` (read here when None); accelerator is cpu, cuda, gpu or auto."""
    check_autocast(mode, precision)
    if mode != "auto":
        return AutocastChoice(mode, "as configured")
    if precision != "32-true":
        return AutocastChoice("none", f"trainer.precision={precision} sets the compute dtype")
    import torch

    if not runs_on_cpu(accelerator):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False):
            return AutocastChoice("bf16", "the CUDA device computes in bf16")
        return AutocastChoice("none", "no CUDA device with native bf16")
    caps = torch.cpu.get_capabilities() if cpu_capabilities is None else cpu_capabilities
    if caps.get("amx_bf16"):
        return AutocastChoice("bf16", "this CPU has AMX-BF16 tiles for bf16 matmuls")
    if caps.get("avx512_bf16"):
        return AutocastChoice("bf16", "this CPU has AVX-512 BF16 dot products for bf16 matmuls")
    return AutocastChoice("none", "this CPU has neither AMX-BF16 tiles nor AVX-512 BF16 dot products for bf16 matmuls")


def resolved_config(cfg: Any) -> Any:
    """The TrainConfig with `trainer.autocast: auto` replaced by its resolution on this machine (logged)."""
    t = cfg.trainer
    if t.autocast != "auto":
        return cfg
    choice = resolve_autocast(t.autocast, t.precision, t.accelerator)
    log.warning("trainer.autocast=auto -> %s (%s)", choice.mode, choice.reason)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(t, autocast=choice.mode))


def deepspeed_section(mode: str) -> dict[str, Any]:
    """The DeepSpeed config keys for this (resolved) mode: `torch_autocast` for bf16, nothing for none."""
    if mode == "bf16":
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    if mode == "none":
        return {}
    raise ValueError(f"autocast mode {mode!r} is not resolved (none or bf16)")


def lightning_precision(mode: str, precision: str) -> str:
    """The Trainer precision for a strategy without DeepSpeed (ddp): bf16 autocast over fp32 is `bf16-mixed`."""
    return "bf16-mixed" if mode == "bf16" else precision


def fp32_classes(mode: str, accelerator: str) -> tuple[str, ...]:
    """Module classes the precision policy keeps in fp32 under this mode, besides its defaults."""
    return CPU_FP32_CLASSES if mode == "bf16" and runs_on_cpu(accelerator) else ()


def runs_on_cpu(accelerator: str) -> bool:
    """Whether `trainer.accelerator` (cpu, cuda, gpu or auto) trains on the CPU in this process."""
    if accelerator == "auto":
        import torch

        return not torch.cuda.is_available()
    return accelerator == "cpu"
