"""`tandem ledger`: print the memory ledger of a preset or a model folder, as a table or as JSON.

Contract: reads only the config (never the weights, and without importing torch), so it runs on any machine for any
model size. `--model` is a preset name first, else a folder holding a config.json. Defaults:
- context: 4,096 tokens, or the model's max_position_embeddings when that is smaller (presets and folders alike);
- weight dtype: a folder's own `torch_dtype` (or `dtype`) from config.json, else bf16; K/V dtype: the weight dtype
  (the engine's `--kv-cache-dtype auto`); `--kv-dtype fp8|int8` adds their per-(block, kv head) fp32 scales, in
  blocks of `--kv-block-size` tokens (the engine's `--block-size`), by `shared_model.ledger.kv_bytes_per_block`.
`--draft MODEL` (a preset or folder) adds speculative decoding's draft model: its weights, its K/V per token in the
same K/V dtype, and the target + draft K/V the engine sizes its pool by (a draft's K/V shares the KV budget).
The table is in decimal units (kB, MB, GB) throughout.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shared_model.config import PRESETS, ModelConfig
from shared_model.errors import BundleError, ConfigError, SharedModelError
from shared_model.ledger import (
    BYTES_PER_ELEMENT,
    DEFAULT_CONTEXT,
    DEFAULT_GROUP_SIZE,
    INT4_GROUP_SIZES,
    KV_BLOCK_SIZE,
    QUANTIZATIONS,
    LedgerReport,
    decimal_bytes,
    format_report,
    ledger_report,
)

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ModelSpec:
    """What `--model` names: its config, display name, model-card parameter count (presets) and, for a folder,
    the dtype its config.json declares (torch_dtype, or dtype in the transformers 5 layout)."""

    config: ModelConfig
    name: str
    nominal_params: float | None = None
    folder_dtype: str | None = None
    is_folder: bool = False


def _read_folder_config(folder: Path) -> tuple[ModelConfig, str | None]:
    """config.json of a folder → (config, declared dtype); the same errors as `bundle.read_config`, without torch."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise BundleError(f"missing file: {path}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise BundleError(f"{path} must hold a JSON object")
    try:
        config = ModelConfig.from_hf_dict(raw)
    except ConfigError as exc:
        raise BundleError(f"{path}: {exc}") from exc
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    return config, dtype if isinstance(dtype, str) else None


def resolve_spec(spec: str) -> ModelSpec:
    """A preset name, else a model folder (config.json); anything else is an error naming both."""
    if spec in PRESETS:
        preset = PRESETS[spec]
        return ModelSpec(preset.config, spec, preset.nominal_params)
    path = Path(spec)
    if path.is_dir():
        config, dtype = _read_folder_config(path)
        return ModelSpec(config, str(path), None, dtype, is_folder=True)
    raise SharedModelError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a folder")


def resolve_model(spec: str) -> tuple[ModelConfig, str, float | None]:
    """A preset name or a model folder → (config, display name, nominal parameter count)."""
    m = resolve_spec(spec)
    return m.config, m.name, m.nominal_params


def default_weight_dtype(m: ModelSpec) -> tuple[str, str]:
    """(dtype, where it comes from): a folder's declared dtype when the ledger knows it, else bf16."""
    if m.folder_dtype is not None and m.folder_dtype in BYTES_PER_ELEMENT:
        return m.folder_dtype, f"{CONFIG_FILE} torch_dtype"
    return "bf16", "default"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem ledger", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="preset name or model folder")
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help=f"tokens per sequence (L); default {DEFAULT_CONTEXT}, or the model's max_position_embeddings if smaller",
    )
    p.add_argument("--batch", type=int, default=1, help="sequences held at once (B)")
    p.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs (N for ZeRO)")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument(
        "--kv-dtype", default=None, choices=sorted(BYTES_PER_ELEMENT), help="K/V cache dtype; default: the weight dtype"
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=KV_BLOCK_SIZE,
        help="tokens per K/V block (fp8/int8 keep a scale per block)",
    )
    p.add_argument(
        "--weight-dtype",
        default=None,
        choices=sorted(BYTES_PER_ELEMENT),
        help="default: a model folder's torch_dtype (config.json), else bf16",
    )
    p.add_argument(
        "--quantization", default="none", choices=QUANTIZATIONS, help="weight-only quantization, as `tandem serve`"
    )
    p.add_argument("--quantization-group-size", type=int, default=DEFAULT_GROUP_SIZE, choices=INT4_GROUP_SIZES)
    p.add_argument(
        "--draft", default=None, help="speculative decoding's draft model (preset or folder): its share of the memory"
    )
    p.add_argument(
        "--lora-rank", type=int, default=None, help="also the LoRA training state at this rank (all projections)"
    )
    p.add_argument(
        "--lora-base-dtype", default="bf16", choices=("bf16", "int8", "fp32"), help="frozen base weights under LoRA"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        m = resolve_spec(args.model)
        if args.weight_dtype is None:
            weight_dtype, source = default_weight_dtype(m)
        else:
            weight_dtype, source = args.weight_dtype, "--weight-dtype"
        report = ledger_report(
            m.config,
            m.name,
            nominal_params=m.nominal_params,
            context=args.context,
            batch=args.batch,
            gpus=args.gpus,
            zero_stage=args.zero_stage,
            kv_dtype=args.kv_dtype or weight_dtype,
            weight_dtype=weight_dtype,
            quantization=args.quantization,
            group_size=args.quantization_group_size,
            weight_dtype_source=source,
            kv_block_size=args.kv_block_size,
            lora_rank=args.lora_rank,
            lora_base_dtype=args.lora_base_dtype,
        )
        draft = None
        if args.draft is not None:
            d = resolve_spec(args.draft)
            draft_dtype = default_weight_dtype(d)[0] if args.weight_dtype is None else args.weight_dtype
            draft = ledger_report(
                d.config, d.name, nominal_params=d.nominal_params, context=report.context, batch=args.batch,
                kv_dtype=report.kv_dtype, weight_dtype=draft_dtype, quantization=args.quantization,
                group_size=args.quantization_group_size, kv_block_size=args.kv_block_size,
            )  # fmt: skip
    except (SharedModelError, ValueError) as exc:
        print(f"tandem ledger: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = report.to_dict()
        if draft is not None:
            out["draft"] = _draft_figures(report, draft)
        print(json.dumps(out, indent=2))
    else:
        print(format_report(report) + ("" if draft is None else "\n\n" + _format_draft(report, draft)))
    return 0


def _draft_figures(target: LedgerReport, draft: LedgerReport) -> dict[str, float | str]:
    t, d = target.kv_cache, draft.kv_cache
    return {
        "model": draft.model,
        "served_weight_bytes": draft.inference["served_weight_bytes"],
        "kv_bytes_per_token": d["bytes_per_token"],
        "kv_bytes": d["bytes"],
        "total_kv_bytes_per_token": t["bytes_per_token"] + d["bytes_per_token"],
        "total_kv_bytes": t["bytes"] + d["bytes"],
        "capacity_vs_target_alone": t["bytes_per_token"] / (t["bytes_per_token"] + d["bytes_per_token"]),
    }


def _format_draft(target: LedgerReport, draft: LedgerReport) -> str:
    f = _draft_figures(target, draft)
    rows = [
        (f"draft weights as served ({draft.weight_dtype}, {draft.quantization})", f["served_weight_bytes"]),
        (f"draft K/V per token ({draft.kv_dtype})", f["kv_bytes_per_token"]),
        ("K/V per token, target + draft", f["total_kv_bytes_per_token"]),
        (f"K/V cache, target + draft (B={target.batch}, L={target.context})", f["total_kv_bytes"]),
    ]
    width = max(46, *(len(label) + 2 for label, _ in rows))
    lines = [f"Speculative decoding with the draft model {draft.model} (its K/V shares the KV budget)"]
    lines += [f"  {label:<{width}}{decimal_bytes(float(x)):>12}" for label, x in rows]
    lines.append(f"  tokens a KV budget holds, vs the target alone  {f['capacity_vs_target_alone']:.2f}x")
    return "\n".join(lines)
