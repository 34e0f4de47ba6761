"""`strategy.name: auto`: the planner picks the ZeRO stage, offload and checkpointing mode of a run, and says why.

Contract:
- `resolve_auto(cfg)` returns `cfg` unchanged unless `cfg.strategy.name == "auto"`; then it returns a copy with
  `strategy.name = "zero"`, the planner's stage and offload flags, and (when `checkpointing.mode` is `auto`) the
  planner's checkpointing mode, and logs the reason: the per-device memory it planned for, the chosen
  configuration's predicted bytes and what the faster configurations lacked. The same inputs give the same choice
  on every rank.
- The planner is restricted to the run's precision (16-bit modes plan as bf16-mixed) and, when
  `checkpointing.mode` is not `auto`, to that mode. Nothing fitting is a `TrainingConfigError` naming the
  limiting term.
- `checkpointing.mode: auto` with another strategy is an error.
- `training_callbacks(cfg, run_dir)` builds the SelectiveCheckpointing / MemoryLedger callbacks a config asks for.
- Device memory: `torch.cuda` total memory of device 0 on CUDA; on CPU, host memory divided by the processes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from lt_plugins.errors import TrainingConfigError
from lt_plugins.memory_model import CHECKPOINT_MODES, Hardware
from lt_plugins.planner import Candidate, PlanRequest, plan

log = logging.getLogger(__name__)


def device_memory(accelerator: str, processes_per_node: int) -> tuple[float, str]:
    """Bytes one training process may use, and where the figure comes from."""
    import torch

    if accelerator in ("cuda", "gpu", "auto") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{props.name} ({props.total_memory / 1e9:.1f} GB)"
    host = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    share = host / max(1, processes_per_node)
    return share, f"host memory {host / 1e9:.1f} GB / {processes_per_node} process(es)"


def _why(choice: Candidate, candidates: list[Candidate], where: str) -> str:
    faster = [c for c in candidates if not c.fits and c.step_s < choice.step_s]
    lines = [
        f"strategy auto chose ZeRO stage {choice.stage}, offload {choice.offload}, checkpointing {choice.checkpointing}"
        f" for {where}: {choice.total / 1e9:.2f} GB predicted per device, compute x{choice.compute:.2f}, "
        f"~{choice.step_s:.3g} s/step estimated (the fastest configuration that fits)."
    ]
    for c in sorted(faster, key=lambda c: c.step_s)[:3]:
        lines.append(f"  faster but does not fit: {c.name}: {c.total / 1e9:.2f} GB, limited by {c.limiting}")
    return "\n".join(lines)


def resolve_auto(cfg: Any) -> Any:
    """The config with `strategy: auto` (and `checkpointing.mode: auto`) replaced by the planner's choice."""
    mode = cfg.checkpointing.mode
    if cfg.strategy.name != "auto":
        if mode == "auto":
            raise TrainingConfigError("checkpointing.mode=auto needs strategy.name=auto (the planner chooses it)")
        return cfg
    from shared_model.config import get_preset

    t = cfg.trainer
    memory, where = device_memory(t.accelerator, t.devices)
    precision = "32-true" if t.precision in ("32-true", "32") else "bf16-mixed"
    request = PlanRequest(
        gpus=t.devices * t.num_nodes,
        micro_batch=cfg.data.batch_size,
        seq_len=cfg.data.block_size,
        hardware=Hardware(gpu_memory=memory),
        precisions=(precision,),
        modes=CHECKPOINT_MODES if mode == "auto" else (mode,),
        bucket_elements=cfg.strategy.bucket_size,
        lora="off",  # the run trains the whole model: never swap in LoRA behind the user's back
        loss_chunk_tokens=cfg.model.loss_chunk_tokens,
    )
    result = plan(get_preset(cfg.model.preset), request, model_name=cfg.model.preset)
    choice = result.recommended
    if choice is None:
        least = min(result.candidates, key=lambda c: c.total)
        raise TrainingConfigError(
            f"strategy.name=auto: no configuration fits {where}; the smallest ({least.name}) needs "
            f"{least.total / 1e9:.2f} GB, limited by {least.limiting}"
        )
    log.warning("%s", _why(choice, result.candidates, where))
    strategy = dataclasses.replace(
        cfg.strategy,
        name="zero",
        stage=choice.stage,
        offload_optimizer=choice.offload in ("optimizer", "opt+params"),
        offload_params=choice.offload in ("params", "opt+params"),
    )
    checkpointing = dataclasses.replace(cfg.checkpointing, mode=choice.checkpointing)
    return dataclasses.replace(cfg, strategy=strategy, checkpointing=checkpointing)


def training_callbacks(cfg: Any, run_dir: Path) -> list[Any]:
    """SelectiveCheckpointing when `checkpointing.mode` is not none; MemoryLedger when `ledger.enabled`."""
    from lt_plugins.checkpointing import SelectiveCheckpointing
    from lt_plugins.ledger_callback import MemoryLedger

    out: list[Any] = []
    if cfg.checkpointing.mode != "none":
        out.append(SelectiveCheckpointing(cfg.checkpointing.to_config()))
    if cfg.ledger.enabled:
        out.append(MemoryLedger(cfg.ledger.measure_at_step, cfg.ledger.tolerance, report_dir=run_dir / "memory"))
    return out
