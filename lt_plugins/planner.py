"""The training planner: enumerate ZeRO stage × offload × precision × checkpointing, say what fits, pick one.

Contract:
- `plan(config, PlanRequest)` returns a `Plan`: one `Candidate` per configuration with its per-GPU bytes by term
  (lecture accounting, `memory_model.lecture_state_terms`; at stage 3 plus the gathered working set; saved
  activations at their recompute peak; the communication buckets), whether it fits the usable GPU memory (and host
  memory, when given), the relative compute (FLOPs with recompute / FLOPs without), the bytes communicated per
  step, an estimated step time, and for a configuration that does not fit, the term that limits it and the lever
  that shrinks that term.
- The recommendation is the fitting configuration with the lowest estimated step time (ties: fewer GPU bytes).
  `Plan.scaling` gives the recommendation for other GPU counts (1, 2, 4, 8 by default).
- `train_overrides` gives the `tandem train` key=value overrides (lt_plugins/config.py keys) that apply a
  configuration; `Plan.to_dict` includes them for every candidate, the recommendation and each GPU count.
- Imports only shared_model and lt_plugins.memory_model: `tandem plan` starts without Lightning or DeepSpeed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from lt_plugins.memory_model import (
    ACTIVATIONS,
    BUCKETS,
    CHECKPOINT_MODES,
    GRADS,
    MASTER,
    MOMENTS,
    PRECISIONS,
    SHORT_NAMES,
    WEIGHTS,
    Hardware,
    ZeroLayout,
    activation_bytes,
    bucket_bytes,
    comm_bytes,
    lecture_state_terms,
    stage3_working_set,
    step_flops,
    step_seconds,
)
from shared_model.config import PRESETS, ModelConfig

LEVERS: dict[str, str] = {
    WEIGHTS: "shard the weights (stage 3) or offload them (offload_params)",
    MASTER: "shard optimizer state (stage >= 1), add GPUs, or offload the optimizer",
    GRADS: "shard gradients (stage >= 2), add GPUs, or offload the optimizer",
    MOMENTS: "shard optimizer state (stage >= 1), add GPUs, or offload the optimizer",
    ACTIVATIONS: "checkpoint activations (ops, then full) or lower the micro-batch / sequence length",
    BUCKETS: "lower strategy.bucket_size",
}

DEFAULT_BUCKET = 50_000_000
"""strategy.bucket_size's default (elements)."""

OFFLOADS: dict[int, tuple[tuple[bool, bool], ...]] = {
    0: ((False, False),),
    1: ((False, False), (True, False)),
    2: ((False, False), (True, False)),
    3: ((False, False), (True, False), (True, True)),
}
"""(offload_optimizer, offload_params) worth trying per stage."""


@dataclass(frozen=True)
class PlanRequest:
    gpus: int
    micro_batch: int
    seq_len: int
    hardware: Hardware = field(default_factory=Hardware)
    cpu_memory: float | None = None
    """Host memory per node in bytes; None: not checked."""
    precisions: tuple[str, ...] = PRECISIONS
    modes: tuple[str, ...] = CHECKPOINT_MODES
    bucket_elements: int = DEFAULT_BUCKET
    """strategy.bucket_size."""

    def __post_init__(self) -> None:
        for name in ("gpus", "micro_batch", "seq_len", "bucket_elements"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Candidate:
    stage: int
    offload: str
    precision: str
    checkpointing: str
    gpu_bytes: dict[str, float]
    """Per-GPU bytes by term name."""
    cpu_bytes: float
    """Host bytes this GPU's offloaded state needs."""
    total: float
    fits: bool
    compute: float
    """FLOPs with recompute relative to the same step without checkpointing."""
    comm_bytes: float
    """Network bytes per GPU per step."""
    pcie_bytes: float
    step_s: float
    """Estimated seconds per step (compute + network + PCIe + host optimizer, not overlapped)."""
    limiting: str | None = None
    """For a configuration that does not fit: the largest term on the GPU (or 'host memory')."""
    lever: str | None = None
    offload_optimizer: bool = False
    offload_params: bool = False
    gpus: int = 1
    """Data-parallel GPUs this configuration was evaluated for."""

    @property
    def name(self) -> str:
        return f"stage {self.stage}, offload {self.offload}, {self.precision}, checkpointing {self.checkpointing}"

    def to_dict(self) -> dict:
        return {**asdict(self), "name": self.name}


@dataclass
class Plan:
    model: str
    num_params: int
    request: PlanRequest
    candidates: list[Candidate]
    recommended: Candidate | None
    scaling: dict[int, Candidate | None] = field(default_factory=dict)

    def overrides(self, c: Candidate) -> list[str]:
        return train_overrides(c, self.request, self.model)

    def _dict(self, c: Candidate | None) -> dict | None:
        return None if c is None else {**c.to_dict(), "overrides": self.overrides(c)}

    def to_dict(self) -> dict:
        req = asdict(self.request)
        return {
            "model": self.model,
            "num_params": self.num_params,
            "request": req,
            "usable_gpu_bytes": self.request.hardware.usable,
            "recommended": self._dict(self.recommended),
            "scaling": {str(g): self._dict(c) for g, c in self.scaling.items()},
            "candidates": [self._dict(c) for c in self.candidates],
        }


GPUS_PER_NODE = 8
"""GPUs per node the planner assumes (host memory is checked per node of 8; larger multiples of 8 span nodes)."""


def train_overrides(c: Candidate, request: PlanRequest, model: str | None = None) -> list[str]:
    """The `tandem train` overrides (lt_plugins/config.py keys) that train with configuration `c` on `c.gpus` GPUs
    at the request's micro-batch and sequence length; `model.preset` when `model` is a preset name."""
    out = [f"model.preset={model}"] if model in PRESETS else []
    out.append("trainer.accelerator=cuda")
    if c.gpus > GPUS_PER_NODE and c.gpus % GPUS_PER_NODE == 0:
        out += [f"trainer.devices={GPUS_PER_NODE}", f"trainer.num_nodes={c.gpus // GPUS_PER_NODE}"]
    else:
        out.append(f"trainer.devices={c.gpus}")
    out += [
        f"trainer.precision={c.precision}",
        "strategy.name=zero",
        f"strategy.stage={c.stage}",
        f"strategy.offload_optimizer={str(c.offload_optimizer).lower()}",
        f"strategy.offload_params={str(c.offload_params).lower()}",
    ]
    if request.bucket_elements != DEFAULT_BUCKET:
        out.append(f"strategy.bucket_size={request.bucket_elements}")
    out += [
        f"checkpointing.mode={c.checkpointing}",
        f"data.batch_size={request.micro_batch}",
        f"data.block_size={request.seq_len}",
    ]
    return out


def evaluate(
    config: ModelConfig,
    num_params: int,
    layout: ZeroLayout,
    mode: str,
    request: PlanRequest,
) -> Candidate:
    """Bytes, fit, costs and the limiting term of one configuration."""
    hw = request.hardware
    terms = lecture_state_terms(num_params, layout)
    acts = activation_bytes(config, request.micro_batch, request.seq_len, mode, layout.precision)
    gpu = {t.name: t.gpu_bytes for t in terms}
    if layout.stage == 3:
        gpu[WEIGHTS] += stage3_working_set(config, layout.precision)
    gpu[ACTIVATIONS] = acts["peak"]
    gpu[BUCKETS] = bucket_bytes(num_params, layout)
    cpu = sum(t.cpu_bytes for t in terms)
    total = sum(gpu.values())
    host_ok = request.cpu_memory is None or cpu * min(layout.world, 8) <= request.cpu_memory
    fits = total <= hw.usable and host_ok
    flops = step_flops(config, request.micro_batch * request.seq_len, request.seq_len, mode)
    comm = comm_bytes(num_params, layout)
    seconds = step_seconds(config, num_params, layout, request.micro_batch, request.seq_len, mode, hw)
    cand = Candidate(
        stage=layout.stage,
        offload=layout.offload,
        precision=layout.precision,
        checkpointing=mode,
        gpu_bytes=gpu,
        cpu_bytes=cpu,
        total=total,
        fits=fits,
        compute=(flops["train"] + flops["recompute"]) / flops["train"],
        comm_bytes=comm["network"],
        pcie_bytes=comm["pcie"],
        step_s=sum(seconds.values()),
        offload_optimizer=layout.offload_optimizer,
        offload_params=layout.offload_params,
        gpus=layout.world,
    )
    if not fits:
        if total <= hw.usable:
            cand.limiting, cand.lever = "host memory", "add host memory or offload less"
        else:
            cand.limiting = max(gpu, key=lambda k: gpu[k])
            cand.lever = LEVERS[cand.limiting]
    return cand


def _candidates(config: ModelConfig, num_params: int, request: PlanRequest, gpus: int) -> list[Candidate]:
    out = []
    for stage, offloads in OFFLOADS.items():
        for offload_optimizer, offload_params in offloads:
            for precision in request.precisions:
                layout = ZeroLayout(
                    stage=stage,
                    world=gpus,
                    precision=precision,
                    offload_optimizer=offload_optimizer,
                    offload_params=offload_params,
                    bucket_elements=request.bucket_elements,
                )
                out.extend(evaluate(config, num_params, layout, mode, request) for mode in request.modes)
    return out


def _best(candidates: list[Candidate]) -> Candidate | None:
    fitting = [c for c in candidates if c.fits]
    return min(fitting, key=lambda c: (c.step_s, c.total)) if fitting else None


def plan(
    config: ModelConfig, request: PlanRequest, model_name: str = "model", scaling_gpus: tuple[int, ...] = (1, 2, 4, 8)
) -> Plan:
    """Every configuration for `request.gpus` GPUs, the recommendation, and the best choice at other GPU counts."""
    n = config.num_parameters()
    candidates = _candidates(config, n, request, request.gpus)
    candidates.sort(key=lambda c: (not c.fits, c.step_s if c.fits else c.total))
    result = Plan(model_name, n, request, candidates, _best(candidates))
    for g in sorted({*scaling_gpus, request.gpus}):
        result.scaling[g] = result.recommended if g == request.gpus else _best(_candidates(config, n, request, g))
    return result


def short(term: str) -> str:
    return SHORT_NAMES.get(term, term)
