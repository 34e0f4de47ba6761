"""`tandem ledger`: print the memory ledger of a preset or a model folder, as a table or as JSON.

Contract: reads only the config (never the weights), so it runs on any machine for any model size.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from shared_model.config import PRESETS, ModelConfig
from shared_model.errors import SharedModelError
from shared_model.ledger import (
    BYTES_PER_ELEMENT,
    DEFAULT_GROUP_SIZE,
    INT4_GROUP_SIZES,
    QUANTIZATIONS,
    format_report,
    ledger_report,
)


def resolve_model(spec: str) -> tuple[ModelConfig, str, float | None]:
    """A preset name or a model folder → (config, display name, nominal parameter count)."""
    if spec in PRESETS:
        preset = PRESETS[spec]
        return preset.config, spec, preset.nominal_params
    path = Path(spec)
    if path.is_dir():
        from shared_model.bundle import read_config

        return read_config(path), str(path), None
    raise SharedModelError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a folder")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem ledger", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="preset name or model folder")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence (L)")
    p.add_argument("--batch", type=int, default=1, help="sequences held at once (B)")
    p.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs (N for ZeRO)")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--kv-dtype", default="bf16", choices=sorted(BYTES_PER_ELEMENT))
    p.add_argument("--weight-dtype", default="bf16", choices=sorted(BYTES_PER_ELEMENT))
    p.add_argument(
        "--quantization", default="none", choices=QUANTIZATIONS, help="weight-only quantization, as `tandem serve`"
    )
    p.add_argument("--quantization-group-size", type=int, default=DEFAULT_GROUP_SIZE, choices=INT4_GROUP_SIZES)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config, name, nominal = resolve_model(args.model)
        report = ledger_report(
            config,
            name,
            nominal_params=nominal,
            context=args.context,
            batch=args.batch,
            gpus=args.gpus,
            zero_stage=args.zero_stage,
            kv_dtype=args.kv_dtype,
            weight_dtype=args.weight_dtype,
            quantization=args.quantization,
            group_size=args.quantization_group_size,
        )
    except (SharedModelError, ValueError) as exc:
        print(f"tandem ledger: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report, args.context, args.batch))
    return 0
