"""The memory ledger: one source of truth for the byte and work formulas both halves of Tandem use.

Contract:
- Pure arithmetic on integers and configs; no torch tensors are allocated.
- Inference: weight bytes by precision, and as served (`served_weight_bytes`: the engine's merged layout, int8 /
  int4 weight-only quantization with its scales, the policy of `shared_model.quantize`); K/V cache bytes
  = 2·N·B·L·d·b (N layers, B sequences, L tokens, d = kv_heads·head_dim, b bytes per element), plus, for the
  scaled K/V dtypes (fp8, int8), one fp32 scale per (layer, K|V, block, kv head): `kv_bytes_per_block` is the one
  owner of "bytes of a K/V dtype" (the engine sizes its pool with it; GetModelInfo, /metrics and `tandem ledger`
  report it); attention work as query–key pairs.
- Training (mixed-precision AdamW, the lecture's accounting): per parameter 2 (16-bit weights) + 4 (fp32 master)
  + 4 (fp32 gradients) + 8 (two fp32 Adam moments) = 18 bytes, and how ZeRO stages 1/2/3 divide those terms over
  N GPUs (1: optimizer state = master + moments; 2: + gradients; 3: + 16-bit weights).
- `ledger_report` gathers these for one model into a `LedgerReport` that renders as a table or JSON. Its default
  context is `default_context(config)`: 4,096 tokens, or the model's `max_position_embeddings` when that is smaller.
- The table (`format_report`) uses decimal units throughout (B, kB, MB, GB: powers of 10, as the lecture does);
  `human_count` writes parameter counts at any scale (5.25M, 101M, 8.19B).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from shared_model.config import ModelConfig

BYTES_PER_ELEMENT: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "fp8": 1,
    "int8": 1,
}

GB = 10**9
"""The lecture's unit for training state (decimal gigabytes)."""
MiB = 2**20

DEFAULT_CONTEXT = 4096
"""Tokens per sequence the ledger assumes unless told, capped at the model's own maximum (`default_context`)."""


def default_context(config: ModelConfig) -> int:
    """4,096 tokens, or the model's max_position_embeddings when that is smaller."""
    return min(DEFAULT_CONTEXT, config.max_position_embeddings)


def element_bytes(dtype: str) -> int:
    """Bytes of one element of a dtype name ('bf16', 'float32', ...); the error lists valid names."""
    try:
        return BYTES_PER_ELEMENT[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(BYTES_PER_ELEMENT)}") from None


# ------------------------------------------------------------------------------------------- inference
def weight_bytes(num_params: int | float, dtype: str = "bf16") -> float:
    return num_params * element_bytes(dtype)


QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
"""Inputs per int4 scale and zero that torch's int4 kernels accept."""
DEFAULT_GROUP_SIZE = 64


def quantized_matrix_bytes(
    rows: int, cols: int, kind: str, group_size: int = DEFAULT_GROUP_SIZE, scale_bytes: int = 2
) -> int:
    """One [rows, cols] weight stored as `kind`: int8 = a byte per weight + a scale per row; int4 = half a byte per
    weight + a scale and a zero per row and group of `group_size` inputs."""
    if kind == "int8":
        return rows * cols + rows * scale_bytes
    if kind == "int4":
        return rows * cols // 2 + (cols // group_size) * rows * 2 * scale_bytes
    raise ValueError(f"quantization must be int8 or int4 here, got {kind!r}")


def served_weight_bytes(
    config: ModelConfig, weight_dtype: str = "bf16", quantization: str = "none", group_size: int = DEFAULT_GROUP_SIZE
) -> int:
    """Bytes of the weights as the engine holds them (`shared_model.serving_model`): every parameter in
    `weight_dtype`, with each layer's q_norm and k_norm weights (2·D) replaced by the merged q/k-norm table
    ((Hq + Hkv)·D) when the model has QK-norm; with a quantization, its projections and LM head in the quantized
    formats (scales 16-bit) and an int8 LM head beside a tied embedding (`shared_model.quantize`)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    c, b = config, element_bytes(weight_dtype)
    qk_table = (c.num_heads + c.num_kv_heads - 2) * c.head_dim * b * c.num_layers if c.qk_norm else 0
    total = c.num_parameters() * b + qk_table
    if quantization == "none":
        return total
    h, inter = c.hidden_size, c.intermediate_size
    matrices = [(c.q_size + 2 * c.kv_size, h), (h, c.q_size), (2 * inter, h), (h, inter)]
    per_layer_dense = sum(r * k for r, k in matrices) * b
    per_layer_quant = sum(quantized_matrix_bytes(r, k, quantization, group_size) for r, k in matrices)
    total += c.num_layers * (per_layer_quant - per_layer_dense)
    head = quantized_matrix_bytes(c.vocab_size, h, "int8")
    return total + head - (0 if c.tie_word_embeddings else c.vocab_size * h * b)


def kv_cache_bytes(num_layers: int, batch: int, context: int, kv_width: int, bytes_per_element: int) -> int:
    """2·N·B·L·d·b: keys and values, at every layer, for every cached token of every sequence."""
    return 2 * num_layers * batch * context * kv_width * bytes_per_element


KV_BLOCK_SIZE = 16
"""Tokens per K/V block the ledger assumes unless told (the engine's default `block_size`)."""
SCALED_KV_DTYPES = ("fp8", "int8")
"""K/V dtypes stored with per-(block, kv head) scales (`inference_svc.engine.kv_cache`)."""
KV_SCALE_BYTES = 4
"""Each K/V scale is one fp32."""


def kv_scale_bytes_per_block(config: ModelConfig, dtype: str) -> int:
    """Scale bytes of one K/V block across all layers: 2 (K, V) · N layers · kv_heads · 4 B for fp8/int8, else 0."""
    element_bytes(dtype)  # an unknown name is an error here too
    if dtype not in SCALED_KV_DTYPES:
        return 0
    return 2 * config.num_layers * config.num_kv_heads * KV_SCALE_BYTES


def kv_bytes_per_block(config: ModelConfig, dtype: str = "bf16", block_size: int = KV_BLOCK_SIZE) -> int:
    """Bytes of one K/V block of `block_size` tokens across all layers, scales included (the pool's unit)."""
    data = kv_cache_bytes(config.num_layers, 1, block_size, config.kv_size, element_bytes(dtype))
    return data + kv_scale_bytes_per_block(config, dtype)


def kv_bytes_per_token(config: ModelConfig, dtype: str = "bf16", block_size: int = KV_BLOCK_SIZE) -> int:
    """K/V bytes one token adds to the cache across all layers: `kv_bytes_per_block / block_size`, rounded up to
    a whole byte when a block's scales do not divide evenly (exact for unscaled dtypes and whenever
    layers · kv_heads · 8 is a multiple of the block size)."""
    return -(-kv_bytes_per_block(config, dtype, block_size) // block_size)


def kv_sequences_bytes(
    config: ModelConfig, dtype: str, batch: int, context: int, block_size: int = KV_BLOCK_SIZE
) -> int:
    """K/V bytes of `batch` sequences of `context` tokens: 2·N·B·L·d·b, plus the scales of the
    ceil(L / block_size) blocks each sequence touches (scaled dtypes only)."""
    data = kv_cache_bytes(config.num_layers, batch, context, config.kv_size, element_bytes(dtype))
    return data + batch * -(-context // block_size) * kv_scale_bytes_per_block(config, dtype)


def prefill_pairs(context: int, causal: bool = False) -> int:
    """Query–key pairs of attention over a whole prompt: L² dense, L(L+1)/2 with the causal mask."""
    return context * (context + 1) // 2 if causal else context * context


def decode_pairs(context: int) -> int:
    """Query–key pairs of one cached decode step: the new token against every cached key."""
    return context


# -------------------------------------------------------------------------------------------- training
@dataclass(frozen=True)
class TrainingStateTerm:
    name: str
    bytes_per_param: int
    partitioned_from_stage: int
    """The first ZeRO stage that shards this term over the GPUs."""


TRAINING_STATE: tuple[TrainingStateTerm, ...] = (
    TrainingStateTerm("16-bit weights used for computation", 2, 3),
    TrainingStateTerm("FP32 master weights for updates", 4, 1),
    TrainingStateTerm("FP32 gradients", 4, 2),
    TrainingStateTerm("Two FP32 Adam moment arrays", 8, 1),
)
TRAINING_BYTES_PER_PARAM = sum(t.bytes_per_param for t in TRAINING_STATE)  # 18


def zero_state_bytes_per_gpu(num_params: int | float, zero_stage: int, gpus: int) -> dict[str, float]:
    """Bytes of each training-state term on one GPU under a ZeRO stage (0 = plain data parallelism)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    out = {}
    for term in TRAINING_STATE:
        total = num_params * term.bytes_per_param
        sharded = zero_stage >= term.partitioned_from_stage
        out[term.name] = total / gpus if sharded else total
    return out


# -------------------------------------------------------------------------------------------------- LoRA
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder's linear layers a LoRA adapter may target (lt_plugins.lora's default targets: all of them)."""
LORA_BASE_DTYPES = ("bf16", "int8", "fp32")
INT8_SCALE_BYTES = 4
"""One fp32 absmax scale per output row of an int8 frozen matrix (lt_plugins.lora.quantize_rows)."""


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each decoder projection."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip


def lora_adapter_params(config: ModelConfig, rank: int, projections: tuple[str, ...] = LORA_PROJECTIONS) -> int:
    """Trainable adapter parameters: r·(in + out) for each targeted projection of every layer."""
    shapes = projection_shapes(config)
    unknown = [p for p in projections if p not in shapes]
    if unknown or rank < 1:
        raise ValueError(f"unknown projection {unknown[0]!r}" if unknown else f"lora rank must be >= 1, got {rank}")
    return config.num_layers * sum(rank * sum(shapes[p]) for p in projections)


def lora_frozen_bytes(
    config: ModelConfig, base_dtype: str = "bf16", projections: tuple[str, ...] = LORA_PROJECTIONS
) -> float:
    """Bytes of the frozen base: every parameter at `base_dtype`'s size; with int8 the targeted matrices take 1 B
    an element plus a 4-byte scale a row and the rest (embeddings, norms, LM head) stays bf16."""
    n = config.num_parameters()
    if base_dtype != "int8":
        return float(n * element_bytes(base_dtype))
    shapes = projection_shapes(config)
    matrices = config.num_layers * sum(shapes[p][0] * shapes[p][1] for p in projections)
    rows = config.num_layers * sum(shapes[p][1] for p in projections)
    return float(matrices + INT8_SCALE_BYTES * rows + 2 * (n - matrices))


def lora_state_bytes(
    config: ModelConfig, rank: int, base_dtype: str = "bf16", projections: tuple[str, ...] = LORA_PROJECTIONS
) -> dict[str, float]:
    """LoRA's training state on one GPU before sharding: the frozen base and the adapters at the lecture's 18 B a
    parameter (16-bit copy, fp32 master, fp32 gradient, two fp32 moments). Activations are as for full training."""
    adapters = lora_adapter_params(config, rank, projections)
    frozen = lora_frozen_bytes(config, base_dtype, projections)
    state = adapters * TRAINING_BYTES_PER_PARAM
    return {"adapter_params": float(adapters), "frozen_bytes": frozen, "adapter_state_bytes": float(state),
            "total_bytes": frozen + state}  # fmt: skip


# --------------------------------------------------------------------------------------------- report
@dataclass
class LedgerReport:
    """Everything `tandem ledger` prints, as data."""

    model: str
    num_params: int
    nominal_params: float | None
    inference: dict[str, float] = field(default_factory=dict)
    kv_cache: dict[str, float] = field(default_factory=dict)
    attention_pairs: dict[str, int] = field(default_factory=dict)
    training_state: list[dict[str, float | str | None]] = field(default_factory=list)
    zero: dict[str, float | int] = field(default_factory=dict)
    quantization: str = "none"
    context: int = DEFAULT_CONTEXT
    batch: int = 1
    max_position_embeddings: int | None = None
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    weight_dtype_source: str = "default"
    """Where the weight dtype came from: 'default', or e.g. '--weight-dtype', 'config.json torch_dtype'."""
    context_is_default: bool = False
    """The context was not given: `default_context(config)`."""
    lora: dict[str, float | int | str] = field(default_factory=dict)
    """With a LoRA rank: `lora_state_bytes` plus rank, base_dtype and the per-GPU split; empty otherwise."""

    def to_dict(self) -> dict:
        return asdict(self)


def ledger_report(
    config: ModelConfig,
    name: str,
    nominal_params: float | None = None,
    context: int | None = None,
    batch: int = 1,
    gpus: int = 1,
    zero_stage: int = 0,
    kv_dtype: str = "bf16",
    weight_dtype: str = "bf16",
    quantization: str = "none",
    group_size: int = DEFAULT_GROUP_SIZE,
    weight_dtype_source: str = "default",
    kv_block_size: int = KV_BLOCK_SIZE,
    lora_rank: int | None = None,
    lora_base_dtype: str = "bf16",
) -> LedgerReport:
    """The ledger of one model; `context` None means `default_context(config)`."""
    context_is_default = context is None
    if context is None:
        context = default_context(config)
    for label, value in (("context", context), ("batch", batch), ("gpus", gpus), ("kv_block_size", kv_block_size)):
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    n = config.num_parameters()
    rep = LedgerReport(
        model=name,
        num_params=n,
        nominal_params=nominal_params,
        context=context,
        batch=batch,
        max_position_embeddings=config.max_position_embeddings,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        weight_dtype_source=weight_dtype_source,
        context_is_default=context_is_default,
    )
    b_kv = element_bytes(kv_dtype)
    rep.inference = {
        "weight_dtype_bytes": element_bytes(weight_dtype),
        "weight_bytes": weight_bytes(n, weight_dtype),
        "served_weight_bytes": served_weight_bytes(config, weight_dtype, quantization, group_size),
    }
    rep.quantization = quantization
    rep.kv_cache = {
        "layers": config.num_layers,
        "kv_width": config.kv_size,
        "dtype_bytes": b_kv,
        "block_size": kv_block_size,
        "scale_bytes_per_block": kv_scale_bytes_per_block(config, kv_dtype),
        "bytes_per_block": kv_bytes_per_block(config, kv_dtype, kv_block_size),
        "bytes_per_token": kv_bytes_per_token(config, kv_dtype, kv_block_size),
        "bytes": kv_sequences_bytes(config, kv_dtype, batch, context, kv_block_size),
        "bytes_at_2x_context": kv_sequences_bytes(config, kv_dtype, batch, 2 * context, kv_block_size),
    }
    rep.attention_pairs = {
        "prefill_dense": prefill_pairs(context) * batch,
        "prefill_dense_at_2x_context": prefill_pairs(2 * context) * batch,
        "prefill_causal": prefill_pairs(context, causal=True) * batch,
        "decode_step": decode_pairs(context) * batch,
        "decode_step_at_2x_context": decode_pairs(2 * context) * batch,
    }
    for term in TRAINING_STATE:
        rep.training_state.append(
            {
                "term": term.name,
                "bytes_per_param": term.bytes_per_param,
                "bytes": n * term.bytes_per_param,
                "bytes_at_nominal": None if nominal_params is None else nominal_params * term.bytes_per_param,
            }
        )
    rep.training_state.append(
        {
            "term": "Training state subtotal",
            "bytes_per_param": TRAINING_BYTES_PER_PARAM,
            "bytes": n * TRAINING_BYTES_PER_PARAM,
            "bytes_at_nominal": None if nominal_params is None else nominal_params * TRAINING_BYTES_PER_PARAM,
        }
    )
    per_gpu = zero_state_bytes_per_gpu(n, zero_stage, gpus)
    rep.zero = {"stage": zero_stage, "gpus": gpus, **per_gpu, "total_per_gpu": sum(per_gpu.values())}
    if lora_rank is not None:
        if lora_base_dtype not in LORA_BASE_DTYPES:
            raise ValueError(f"lora base dtype must be one of {', '.join(LORA_BASE_DTYPES)}, got {lora_base_dtype!r}")
        terms = lora_state_bytes(config, lora_rank, lora_base_dtype)
        adapters = zero_state_bytes_per_gpu(terms["adapter_params"], zero_stage, gpus)
        frozen_gpu = terms["frozen_bytes"] / gpus if zero_stage == 3 else terms["frozen_bytes"]
        rep.lora = {"rank": lora_rank, "base_dtype": lora_base_dtype, **terms, "frozen_per_gpu": frozen_gpu,
                    "adapter_state_per_gpu": sum(adapters.values()),
                    "total_per_gpu": frozen_gpu + sum(adapters.values())}  # fmt: skip
    return rep


COUNT_SUFFIXES: tuple[tuple[str, float], ...] = (("", 1.0), ("K", 1e3), ("M", 1e6), ("B", 1e9), ("T", 1e12))


def human_count(n: float) -> str:
    """A count with three significant digits and a K/M/B/T suffix: 512, 5.25M, 101M, 8.19B."""
    i = 0
    while i + 1 < len(COUNT_SUFFIXES) and abs(n) >= COUNT_SUFFIXES[i + 1][1]:
        i += 1
    if i + 1 < len(COUNT_SUFFIXES) and abs(float(f"{n / COUNT_SUFFIXES[i][1]:.3g}")) >= 1000:
        i += 1  # 999,999 is 1M, not 1e+03K
    suffix, size = COUNT_SUFFIXES[i]
    v = n / size
    return (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}") + suffix


DECIMAL_UNITS: tuple[tuple[str, int], ...] = (("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def decimal_bytes(x: float) -> str:
    """Bytes in decimal units (the lecture's): GB from 1 GB up, then MB, kB, B."""
    for unit, size in DECIMAL_UNITS:
        if abs(x) >= size:
            return f"{x / size:,.1f} {unit}"
    return f"{x:,.0f} B"


def format_report(rep: LedgerReport, context: int | None = None, batch: int | None = None) -> str:
    """A plain-text rendering: inference terms, context growth, the training-state table, the ZeRO split. One unit
    system throughout (decimal: 1 kB = 10^3 B, 1 MB = 10^6 B, 1 GB = 10^9 B). `context` and `batch` default to
    the report's own."""
    context = rep.context if context is None else context
    batch = rep.batch if batch is None else batch
    lines = [f"Memory ledger: {rep.model}  (decimal units: 1 kB = 10^3 B, 1 MB = 10^6 B, 1 GB = 10^9 B)"]
    params = f"{rep.num_params:,} parameters ({human_count(rep.num_params)})"
    if rep.nominal_params is not None:
        params += f", model card: {rep.nominal_params / 1e9:.2g}B"
    lines.append(f"  {params}")
    max_pos = rep.max_position_embeddings
    line = f"  context L = {context:,} tokens, batch B = {batch}"
    if max_pos is not None and rep.context_is_default:
        line += f" (default: the smaller of {DEFAULT_CONTEXT:,} and the model's max_position_embeddings, {max_pos:,})"
    elif max_pos is not None and context > max_pos:
        line += f" (more than the model's max_position_embeddings, {max_pos:,})"
    elif max_pos is not None:
        line += f" (the model's max_position_embeddings is {max_pos:,})"
    lines.append(line)
    lines.append("")
    kv = rep.kv_cache
    kv_formula = f"2 x {kv['layers']} layers x {kv['kv_width']} x {kv['dtype_bytes']} B"
    if kv.get("scale_bytes_per_block"):
        kv_formula += f" + {kv['scale_bytes_per_block']} B scales / {kv['block_size']} tokens"
    wb = int(rep.inference["weight_dtype_bytes"])
    source = "by default" if rep.weight_dtype_source == "default" else f"from {rep.weight_dtype_source}"
    weights_label = f"weights ({rep.weight_dtype} {source}, {wb} B/param)"
    rows = [
        (weights_label, rep.inference["weight_bytes"]),
        (f"weights as served ({rep.quantization})", rep.inference["served_weight_bytes"]),
        (f"K/V per token ({kv_formula})", kv["bytes_per_token"]),
        (f"K/V cache (B={batch}, L={context}, {rep.kv_dtype})", kv["bytes"]),
    ]
    width = max(46, *(len(label) + 2 for label, _ in rows))
    lines.append("Inference")
    lines += [f"  {label:<{width}}{decimal_bytes(x):>12}" for label, x in rows]
    lines += [
        "",
        f"If the context doubles ({context} -> {2 * context})",
    ]
    ap = rep.attention_pairs
    lines += [
        f"  dense prefill pairs    {ap['prefill_dense']:,} -> {ap['prefill_dense_at_2x_context']:,}"
        f"  ({ap['prefill_dense_at_2x_context'] / ap['prefill_dense']:.0f}x)",
        f"  cached decode pairs    {ap['decode_step']:,} -> {ap['decode_step_at_2x_context']:,}"
        f"  ({ap['decode_step_at_2x_context'] / ap['decode_step']:.0f}x)",
        f"  K/V cache bytes        {decimal_bytes(kv['bytes'])} -> {decimal_bytes(kv['bytes_at_2x_context'])}"
        f"  ({kv['bytes_at_2x_context'] / kv['bytes']:.0f}x)",
        "",
        "Training state, mixed-precision AdamW",
    ]
    nominal = rep.nominal_params is not None
    head = f"  {'Stored arrays':<38}{'B/param':>8}"
    if nominal:
        head += f"{'@' + format(rep.nominal_params / 1e9, '.2g') + 'B':>12}"
    head += f"{'@ exact':>12}"
    lines.append(head)
    for row in rep.training_state:
        line = f"  {row['term']:<38}{row['bytes_per_param']:>8}"
        if nominal:
            line += f"{decimal_bytes(float(row['bytes_at_nominal'] or 0)):>12}"
        line += f"{decimal_bytes(float(row['bytes'] or 0)):>12}"
        lines.append(line)
    z = rep.zero
    stage_name = "plain data parallel" if z["stage"] == 0 else f"ZeRO-{z['stage']}"
    lines += ["", f"Per GPU with {stage_name} over {z['gpus']} GPU(s) (exact parameter count)"]
    for term in TRAINING_STATE:
        lines.append(f"  {term.name:<38}{decimal_bytes(float(z[term.name])):>12}")
    lines.append(f"  {'total':<38}{decimal_bytes(float(z['total_per_gpu'])):>12}")
    if rep.lora:
        lo = rep.lora
        adapters = float(lo["adapter_params"])
        lines += [
            "",
            f"LoRA training state, rank {lo['rank']} on all seven projections, frozen base in {lo['base_dtype']}",
            f"  {'adapter parameters':<38}{human_count(adapters):>12}  ({adapters / rep.num_params:.2%} of the model)",
            f"  {'frozen base weights':<38}{decimal_bytes(float(lo['frozen_bytes'])):>12}",
            f"  {'adapter state (18 B/param)':<38}{decimal_bytes(float(lo['adapter_state_bytes'])):>12}",
            f"  {'total (activations as for full training)':<38}{decimal_bytes(float(lo['total_bytes'])):>12}"
            f"  vs {decimal_bytes(rep.num_params * TRAINING_BYTES_PER_PARAM)} full fine-tuning",
            f"  {'per GPU with ' + stage_name + ' over ' + str(z['gpus']):<38}"
            f"{decimal_bytes(float(lo['total_per_gpu'])):>12}",
        ]
    return "\n".join(lines)
