"""Reading a LoRA adapter folder in PEFT's format and checking it against the served model.

Contract:
- `load_adapter(name, path, config, max_rank)` reads `adapter_config.json` and `adapter_model.safetensors` (PEFT's
  `save_pretrained` layout, and what `tandem export --adapter` writes: `lt_plugins.export.adapter`) and returns a
  `LoraAdapter`: per (layer, projection) the pair A [r, in] and B [out, r] (fp32, on the CPU) and the one scale
  (`lora_alpha / r`, or `lora_alpha / sqrt(r)` under `use_rslora`).
- Everything wrong is refused before any tensor reaches a slot, as one `AdapterError` line naming the field: the
  folder or a file missing (`lora_path`), not a LoRA adapter (`peft_type`), a rank above `--max-lora-rank` (`r`),
  a target that is not one of the served model's projections, or a layer it does not have (`target_modules`),
  PEFT features this server does not apply (`use_dora`, `bias`, `modules_to_save`, `rank_pattern`,
  `alpha_pattern`, `fan_in_fan_out`), and a tensor whose shape does not fit the served model (`base_model`: the
  adapter was trained on another base).
- The projections an adapter may target are the seven of every decoder layer (`PROJECTIONS`: q/k/v/o of
  attention, gate/up/down of the MLP); the embeddings and the LM head are not adapted when serving.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from inference_svc.errors import InvalidRequestError
from shared_model.config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections of a decoder layer an adapter may target (Hugging Face's module names)."""
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight"
)
_UNSUPPORTED = {
    "use_dora": "DoRA adapters are not served",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters are not served",
    "rank_pattern": "per-module ranks are not served",
    "alpha_pattern": "per-module alphas are not served",
    "modules_to_save": "fully trained modules are not served (merge the adapter into a bundle instead)",
    "lora_bias": "adapter biases are not served",
}


class AdapterError(InvalidRequestError):
    """An adapter folder this server cannot serve; `field` names what is wrong (see the module docstring)."""


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter: its weights per (layer, projection) and its scale."""

    name: str
    path: Path
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    """(layer, projection name) → (A [r, in], B [out, r]) fp32."""
    base_model: str | None
    """`base_model_name_or_path` as the adapter records it (for reporting only; shapes decide the match)."""


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection's (out, in) in the served model."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
        "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter),
    }  # fmt: skip


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """The adapter at `path`, checked against the served model (see the module docstring)."""
    folder = Path(path)
    where = f"adapter {name!r} ({folder})"
    if not folder.is_dir():
        raise AdapterError("lora_path", f"{folder} is not a folder")
    cfg = _read_config(folder, where)
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError("peft_type", f"{where} is a {cfg.get('peft_type')} adapter; only LORA is served")
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError("r", f"{where} has r={rank!r}; it must be an integer >= 1")
    if rank > max_rank:
        raise AdapterError("r", f"{where} has rank {rank}, above --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError("lora_alpha", f"{where} has lora_alpha={alpha!r}; it must be a number > 0")
    for key, why in _UNSUPPORTED.items():
        if cfg.get(key):
            raise AdapterError(key, f"{where}: {why} ({key}={cfg[key]!r})")
    if cfg.get("bias", "none") != "none":
        raise AdapterError("bias", f"{where}: adapter biases are not served (bias={cfg['bias']!r})")
    _check_targets(cfg.get("target_modules"), where)
    weights = _read_weights(folder, where, config, rank)
    if not weights:
        raise AdapterError("target_modules", f"{where} holds no lora_A/lora_B tensor of a decoder projection")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return LoraAdapter(name, folder.resolve(), rank, float(scaling), weights, cfg.get("base_model_name_or_path"))


def _read_config(folder: Path, where: str) -> dict:
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterError("lora_path", f"{where} has no {ADAPTER_CONFIG}")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError("lora_path", f"{where}: {ADAPTER_CONFIG} is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise AdapterError("lora_path", f"{where}: {ADAPTER_CONFIG} is not a JSON object")
    return cfg


def _check_targets(targets: object, where: str) -> None:
    """`target_modules` as PEFT writes it: a list of module names (each matched as a name suffix), or a regex."""
    if targets is None:
        return  # the tensors decide (checked one by one)
    if isinstance(targets, str):
        names = [f"model.layers.0.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}" for p in PROJECTIONS]
        try:
            matched = any(re.fullmatch(targets, n) for n in names)  # PEFT matches a string as a regex
        except re.error:
            matched = False
        if not matched:
            raise AdapterError("target_modules", f"{where}: the pattern {targets!r} names no projection of the model")
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError("target_modules", f"{where}: expected a list of module names, got {targets!r}")
    missing = sorted({t for t in targets if t.rsplit(".", 1)[-1] not in PROJECTIONS})
    if missing:
        raise AdapterError(
            "target_modules",
            f"{where} targets {', '.join(missing)}: not a projection of the served model "
            f"(it has {', '.join(PROJECTIONS)})",
        )


def _read_weights(
    folder: Path, where: str, config: ModelConfig, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        raise AdapterError("lora_path", f"{where} has no {ADAPTER_WEIGHTS}")
    try:
        tensors = load_file(str(path), device="cpu")
    except (OSError, SafetensorError) as exc:
        raise AdapterError("lora_path", f"{where}: {ADAPTER_WEIGHTS} is not readable ({exc})") from None
    shapes = projection_shapes(config)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise AdapterError("target_modules", f"{where} holds {key}: not a LoRA tensor of a decoder projection")
        layer, proj, part = int(m.group(1)), m.group(2), m.group(3)
        if proj not in PROJECTIONS:
            raise AdapterError("target_modules", f"{where} adapts {proj}: not a projection of the served model ({key})")
        if layer >= config.num_layers:
            raise AdapterError(
                "base_model", f"{where} adapts layer {layer}; the served model has {config.num_layers} layers"
            )
        parts.setdefault((layer, proj), {})[part] = tensor
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), ab in sorted(parts.items()):
        name = f"model.layers.{layer}.{proj}"
        if set(ab) != {"A", "B"}:
            raise AdapterError("lora_path", f"{where} has lora_{''.join(ab)} but not both A and B for {name}")
        a, b = ab["A"], ab["B"]
        want_out, want_in = shapes[proj]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError("r", f"{where}: {name} has A {list(a.shape)} and B {list(b.shape)}, not rank r={rank}")
        if a.shape[1] != want_in or b.shape[0] != want_out:
            raise AdapterError(
                "base_model",
                f"{where}: {name} maps {a.shape[1]} -> {b.shape[0]} features; the served model's {proj} maps "
                f"{want_in} -> {want_out} (the adapter was trained on another base model)",
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError("lora_path", f"{where}: {name} holds non-finite values")
        out[(layer, proj)] = (a.float().contiguous(), b.float().contiguous())
    return out
