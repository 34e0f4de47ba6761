"""Training memory and cost model: the terms `shared_model.ledger` does not cover, built on its formulas.

Contract:
- Pure arithmetic; imports only shared_model (no Lightning, no DeepSpeed), so the planner stays light.
- Training state per GPU, two accountings:
  - `lecture_state_terms`: the lecture's mixed-precision AdamW bytes (2/4/4/8 per parameter, from
    `ledger.zero_state_bytes_per_gpu`) for a ZeRO stage, moved to host memory by optimizer/parameter offload.
    The planner uses it: fp32 gradients make it an upper bound of what DeepSpeed holds at any time.
  - `deepspeed_state_terms`: what DeepSpeed actually keeps resident on one rank at the optimizer step (16-bit
    gradients, stage-3 persistent parameters, the fp32 master copy only where DeepSpeed makes one). The
    MemoryLedger callback predicts with it and checks it against the tensors each rank holds.
- Saved activations of the Qwen3/Llama decoder for each checkpointing mode (`activation_bytes`), from a per-op
  count of what autograd saves (validated against `SavedActivationMeter` on CPU, see tests/lt_plugins). The fused
  attention kernel is assumed (no T×T score matrix saved), as on GPUs with FlashAttention.
- Communication buckets from the DeepSpeed bucket sizes; FLOPs (`step_flops`), bytes moved per step
  (`comm_bytes`) and an estimated step time under stated `Hardware` assumptions.
- LoRA: the frozen base is its own term (`FROZEN`, `frozen_weight_bytes`: no master, gradient or moments; sharded
  only at stage 3); the adapters are the trainable parameters of the other state terms (18 B each in the lecture's
  accounting). Activations are counted as for full training.
- Term names are stable strings (`TERMS`); byte figures are floats in bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shared_model.config import ModelConfig
from shared_model.ledger import TRAINING_STATE, zero_state_bytes_per_gpu

CHECKPOINT_MODES: tuple[str, ...] = ("none", "full", "attention", "ops")
PRECISIONS: tuple[str, ...] = ("bf16-mixed", "32-true")

WEIGHTS, MASTER, GRADS, MOMENTS = (t.name for t in TRAINING_STATE)
FROZEN = "Frozen base weights"
"""Parameters that do not train (LoRA's base): no master, gradient or moments; 0 for full training."""
ACTIVATIONS = "Saved activations"
BUCKETS = "Communication buckets"
TERMS: tuple[str, ...] = (WEIGHTS, FROZEN, MASTER, GRADS, MOMENTS, ACTIVATIONS, BUCKETS)
SHORT_NAMES: dict[str, str] = {
    WEIGHTS: "weights",
    FROZEN: "frozen",
    MASTER: "master",
    GRADS: "grads",
    MOMENTS: "moments",
    ACTIVATIONS: "activations",
    BUCKETS: "buckets",
}

FP32 = 4


def model_bytes_per_element(precision: str) -> int:
    """Bytes of one model weight/activation element: 2 in the 16-bit mixed modes, 4 in 32-true."""
    if precision in ("bf16-mixed", "16-mixed", "bf16-true", "16-true"):
        return 2
    if precision in ("32-true", "32"):
        return 4
    raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")


@dataclass(frozen=True)
class Term:
    """One memory term on one GPU (rank): bytes in device memory and bytes it keeps in host memory instead."""

    name: str
    gpu_bytes: float
    cpu_bytes: float = 0.0


@dataclass(frozen=True)
class ZeroLayout:
    """How ZeRO lays the state out: stage, data-parallel world, precision, offload and buckets."""

    stage: int
    world: int
    precision: str = "bf16-mixed"
    offload_optimizer: bool = False
    offload_params: bool = False
    bucket_elements: int = 50_000_000
    """DeepSpeed reduce / all-gather bucket size in elements (ZeroConfig.bucket_size)."""
    overlap_comm: bool = False
    persistence_threshold: int = 100_000
    """Stage 3: parameters with fewer elements stay whole on every rank."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0-3, got {self.stage}")
        if self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")
        if self.offload_params and self.stage != 3:
            raise ValueError("offload_params needs stage 3")
        if self.offload_optimizer and self.stage == 0:
            raise ValueError("offload_optimizer needs stage >= 1")
        model_bytes_per_element(self.precision)

    @property
    def offload(self) -> str:
        if self.offload_params:
            return "opt+params" if self.offload_optimizer else "params"
        return "optimizer" if self.offload_optimizer else "none"


def _place(name: str, nbytes: float, on_cpu: bool) -> Term:
    return Term(name, 0.0, nbytes) if on_cpu else Term(name, nbytes, 0.0)


# ----------------------------------------------------------------------------------------- training state
def lecture_state_terms(num_params: float, layout: ZeroLayout) -> list[Term]:
    """The lecture's 18 B/param (bf16-mixed) split over the GPUs by the stage; 32-true keeps 4-byte weights and
    (stage >= 1, where DeepSpeed copies the partition) a 4-byte master. Offload moves terms to host memory."""
    per_gpu = zero_state_bytes_per_gpu(num_params, layout.stage, layout.world)
    weights, master = per_gpu[WEIGHTS], per_gpu[MASTER]
    if model_bytes_per_element(layout.precision) == FP32:
        weights *= 2
        master = 0.0 if layout.stage == 0 else master
    opt = layout.offload_optimizer
    return [
        _place(WEIGHTS, weights, layout.offload_params),
        _place(MASTER, master, opt),
        _place(GRADS, per_gpu[GRADS], opt),
        _place(MOMENTS, per_gpu[MOMENTS], opt),
    ]


def _shard(numel: int, world: int) -> int:
    return math.ceil(numel / world)


def deepspeed_state_terms(param_numels: Sequence[int], layout: ZeroLayout) -> list[Term]:
    """Bytes DeepSpeed keeps resident on one rank at the optimizer step, from the trainable parameter sizes.

    - 16-bit weights: whole on every rank below stage 3; at stage 3 the rank's shard of every parameter plus whole
      copies of those under the persistence threshold.
    - fp32 master: stage 0 in a 16-bit mode keeps a whole copy; 32-true at stage 0 updates the weights in place
      (no copy); stages 1-3 keep the rank's partition.
    - Gradients: in the model dtype; whole at stage 0, the rank's partition at stages 1-3 (stage 1 reduces them
      into the partition at the end of backward).
    - Moments: two fp32 arrays per parameter, the rank's partition from stage 1.
    """
    n = sum(param_numels)
    g = layout.world
    b = model_bytes_per_element(layout.precision)
    part = n if layout.stage == 0 else sum(_shard(x, g) for x in param_numels)
    if layout.stage == 3:
        persistent = sum(x for x in param_numels if x < layout.persistence_threshold)
        weights = b * (sum(_shard(x, g) for x in param_numels) + persistent)
    else:
        weights = b * n
    if layout.stage == 0:
        master = 0 if b == FP32 else FP32 * n
    else:
        master = FP32 * part
    opt = layout.offload_optimizer
    return [
        _place(WEIGHTS, float(weights), layout.offload_params),
        _place(MASTER, float(master), opt),
        _place(GRADS, float(b * part), opt),
        _place(MOMENTS, float(2 * FP32 * part), opt),
    ]


def frozen_weight_bytes(frozen: Sequence[tuple[int, int]], layout: ZeroLayout) -> Term:
    """Bytes one rank holds of the frozen parameters, given as (elements, bytes per element): whole below stage 3;
    at stage 3 the rank's shard plus whole copies of those under the persistence threshold (as DeepSpeed does
    for every parameter). Parameter offload moves them to host memory."""
    if layout.stage == 3:
        held = sum(b * (_shard(n, layout.world) + (n if n < layout.persistence_threshold else 0)) for n, b in frozen)
    else:
        held = sum(n * b for n, b in frozen)
    return _place(FROZEN, float(held), layout.offload_params)


def bucket_bytes(num_params: float, layout: ZeroLayout) -> float:
    """Communication buffers DeepSpeed allocates on each rank.

    Stages 1-2 (contiguous gradients): a reduce bucket of `bucket_elements` in the model dtype during backward,
    two with overlap_comm. Stage 3: one persistent reduce bucket. Stage 0 keeps no bucket (the all-reduce flattens
    gradients transiently). DeepSpeed allocates the full bucket whatever the model or world size."""
    if layout.stage == 0 or (layout.world == 1 and layout.stage < 3):
        return 0.0
    b = model_bytes_per_element(layout.precision)
    copies = 2 if layout.overlap_comm and layout.stage < 3 else 1
    return float(copies * layout.bucket_elements * b)


def stage3_working_set(config: ModelConfig, precision: str) -> float:
    """Stage 3 gathers whole parameters module by module: the largest gathered module (embedding, LM head or one
    layer) and the next one being prefetched sit in GPU memory beside the shards, offloaded or not."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    layer = h * q + 2 * h * kv + q * h + 3 * h * i
    largest = max(layer, config.vocab_size * h)
    return 2.0 * largest * model_bytes_per_element(precision)


# ------------------------------------------------------------------------------------------- activations
def layer_saved_bytes_per_token(config: ModelConfig, mode: str, b: int) -> float:
    """Bytes one decoder layer saves for backward per token (fused attention; norms computed in fp32).

    none: RMSNorm keeps its fp32 input and normalised output (x2), the projections their inputs, QK-norm its fp32
    input, attention its contiguous q/k/v, output and log-sum-exp, the SwiGLU its four [intermediate] tensors.
    full: only the layer input. attention: none minus the log-sum-exp (the output stays: o_proj saves it).
    ops: the layer input, every matmul output and the attention output."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    hq, hkv = config.num_heads, config.num_kv_heads
    lse = FP32 * hq
    qk_norm = config.qk_norm
    none = (
        2 * (FP32 * h + FP32 + b * h + b * h)  # two RMSNorms: fp32 input, rsqrt, normalised, matmul input
        + (FP32 * (q + kv) + FP32 * (hq + hkv) + b * (q + kv) if qk_norm else 0)  # QK-norm
        + b * (q + 2 * kv)  # attention inputs
        + b * q  # attention output (also o_proj's input)
        + lse
        + 4 * b * i  # gate, silu(gate), up, product
    )
    if mode == "none":
        return float(none)
    if mode == "full":
        return float(b * h)
    if mode == "attention":
        return float(none - lse)
    if mode == "ops":
        return float(b * h + b * (q + 2 * kv + h) + 2 * b * i + b * h + b * q + lse)
    raise ValueError(f"unknown checkpointing mode {mode!r}; choose one of {', '.join(CHECKPOINT_MODES)}")


def head_saved_bytes_per_token(config: ModelConfig, b: int, loss_bytes: int = FP32, chunked: bool = False) -> float:
    """Outside the layers: token ids and targets, RoPE tables, the final norm, the LM-head input and the loss's
    log-softmax over the vocabulary (in fp32 by default). With the chunked loss (lt_plugins.lm_loss) neither the
    targets nor a vocabulary term: the LM-head input's place is taken by its gradient, formed in forward."""
    h = config.hidden_size
    loss = 0 if chunked else 8 + loss_bytes * config.vocab_size  # targets and log-softmax
    return float(8 + 2 * b * config.head_dim + FP32 * h + FP32 + 2 * b * h + loss)


def loss_weight_grad_bytes(config: ModelConfig) -> float:
    """What the chunked loss holds from forward to backward besides its per-token gradient: the LM head's weight
    gradient [vocab, hidden] in fp32 and the target count (when the head trains)."""
    return float(FP32 * config.vocab_size * config.hidden_size + 8)


def activation_bytes(
    config: ModelConfig,
    micro_batch: int,
    seq_len: int,
    mode: str,
    precision: str,
    every_n: int = 1,
    chunked_loss: bool = False,
    head_trains: bool = True,
) -> dict[str, float]:
    """Saved activations of one micro-batch: `saved` (held at the end of forward) and `peak` (saved + the one
    layer being recomputed in backward). Every `every_n`-th layer is checkpointed, the others save as `none`.
    `chunked_loss`: LitCausalLM's chunked loss (`LitCausalLM.chunks_loss`), which holds the head's weight gradient
    when `head_trains` (not under LoRA's frozen head). It saves memory once a micro-batch holds more tokens than
    the model's hidden size (the vocabulary terms a token against one [vocab, hidden] gradient)."""
    b = model_bytes_per_element(precision)
    tokens = micro_batch * seq_len
    ckpt_layers = 0 if mode == "none" else config.num_layers // every_n
    per_none = layer_saved_bytes_per_token(config, "none", b)
    per_mode = layer_saved_bytes_per_token(config, mode, b)
    layers = ckpt_layers * per_mode + (config.num_layers - ckpt_layers) * per_none
    saved = tokens * (layers + head_saved_bytes_per_token(config, b, chunked=chunked_loss))
    if chunked_loss:
        saved += loss_weight_grad_bytes(config) if head_trains else 8.0  # the weight gradient and the count
    recompute = tokens * (per_none - per_mode) if ckpt_layers else 0.0
    return {"saved": saved, "peak": saved + recompute, "per_layer_token": per_mode, "none_per_layer_token": per_none}


# ------------------------------------------------------------------------------------------ compute, comm
def step_flops(config: ModelConfig, tokens: int, seq_len: int, mode: str, every_n: int = 1) -> dict[str, float]:
    """Matmul FLOPs of one training micro-step (forward + 2× backward) and the forward FLOPs recomputed.

    full recomputes the layer's forward (torch stops early before the last matmul; counted whole here),
    attention recomputes scores and weighted sum, ops recomputes only pointwise ops (no matmul FLOPs)."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    proj = 2 * tokens * (h * q + 2 * h * kv + q * h + 3 * h * i)
    attn = 4 * tokens * seq_len * q
    head = 2 * tokens * h * config.vocab_size
    forward = config.num_layers * (proj + attn) + head
    ckpt_layers = 0 if mode == "none" else config.num_layers // every_n
    per_layer = {"none": 0, "full": proj + attn, "attention": attn, "ops": 0}[mode]
    return {"train": 3.0 * forward, "recompute": float(ckpt_layers * per_layer)}


@dataclass(frozen=True)
class Hardware:
    """Assumptions behind the step-time estimate (defaults: an 80 GB data-centre GPU in one node)."""

    gpu_memory: float = 80e9
    bf16_tflops: float = 312.0
    """Dense 16-bit peak; fp32 (TF32) runs at half of it."""
    mfu: float = 0.4
    """Fraction of the peak that training reaches."""
    interconnect_gbps: float = 100.0
    """GB/s each GPU sends and receives in collectives."""
    pcie_gbps: float = 25.0
    """GB/s between a GPU and host memory (offload)."""
    hbm_gbps: float = 2000.0
    """GB/s of GPU memory: prices the pointwise recompute of `ops` (memory-bound, no matmul FLOPs)."""
    cpu_adam_params_per_s: float = 1e9
    """Parameters per second the host optimizer updates for one GPU's share (offload)."""
    reserve: float = 0.1
    """Share of GPU memory kept free for the CUDA context, workspace and fragmentation."""

    @property
    def usable(self) -> float:
        return self.gpu_memory * (1.0 - self.reserve)


def comm_bytes(num_params: float, layout: ZeroLayout) -> dict[str, float]:
    """Bytes each GPU moves per optimizer step: `network` (ring collectives) and `pcie` (offload traffic).

    Stages 0-2: gradient reduce-scatter + parameter all-gather (all-reduce) = 2Ψ(G-1)/G; stage 3 gathers the
    parameters again for backward: 3Ψ(G-1)/G (Ψ = 16-bit model bytes). Optimizer offload sends fp32 gradients down
    and 16-bit weights up; parameter offload fetches the shard for forward and backward."""
    g = layout.world
    psi = num_params * model_bytes_per_element(layout.precision)
    factor = 3.0 if layout.stage == 3 else 2.0
    network = factor * psi * (g - 1) / g if g > 1 else 0.0
    pcie = 0.0
    if layout.offload_optimizer:
        pcie += num_params / g * (FP32 + model_bytes_per_element(layout.precision))
    if layout.offload_params:
        pcie += 2 * psi / g
    return {"network": network, "pcie": pcie}


def step_seconds(
    config: ModelConfig, num_params: float, layout: ZeroLayout, micro_batch: int, seq_len: int, mode: str, hw: Hardware
) -> dict[str, float]:
    """Estimated seconds of one step, by part (compute, pointwise recompute, network, pcie, host optimizer), not
    overlapped. The pointwise recompute reads and writes the bytes a mode does not save, at HBM speed."""
    flops = step_flops(config, micro_batch * seq_len, seq_len, mode)
    acts = activation_bytes(config, micro_batch, seq_len, mode, layout.precision)
    unsaved = micro_batch * seq_len * config.num_layers * (acts["none_per_layer_token"] - acts["per_layer_token"])
    rate = hw.bf16_tflops * 1e12 * hw.mfu * (0.5 if model_bytes_per_element(layout.precision) == FP32 else 1.0)
    comm = comm_bytes(num_params, layout)
    host = num_params / layout.world / hw.cpu_adam_params_per_s if layout.offload_optimizer else 0.0
    return {
        "compute": (flops["train"] + flops["recompute"]) / rate,
        "pointwise_recompute": 2 * unsaved / (hw.hbm_gbps * 1e9) if mode == "ops" else 0.0,
        "network": comm["network"] / (hw.interconnect_gbps * 1e9),
        "pcie": comm["pcie"] / (hw.pcie_gbps * 1e9),
        "host_optimizer": host,
    }
