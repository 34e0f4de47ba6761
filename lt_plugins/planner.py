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
- LoRA (`PlanRequest.lora`): `auto` plans full fine-tuning and, when its state fits no GPU without offload (an
  offloaded full fine-tune needs ~16 B/param of host memory and is several times slower), LoRA at `lora_rank` on all
  seven projections (frozen base bf16, then int8 at stages 0-2; bf16-mixed; the adapters at 18 B a parameter,
  the frozen base as the `FROZEN` term) and recommends the best LoRA candidate that fits (else the best full one);
  `Plan.lora_fallback` says so. `only` plans LoRA alone, `off` full
  fine-tuning alone. A LoRA candidate's overrides add `lora.enabled=true lora.rank=R lora.base_dtype=...`.
- Imports only shared_model and lt_plugins.memory_model: `tandem plan` starts without Lightning or DeepSpeed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from lt_plugins.memory_model import (
    ACTIVATIONS,
    BUCKETS,
    CHECKPOINT_MODES,
    FROZEN,
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
from shared_model.ledger import lora_adapter_params, lora_frozen_bytes

LEVERS: dict[str, str] = {
    WEIGHTS: "shard the weights (stage 3) or offload them (offload_params)",
    FROZEN: "shard the frozen base (stage 3), quantize it (lora.base_dtype=int8) or offload it",
    MASTER: "shard optimizer state (stage >= 1), add GPUs, or offload the optimizer",
    GRADS: "shard gradients (stage >= 2), add GPUs, or offload the optimizer",
    MOMENTS: "shard optimizer state (stage >= 1), add GPUs, or offload the optimizer",
    ACTIVATIONS: "checkpoint activations (ops, then full) or lower the micro-batch / sequence length",
    BUCKETS: "lower strategy.bucket_size",
}

LORA_MODES = ("auto", "only", "off")
LORA_BASES: dict[int, tuple[str, ...]] = {0: ("bf16", "int8"), 1: ("bf16", "int8"), 2: ("bf16", "int8"), 3: ("bf16",)}
"""Frozen-base dtypes tried per stage (int8 is held in buffers, which ZeRO-3 does not partition)."""

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
    lora: str = "auto"
    """auto (LoRA when full fine-tuning does not fit) | only | off."""
    lora_rank: int = 16
    """Rank of the LoRA candidates."""
    loss_chunk_tokens: int = 0
    """model.loss_chunk_tokens of the run (0: unchunked): the chunked loss holds no [tokens, vocab] log-softmax but,
    when the head trains (full fine-tuning; not LoRA's frozen head), its fp32 weight gradient; counted where
    LitCausalLM chunks (stages 0-2). It saves memory once a micro-batch holds more tokens than the hidden size."""

    def __post_init__(self) -> None:
        if self.lora not in LORA_MODES:
            raise ValueError(f"lora must be one of {', '.join(LORA_MODES)}, got {self.lora!r}")
        for name in ("gpus", "micro_batch", "seq_len", "bucket_elements", "lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens must be >= 0, got {self.loss_chunk_tokens}")


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
    lora_rank: int | None = None
    """None: full fine-tuning; else a LoRA adapter of this rank on all projections."""
    lora_base: str | None = None
    """The frozen base's dtype under LoRA: bf16 or int8."""

    @property
    def name(self) -> str:
        what = "" if self.lora_rank is None else f"LoRA r{self.lora_rank} ({self.lora_base} base), "
        return f"{what}stage {self.stage}, offload {self.offload}, {self.precision}, checkpointing {self.checkpointing}"

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
    lora_fallback: bool = False
    """Full fine-tuning fits nothing on request.gpus and LoRA candidates were planned instead (lora=auto)."""

    def overrides(self, c: Candidate) -> list[str]:
        return train_overrides(c, self.request, self.model)

    def _dict(self, c: Candidate | None) -> dict | None:
        return None if c is None else {**c.to_dict(), "overrides": self.overrides(c)}

    def to_dict(self) -> dict:
        req = asdict(self.request)
        return {
            "model": self.model,
            "num_params": self.num_params,
            "lora_fallback": self.lora_fallback,
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
    if c.lora_rank is not None:  # bf16-mixed already holds the frozen base in bf16: base_dtype=model
        out += [
            "lora.enabled=true",
            f"lora.rank={c.lora_rank}",
            f"lora.base_dtype={'int8' if c.lora_base == 'int8' else 'model'}",
        ]
    if request.loss_chunk_tokens:
        out.append(f"model.loss_chunk_tokens={request.loss_chunk_tokens}")
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
    lora_base: str | None = None,
) -> Candidate:
    """Bytes, fit, costs and the limiting term of one configuration; with `lora_base`, of LoRA at
    `request.lora_rank` (then `num_params` is the model's, the trainable ones are the adapters)."""
    hw = request.hardware
    frozen = 0.0
    trainable = num_params
    if lora_base is not None:
        trainable = lora_adapter_params(config, request.lora_rank)
        frozen = lora_frozen_bytes(config, lora_base) / (layout.world if layout.stage == 3 else 1)
    terms = lecture_state_terms(trainable, layout)
    chunked = request.loss_chunk_tokens > 0 and layout.stage < 3  # LitCausalLM.chunks_loss
    acts = activation_bytes(
        config,
        request.micro_batch,
        request.seq_len,
        mode,
        layout.precision,
        chunked_loss=chunked,
        head_trains=lora_base is None,  # the LoRA candidates adapt the projections; the head stays frozen
    )
    gpu = {t.name: t.gpu_bytes for t in terms}
    gpu[FROZEN] = 0.0 if layout.offload_params else frozen
    if layout.stage == 3:
        gpu[WEIGHTS] += stage3_working_set(config, layout.precision)
    gpu[ACTIVATIONS] = acts["peak"]
    gpu[BUCKETS] = bucket_bytes(trainable, layout)
    cpu = sum(t.cpu_bytes for t in terms) + (frozen if layout.offload_params else 0.0)
    total = sum(gpu.values())
    host_ok = request.cpu_memory is None or cpu * min(layout.world, 8) <= request.cpu_memory
    fits = total <= hw.usable and host_ok
    flops = step_flops(config, request.micro_batch * request.seq_len, request.seq_len, mode)
    comm = comm_bytes(trainable, layout)
    seconds = step_seconds(config, trainable, layout, request.micro_batch, request.seq_len, mode, hw)
    if lora_base is not None and layout.stage == 3 and layout.world > 1:  # the frozen base is gathered twice too
        gather = 2 * frozen * (layout.world - 1)
        comm["network"] += gather
        seconds["network"] += gather / (hw.interconnect_gbps * 1e9)
    if lora_base is not None and layout.offload_params:  # the offloaded frozen shard crosses PCIe twice a step
        comm["pcie"] += 2 * frozen
        seconds["pcie"] += 2 * frozen / (hw.pcie_gbps * 1e9)
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
        lora_rank=request.lora_rank if lora_base is not None else None,
        lora_base=lora_base,
    )
    if not fits:
        if total <= hw.usable:
            cand.limiting, cand.lever = "host memory", "add host memory or offload less"
        else:
            cand.limiting = max(gpu, key=lambda k: gpu[k])
            cand.lever = LEVERS[cand.limiting]
    return cand


def _candidates(
    config: ModelConfig, num_params: int, request: PlanRequest, gpus: int, lora: bool = False
) -> list[Candidate]:
    out = []
    for stage, offloads in OFFLOADS.items():
        for offload_optimizer, offload_params in offloads:
            for precision in request.precisions:
                if lora:  # LoRA runs in bf16-mixed (the base in bf16 or int8)
                    if precision != "bf16-mixed":
                        continue
                    layout = ZeroLayout(stage=stage, world=gpus, precision=precision,
                                        offload_optimizer=offload_optimizer, offload_params=offload_params,
                                        bucket_elements=request.bucket_elements)  # fmt: skip
                    out.extend(
                        evaluate(config, num_params, layout, mode, request, base)
                        for base in LORA_BASES[stage]
                        for mode in request.modes
                    )
                    continue
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

    def candidates_for(gpus: int) -> tuple[list[Candidate], bool, Candidate | None]:
        """(candidates, whether LoRA was planned as the fallback, the recommendation)."""
        full = [] if request.lora == "only" else _candidates(config, n, request, gpus)
        on_gpu = _best([c for c in full if not c.offload_optimizer and not c.offload_params])
        if request.lora == "only" or (request.lora == "auto" and on_gpu is None):
            lora = _candidates(config, n, request, gpus, lora=True)
            return full + lora, request.lora == "auto", _best(lora) or _best(full)
        return full, False, _best(full)

    candidates, fallback, best = candidates_for(request.gpus)
    candidates.sort(key=lambda c: (not c.fits, c.lora_rank is None and fallback, c.step_s if c.fits else c.total))
    result = Plan(model_name, n, request, candidates, best, lora_fallback=fallback)
    for g in sorted({*scaling_gpus, request.gpus}):
        result.scaling[g] = result.recommended if g == request.gpus else candidates_for(g)[2]
    return result


def short(term: str) -> str:
    return SHORT_NAMES.get(term, term)
