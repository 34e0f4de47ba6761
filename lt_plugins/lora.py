"""Low-rank adapters (LoRA) applied to any module from outside, as the checkpointing policies are.

Contract:
- `LoraConfig` (frozen, validated: a bad value is a one-line `TrainingConfigError` naming `lora.<field>`) says which
  `nn.Linear` modules get an adapter (`targets`: fnmatch patterns over the module's qualified names, such as
  `*.q_proj`), its `rank` r, `alpha` (the update is scaled by alpha/r), the `dropout` on the adapter's input, whether
  the embeddings and the LM head train in full, and `base_dtype`, how the frozen weights are held: `model` (as they
  are), `bf16`, or `int8` (per output row absmax int8 + an fp32 scale, dequantized in each forward: the QLoRA
  idea); `bf16` and `int8` need stages 0-2 (under ZeRO-3 the partitions keep the training dtype, bf16 with
  trainer.precision=bf16-mixed).
- `apply_lora(module, config)` replaces each targeted `nn.Linear` by a `LoraLinear` (same qualified name; its frozen
  `weight`/`bias` keep their names, so the base's state-dict keys are unchanged except `weight` becoming
  `weight_int8` + `weight_scale` under int8), sets `requires_grad=False` on every other parameter (the embeddings
  and `lm_head.weight` stay trainable when asked), and returns the wrapped names. A pattern that matches no
  `nn.Linear` is a `TrainingConfigError` naming the pattern and a few module names. Idempotent: a module already
  wrapped is left alone. Under DeepSpeed's `zero.Init` (ZeRO-3, Lightning's `configure_model`) the new adapter
  parameters are partitioned as they are created and the frozen base stays partitioned.
- `LoraLinear.forward(x)` = x·Wᵀ + b + scaling · dropout(x)·Aᵀ·Bᵀ with A [r, in] (Kaiming-uniform, as PEFT) and
  B [out, r] (zeros, so a fresh adapter leaves the model unchanged).
- The adapter's representation is what serving stacks per row: per target module an A [r, in] and a B [out, r] and
  one scalar `scaling`; `lora_tensors(state, names)` pulls them out of a (consolidated) state dict by module name.
- `LORA_META` (`lora.json` in the run's `model_meta/`) records the config and the base it was trained on, for export.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lt_plugins.errors import TrainingConfigError

BASE_DTYPES = ("model", "bf16", "int8")
DEFAULT_TARGETS = ("*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*.gate_proj", "*.up_proj", "*.down_proj")
LORA_META = "lora.json"
"""File in the run's model_meta/ holding the LoRA config and the base model it applies to."""


@dataclass(frozen=True)
class LoraConfig:
    """Which linear layers carry a low-rank adapter and how. Mirrors the `lora:` section of the training YAML."""

    enabled: bool = False
    """Train a LoRA adapter instead of the full model."""
    rank: int = 8
    """Rank r of each adapter (A is [r, in], B is [out, r]); >= 1."""
    alpha: float = 16.0
    """The update B·A is scaled by alpha / rank; > 0."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training, in [0, 1)."""
    targets: tuple[str, ...] = DEFAULT_TARGETS
    """fnmatch patterns over the model's module names (`*.q_proj`, `model.layers.0.*`); each must match an
    nn.Linear."""
    train_embeddings: bool = False
    """Also train the token embeddings in full (exported as PEFT's modules_to_save)."""
    train_lm_head: bool = False
    """Also train the LM head in full (exported as PEFT's modules_to_save)."""
    base_dtype: str = "model"
    """Frozen weights: model (the training dtype) | bf16 | int8 (row-wise absmax, dequantized per forward);
    bf16 and int8 need strategy.stage <= 2."""
    export_merged: bool = False
    """At the end of `tandem train` also write the merged bundle (W + alpha/r·B·A) to <run_dir>/bundle."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise TrainingConfigError(f"lora.rank must be an integer >= 1, got {self.rank!r}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise TrainingConfigError(f"lora.alpha must be a finite number > 0, got {self.alpha!r}")
        if not math.isfinite(self.dropout) or not 0 <= self.dropout < 1:
            raise TrainingConfigError(f"lora.dropout must be a finite number in [0, 1), got {self.dropout!r}")
        if self.base_dtype not in BASE_DTYPES:
            raise TrainingConfigError(
                f"lora.base_dtype must be one of {', '.join(BASE_DTYPES)}, got {self.base_dtype!r}"
            )
        if not self.targets or any(not isinstance(t, str) or not t for t in self.targets):
            raise TrainingConfigError(
                f"lora.targets must be a non-empty list of module-name patterns, got {self.targets!r}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float → (int8 [out, in], fp32 scale [out]): symmetric absmax per output row."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return q, scale


class LoraLinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (see the module contract)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, base_dtype: str = "model") -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.scaling = rank, alpha / rank
        self.quantized = base_dtype == "int8"
        if self.quantized:
            q, scale = quantize_rows(base.weight)
            self.register_buffer("weight_int8", q)  # [out, in] int8
            self.register_buffer("weight_scale", scale)  # [out] fp32
            self.weight = None
        else:
            weight = base.weight
            if base_dtype == "bf16":
                weight = nn.Parameter(weight.detach().to(torch.bfloat16))
            weight.requires_grad_(False)
            self.weight = weight  # [out, in], the same Parameter (and name) as the base's
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        factory = {"device": (base.weight.device if base.weight.device.type != "meta" else None)}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **factory)  # [r, in], Kaiming-uniform as PEFT
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **factory)  # [out, r]
        _zero(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def base_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The frozen weight [out, in] in `dtype` (dequantized under int8)."""
        if self.quantized:
            return (self.weight_int8.to(torch.float32) * self.weight_scale.float()[:, None]).to(dtype)
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] → [..., out]
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        out = F.linear(x, self.base_weight(x.dtype), bias)
        a = self.lora_A.weight.to(x.dtype)  # [r, in]
        b = self.lora_B.weight.to(x.dtype)  # [out, r]
        return out + F.linear(F.linear(self.lora_dropout(x), a), b) * self.scaling

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.rank}, scaling={self.scaling:g}"


@torch.no_grad()
def _zero(param: nn.Parameter) -> None:
    """Zero a parameter, whole or (under ZeRO-3) this rank's partition."""
    ds = getattr(param, "ds_tensor", None)
    (ds if ds is not None else param.data).zero_()


def _under_zero_init() -> bool:
    import sys

    module = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    return module is not None and getattr(module, "zero_init_context", 0) > 0


def _is_partitioned(module: nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in module.parameters())


def matched_linears(module: nn.Module, config: LoraConfig) -> list[str]:
    """Qualified names of the nn.Linear modules the config's targets select (already wrapped ones included), in
    module order.
    A pattern that matches none is a TrainingConfigError naming it and a few of the module's names."""
    linears = [n for n, m in module.named_modules() if isinstance(m, (nn.Linear, LoraLinear))]
    inside = {n for n, m in module.named_modules() if isinstance(m, LoraLinear) for n in (f"{n}.lora_A", f"{n}.lora_B")}
    linears = [n for n in linears if n not in inside]
    chosen: list[str] = []
    for pattern in config.targets:
        hits = [n for n in linears if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            shown = ", ".join(linears[:4]) + (", …" if len(linears) > 4 else "") or "none"
            raise TrainingConfigError(
                f"lora.targets: pattern {pattern!r} matches no nn.Linear of {type(module).__name__} (its linear "
                f"layers: {shown})"
            )
        chosen.extend(n for n in hits if n not in chosen)
    return [n for n in linears if n in chosen]  # module order


def check_targets(model_config: Any, config: LoraConfig) -> list[str]:
    """The module names `config.targets` select in shared_model's CausalLM for `model_config`, checked on a
    meta-device build (no memory, no weights): `tandem train` refuses a pattern that matches nothing before it
    reads any data."""
    from shared_model.model import CausalLM

    with torch.device("meta"):
        model = CausalLM(model_config)
    return matched_linears(model, config)


def apply_lora(module: nn.Module, config: LoraConfig) -> list[str]:
    """Wrap the targeted linear layers of `module` in LoraLinear and freeze the rest (see the module contract);
    returns the qualified names of the LoRA layers."""
    if config.base_dtype != "model" and (_under_zero_init() or _is_partitioned(module)):
        raise TrainingConfigError(
            f"lora.base_dtype={config.base_dtype} cannot be used with ZeRO-3 (its partitions keep the training dtype; "
            "trainer.precision=bf16-mixed already holds the frozen base in bf16): use strategy.stage <= 2 or "
            "lora.base_dtype=model"
        )
    names = matched_linears(module, config)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        current = getattr(parent, child)
        if isinstance(current, LoraLinear):
            continue
        setattr(parent, child, LoraLinear(current, config.rank, config.alpha, config.dropout, config.base_dtype))
    trainable_extra = _full_trainables(module, config)
    for pname, param in module.named_parameters():
        lora = ".lora_A." in f".{pname}" or ".lora_B." in f".{pname}"
        param.requires_grad_(lora or pname in trainable_extra)
    return names


def _full_trainables(module: nn.Module, config: LoraConfig) -> set[str]:
    """Parameter names trained in full: the embeddings' and the LM head's weights when asked."""
    names: set[str] = set()
    for mname, m in module.named_modules():
        if config.train_embeddings and isinstance(m, nn.Embedding):
            names.add(f"{mname}.weight" if mname else "weight")
        if config.train_lm_head and isinstance(m, nn.Linear) and mname.split(".")[-1] == "lm_head":
            names.add(f"{mname}.weight")
    return names


def full_module_names(module_names: list[str], config: LoraConfig) -> list[str]:
    """The modules trained in full (PEFT's modules_to_save) among a CausalLM's: `model.embed_tokens`, `lm_head`."""
    out = []
    if config.train_embeddings:
        out += [n for n in module_names if n.endswith("embed_tokens")]
    if config.train_lm_head:
        out += [n for n in module_names if n.split(".")[-1] == "lm_head"]
    return out


def lora_module_names(state: dict[str, torch.Tensor]) -> list[str]:
    """Module names carrying an adapter in a state dict (keys `<module>.lora_A.weight`), in key order."""
    return [k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight")]


def lora_tensors(state: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, in], B [out, r]) of module `name` in a state dict."""
    return state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"]


def dequantized_base(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The frozen weight [out, in] of module `name` (fp32), from `weight` or `weight_int8` + `weight_scale`."""
    if f"{name}.weight" in state:
        return state[f"{name}.weight"].float()
    q, scale = state[f"{name}.weight_int8"], state[f"{name}.weight_scale"]
    return q.float() * scale.float()[:, None]


def merge_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A plain model state dict from a LoRA one: each adapted module's weight = W + scaling·B·A (fp32)."""
    names = lora_module_names(state)
    merged = {k: v for k, v in state.items() if ".lora_A." not in k and ".lora_B." not in k}
    for name in names:
        a, b = lora_tensors(state, name)
        merged.pop(f"{name}.weight_int8", None)
        merged.pop(f"{name}.weight_scale", None)
        merged[f"{name}.weight"] = dequantized_base(state, name) + scaling * (b.float() @ a.float())  # [out, in]
    return merged
