"""Model configuration: one validated dataclass, named presets, and the Hugging Face `config.json` mapping.

Contract:
- `ModelConfig` is immutable and validated at construction; an invalid value raises `ConfigError` naming the field.
  `max_position_embeddings` must be at least `MIN_POSITIONS`: a shorter context cannot hold a prompt and a reply.
- `PRESETS` holds configs only (never weights). `get_preset(name)` returns a copy.
- `ModelConfig.from_hf_dict` reads `config.json` of model_type llama, qwen2 or qwen3 (transformers 4.x layout with
  `rope_theta`/`rope_scaling`, or 5.x layout with `rope_parameters`). A field whose value changes the architecture
  in a way this decoder does not implement (sliding windows, other activations, other rope types, quantization…) is
  rejected by name, and so is any key this module does not know.
- `to_hf_dict` writes a config that transformers loads as the same architecture.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from shared_model.errors import ConfigError

ModelType = Literal["llama", "qwen2", "qwen3"]
MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3")

MIN_POSITIONS = 16
"""Shortest context (max_position_embeddings) a model may declare: a few prompt tokens plus a reply."""

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling (the only scaling type this decoder implements)."""

    factor: float
    """Divisor applied to the low-frequency (long-wavelength) components."""
    low_freq_factor: float
    """Wavelengths longer than original_max_position_embeddings / low_freq_factor are fully scaled."""
    high_freq_factor: float
    """Wavelengths shorter than original_max_position_embeddings / high_freq_factor are left unscaled."""
    original_max_position_embeddings: int
    """Context length the model was pre-trained with before scaling."""

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ConfigError(
                "rope_scaling.original_max_position_embeddings must be > 0, "
                f"got {self.original_max_position_embeddings}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen3/Qwen2/Llama-family decoder-only transformer."""

    vocab_size: int
    """Number of token embeddings (rows of embed_tokens and of the LM head)."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Number of decoder blocks."""
    num_heads: int
    """Query heads per attention layer."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int
    """Width of one attention head; need not equal hidden_size / num_heads."""
    intermediate_size: int
    """Hidden width of the SwiGLU MLP."""
    model_type: ModelType = "qwen3"
    """Hugging Face model_type written to config.json: llama, qwen2 or qwen3."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling | None = None
    """Optional Llama 3 rope scaling."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool = False
    """Share the LM head weight with the token embedding."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (qwen3)."""
    attention_bias: bool = False
    """Bias on the q, k and v projections (qwen2 always; llama/qwen3 when config.attention_bias)."""
    attention_out_bias: bool = False
    """Bias on the output projection (llama/qwen3 with attention_bias; never qwen2)."""
    max_position_embeddings: int = 4096
    """Longest context the model supports; at least MIN_POSITIONS (16)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id, if the model has one."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence token ids (Llama 3 instruct models have several)."""
    pad_token_id: int | None = None
    """Padding token id, if any."""

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.max_position_embeddings < MIN_POSITIONS:
            raise ConfigError(
                f"max_position_embeddings must be at least {MIN_POSITIONS} (a context that holds a prompt and a "
                f"reply), got {self.max_position_embeddings}"
            )
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            raise ConfigError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        for name in ("bos_token_id", "pad_token_id"):
            tok = getattr(self, name)
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ConfigError(f"{name}={tok} is outside the vocabulary [0, {self.vocab_size})")
        for tok in self.eos_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise ConfigError(f"eos_token_ids contains {tok}, outside the vocabulary [0, {self.vocab_size})")

    # ----------------------------------------------------------------- derived sizes
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of one token's keys (or values) in one layer: kv_heads · head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Exact parameter count of the decoder (tied embeddings counted once)."""
        h, q, kv, inter = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.attention_out_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * inter + 2 * h
        total = self.num_layers * per_layer + h  # + final norm
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------- Hugging Face mapping
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the contents of a Hugging Face `config.json`; reject what this decoder cannot run."""
        return _from_hf(raw)

    def to_hf_dict(self, torch_dtype: str | None = None) -> dict[str, Any]:
        """The `config.json` contents transformers reads back as this architecture."""
        out: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": float(self.rope_theta),
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _eos_out(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "attention_dropout": 0.0,
            "use_cache": True,
        }
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        if self.rope_scaling is not None:
            scaling = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
            out["rope_scaling"] = scaling
            rope_parameters = {**scaling, "rope_theta": float(self.rope_theta)}
        out["rope_parameters"] = rope_parameters
        if self.model_type == "qwen2":
            if not (self.attention_bias and not self.attention_out_bias):
                raise ConfigError("model_type qwen2 requires attention_bias=True and attention_out_bias=False")
            out["use_sliding_window"] = False
        else:
            if self.attention_bias != self.attention_out_bias:
                raise ConfigError(
                    f"model_type {self.model_type} has one attention_bias flag for q/k/v/o; got "
                    f"attention_bias={self.attention_bias}, attention_out_bias={self.attention_out_bias}"
                )
            out["attention_bias"] = self.attention_bias
        if self.model_type == "qwen3":
            if not self.qk_norm:
                raise ConfigError("model_type qwen3 always has qk_norm=True")
            out["use_sliding_window"] = False
        elif self.qk_norm:
            raise ConfigError(f"model_type {self.model_type} has no QK-norm; set model_type='qwen3'")
        if self.model_type == "llama":
            out["mlp_bias"] = False
            out["pretraining_tp"] = 1
        if torch_dtype is not None:
            out["torch_dtype"] = torch_dtype
        return out


def _eos_out(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


# Keys that carry no architectural meaning for inference or training here (bookkeeping, generation defaults).
_IGNORED_KEYS = frozenset(
    {
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "initializer_range",
        "_name_or_path",
        "name_or_path",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "_attn_implementation_autoset",
        "is_decoder",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "tokenizer_class",
        "chunk_size_feed_forward",
        "problem_type",
        "max_window_layers",  # only meaningful with use_sliding_window=true, which is rejected
        "sliding_window",  # idem
        "tf_legacy_loss",
        "use_bfloat16",
        "model_name",
    }
)


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw or raw[key] is None:
        raise ConfigError(f"config.json is missing required field '{key}'")
    return raw[key]


def _int_field(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default) if default is not None else _require(raw, key)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"config.json field '{key}' must be an integer, got {value!r}")
    return value


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    if theta is None:
        theta = 10000.0
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ConfigError(f"config.json field 'rope_theta' must be a number, got {theta!r}")
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise ConfigError(f"config.json field 'rope_scaling' must be an object, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ConfigError(f"config.json rope_scaling type {rope_type!r} is not supported (supported: default, llama3)")
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ConfigError(f"config.json rope_scaling (llama3) is missing '{exc.args[0]}'") from None


def _from_hf(raw: dict[str, Any]) -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"config.json model_type {model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})"
        )
    handled = {
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "rms_norm_eps",
        "tie_word_embeddings",
        "attention_bias",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "hidden_act",
        "mlp_bias",
        "attention_dropout",
        "use_sliding_window",
        "layer_types",
        "pretraining_tp",
    }
    unknown = sorted(k for k in raw if k not in handled and k not in _IGNORED_KEYS)
    if unknown:
        raise ConfigError(f"config.json has unsupported field(s): {', '.join(unknown)}")
    _check_value(raw, "hidden_act", {"silu", None})
    _check_value(raw, "mlp_bias", {False, None})
    _check_value(raw, "use_sliding_window", {False, None})
    _check_value(raw, "pretraining_tp", {1, None})
    dropout = raw.get("attention_dropout") or 0.0
    if dropout != 0.0:
        raise ConfigError(f"config.json field 'attention_dropout'={dropout} is not supported (must be 0)")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        bad = sorted({t for t in layer_types if t != "full_attention"})
        raise ConfigError(f"config.json field 'layer_types' has unsupported types: {bad}")

    hidden = _int_field(raw, "hidden_size")
    heads = _int_field(raw, "num_attention_heads")
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads})")
        head_dim = hidden // heads
    theta, scaling = _parse_rope(raw)
    bias = bool(raw.get("attention_bias", False))
    if model_type == "qwen2":
        qkv_bias, out_bias = True, False
    else:
        qkv_bias, out_bias = bias, bias
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,))
    return ModelConfig(
        model_type=model_type,
        vocab_size=_int_field(raw, "vocab_size"),
        hidden_size=hidden,
        num_layers=_int_field(raw, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_int_field(raw, "num_key_value_heads", heads),
        head_dim=head_dim,
        intermediate_size=_int_field(raw, "intermediate_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        attention_bias=qkv_bias,
        attention_out_bias=out_bias,
        max_position_embeddings=_int_field(raw, "max_position_embeddings", 4096),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=raw.get("pad_token_id"),
    )


def _check_value(raw: dict[str, Any], key: str, allowed: set[Any]) -> None:
    if key in raw and raw[key] not in allowed:
        shown = sorted(repr(a) for a in allowed if a is not None)
        raise ConfigError(f"config.json field '{key}'={raw[key]!r} is not supported (supported: {', '.join(shown)})")


# --------------------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class Preset:
    """A named architecture; `nominal_params` is the model card's rounded figure, when there is one."""

    config: ModelConfig
    description: str
    nominal_params: float | None = field(default=None)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        ModelConfig(
            model_type="qwen3",
            vocab_size=8192,
            hidden_size=256,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            intermediate_size=768,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            qk_norm=True,
            max_position_embeddings=2048,
        ),
        "about 5M parameters: tests and the CPU demo",
    ),
    "mini": Preset(
        ModelConfig(
            model_type="qwen3",
            vocab_size=8192,
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            num_kv_heads=4,
            head_dim=64,
            intermediate_size=1536,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            qk_norm=True,
            max_position_embeddings=2048,
        ),
        "about 30M parameters: trainable on 2 CPU cores in under an hour, large enough that reading the weights "
        "is most of a CPU decode step (the speculative-decoding benchmark's model)",
    ),
    "small": Preset(
        ModelConfig(
            model_type="qwen3",
            vocab_size=32768,
            hidden_size=768,
            num_layers=12,
            num_heads=12,
            num_kv_heads=4,
            head_dim=64,
            intermediate_size=2048,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            qk_norm=True,
            max_position_embeddings=4096,
        ),
        "about 100M parameters: benchmarks",
    ),
    "qwen3-0.6b": Preset(
        ModelConfig(
            model_type="qwen3",
            vocab_size=151936,
            hidden_size=1024,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=3072,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
            qk_norm=True,
            max_position_embeddings=40960,
            bos_token_id=151643,
            eos_token_ids=(151645,),
        ),
        "Qwen3-0.6B architecture",
        nominal_params=0.6e9,
    ),
    "qwen3-8b": Preset(
        ModelConfig(
            model_type="qwen3",
            vocab_size=151936,
            hidden_size=4096,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=12288,
            rope_theta=1_000_000.0,
            tie_word_embeddings=False,
            qk_norm=True,
            max_position_embeddings=40960,
            bos_token_id=151643,
            eos_token_ids=(151645,),
        ),
        "Qwen3-8B architecture (model card: 8.2B parameters)",
        nominal_params=8.2e9,
    ),
    "llama-3.2-1b": Preset(
        ModelConfig(
            model_type="llama",
            vocab_size=128256,
            hidden_size=2048,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            intermediate_size=8192,
            rope_theta=500000.0,
            rope_scaling=RopeScaling(
                factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
            ),
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            bos_token_id=128000,
            eos_token_ids=(128001,),
        ),
        "Llama 3.2 1B architecture (model card: 1.23B parameters)",
        nominal_params=1.23e9,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The config of a named preset; the error lists the valid names."""
    try:
        return PRESETS[name].config
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
