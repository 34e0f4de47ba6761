"""`tandem plan`: which ZeRO stage, offload, precision and checkpointing mode to train with on N GPUs.

Contract: `main(argv) -> exit code`. Reads only the model config (a preset or a model folder), never weights, and
imports neither Lightning nor DeepSpeed. Prints a table (or `--json`): the full-fine-tuning state against one GPU,
the recommendation, every configuration with its per-GPU terms, fit, relative compute and communication and the
limiting term of those that do not fit, and the best choice on 1, 2, 4 and 8 GPUs, each recommendation with the
`tandem train` overrides that apply it (also in `--json`). Exit code 0 when something fits, 1 when nothing does, 2 on
bad arguments (one line on stderr).

Memory sizes need a unit (`80GB` = 80·10⁹ bytes, `80GiB` = 80·2³⁰): a bare number is refused. The table is in
decimal units, GB (or MB when every figure shown is below 1 GB), and says which. `--seq-len` defaults to 4,096
tokens, or the model's max_position_embeddings when that is smaller.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence

from lt_plugins.memory_model import CHECKPOINT_MODES, PRECISIONS, TERMS, Hardware
from lt_plugins.planner import Candidate, Plan, PlanRequest, plan, short
from shared_model.errors import SharedModelError
from shared_model.ledger import (
    DEFAULT_CONTEXT,
    GB,
    TRAINING_BYTES_PER_PARAM,
    decimal_bytes,
    default_context,
    human_count,
    lora_adapter_params,
)
from shared_model.ledger_cli import resolve_model

MB = 10**6

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20}
_UNITS |= {"gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, flag: str = "memory size") -> float:
    """'80GB' → 80e9, '80GiB' → 80·2³⁰, '1.5e9B' → 1.5e9 (decimal units as in the lecture). A unit is required: a
    bare number raises ValueError suggesting `<number>GB`, as does anything else that is not a size > 0."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if m and not m.group(2):
        n = m.group(1)
        raise ValueError(f"{flag} {n} has no unit: write {n}GB (10^9 bytes per GB) or {n}GiB (2^30 bytes per GiB)")
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{flag} {text!r} is not a memory size (examples: 80GB, 141GB, 24GiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{flag} must be > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="preset name or model folder (config.json)")
    p.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs")
    p.add_argument("--gpu-memory", default="80GB", help="memory of one GPU with its unit, e.g. 80GB or 80GiB")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help=f"tokens per sequence; default {DEFAULT_CONTEXT}, or the model's max_position_embeddings if smaller",
    )
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-step")
    p.add_argument(
        "--cpu-memory", default=None, help="host memory per node with its unit, e.g. 512GB (checked if given)"
    )
    p.add_argument("--reserve", type=float, default=0.1, help="share of GPU memory kept free (default 0.1)")
    p.add_argument("--tflops", type=float, default=312.0, help="16-bit dense peak TFLOP/s of one GPU")
    p.add_argument("--interconnect", type=float, default=100.0, help="GB/s per GPU in collectives")
    p.add_argument("--precision", choices=PRECISIONS, action="append", help="only this precision (repeatable)")
    p.add_argument("--checkpointing", choices=CHECKPOINT_MODES, action="append", help="only this mode (repeatable)")
    p.add_argument(
        "--lora",
        choices=("auto", "only", "off"),
        default="auto",
        help="auto: plan LoRA when full fine-tuning fits nothing; only: LoRA alone; off: full fine-tuning alone",
    )
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the LoRA candidates (all seven projections)")
    p.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=0,
        help="the run's model.loss_chunk_tokens (0: unchunked): no [tokens, vocab] log-softmax held, the head's "
        "fp32 weight gradient instead (a saving once a micro-batch holds more tokens than the hidden size)",
    )
    p.add_argument("--top", type=int, default=16, help="rows of the table (0: all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _size(x: float) -> str:
    """One figure outside the table, in decimal units."""
    return decimal_bytes(x)


def _table(headers: list[str], rows: list[list[str]], left: int) -> list[str]:
    """Columns as wide as their widest cell or header (never cut); the first `left` columns left-aligned, the last
    column left-aligned and unpadded, the others right-aligned; two spaces between columns."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    last = len(headers) - 1

    def line(cells: list[str]) -> str:
        out = []
        for i, (cell, w) in enumerate(zip(cells, widths, strict=True)):
            out.append(cell if i == last else cell.ljust(w) if i < left else cell.rjust(w))
        return "  ".join(out).rstrip()

    return [line(headers)] + [line(r) for r in rows]


def _candidate_table(rows: list[Candidate]) -> tuple[str, list[str]]:
    """The unit (GB, or MB when every figure is below 1 GB) and the table lines."""
    biggest = max([c.total for c in rows] + [c.comm_bytes for c in rows] + [0.0])
    unit, size = ("GB", GB) if biggest >= GB else ("MB", MB)
    fastest = min([c.step_s for c in rows if c.step_s > 0] + [1.0])
    digits = min(6, max(2, 2 - math.floor(math.log10(fastest))))  # three significant digits for the fastest
    headers = ["stage", "offload", "precision", "ckpt", "lora", *(short(t) for t in TERMS)]
    headers += ["total", "fits", "compute", f"comm {unit}", "s/step", "limited by"]
    body = [
        [
            str(c.stage),
            c.offload,
            c.precision,
            c.checkpointing,
            "-" if c.lora_rank is None else f"r{c.lora_rank} {c.lora_base}",
            *(f"{c.gpu_bytes[t] / size:.1f}" for t in TERMS),
            f"{c.total / size:.1f}",
            "yes" if c.fits else "no",
            f"{c.compute:.2f}",
            f"{c.comm_bytes / size:.1f}",
            f"{c.step_s:.{digits}f}",
            "" if c.fits else short(c.limiting or ""),
        ]
        for c in rows
    ]
    return unit, _table(headers, body, left=5)


def format_plan(p: Plan, top: int) -> str:
    req, hw = p.request, p.request.hardware
    state = p.num_params * TRAINING_BYTES_PER_PARAM
    lines = [
        f"Training plan: {p.model}, {human_count(p.num_params)} parameters ({p.num_params:,}), {req.gpus} GPU(s) x "
        f"{_size(hw.gpu_memory)} ({_size(hw.usable)} usable), micro-batch {req.micro_batch} x {req.seq_len} tokens",
        f"Full fine-tuning state, mixed-precision AdamW ({TRAINING_BYTES_PER_PARAM} B/param): {_size(state)} "
        + ("> " if state > hw.usable else "<= ")
        + f"{_size(hw.usable)} usable on one GPU"
        + (": it does not fit one GPU without sharding or offload." if state > hw.usable else "."),
        "",
    ]
    best = p.recommended
    if p.lora_fallback:
        adapters = lora_adapter_params_of(p)
        lines.append(
            f"Full fine-tuning does not fit {req.gpus} GPU(s) without offload: planning LoRA (rank {req.lora_rank} on "
            f"all seven projections, {human_count(adapters)} adapter parameters at {TRAINING_BYTES_PER_PARAM} B each, "
            "the base frozen in bf16 or int8)"
            + (": it fits, recommended." if best is not None and best.lora_rank else ": it does not fit either.")
        )
    if best is None:
        lines.append(f"Nothing fits on {req.gpus} GPU(s). See below for more GPUs.")
    else:
        lines += [
            f"Recommended: {best.name}: {_size(best.total)} per GPU, compute x{best.compute:.2f}, "
            f"{_size(best.comm_bytes)} network per step, ~{best.step_s:.3g} s/step (estimate)",
            "  tandem train [--config FILE] " + " ".join(p.overrides(best)),
        ]
    rows = p.candidates if top <= 0 else p.candidates[:top]
    unit, table = _candidate_table(rows)
    lines += [
        "",
        f"Per-GPU {unit} by term (decimal: 1 {unit} = 10^{9 if unit == 'GB' else 6} bytes; activations at their "
        "recompute peak), sorted: fitting by step time first",
        *table,
    ]
    if len(rows) < len(p.candidates):
        lines.append(f"  ... {len(p.candidates) - len(rows)} more (--top 0 shows all)")
    lines += ["", "Best choice by GPU count, with the tandem train overrides that apply it:"]
    for g, c in p.scaling.items():
        if c is None:
            lines.append(f"  {g:>2} GPU(s): nothing fits")
        else:
            lines += [f"  {g:>2} GPU(s): {c.name} ({_size(c.total)}/GPU)", "             " + " ".join(p.overrides(c))]
    lines += [
        "",
        f"Estimates assume {hw.bf16_tflops:.0f} TFLOP/s 16-bit peak at {hw.mfu:.0%} MFU (fp32 at half), "
        f"{hw.interconnect_gbps:.0f} GB/s collectives, {hw.pcie_gbps:.0f} GB/s PCIe; compute = FLOPs with recompute"
        " / without. Grads are counted in fp32 as in the lecture (DeepSpeed holds 16-bit grads plus an fp32 shard"
        " at the step).",
    ]
    return "\n".join(lines)


def lora_adapter_params_of(p: Plan) -> int:
    from shared_model.ledger_cli import resolve_model as _resolve

    return lora_adapter_params(_resolve(p.model)[0], p.request.lora_rank) if p.model else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        gpu_memory = parse_bytes(args.gpu_memory, "--gpu-memory")
        cpu_memory = None if args.cpu_memory is None else parse_bytes(args.cpu_memory, "--cpu-memory")
        config, name, _ = resolve_model(args.model)
        hw = Hardware(
            gpu_memory=gpu_memory,
            bf16_tflops=args.tflops,
            interconnect_gbps=args.interconnect,
            reserve=args.reserve,
        )
        request = PlanRequest(
            gpus=args.gpus,
            micro_batch=args.micro_batch,
            seq_len=default_context(config) if args.seq_len is None else args.seq_len,
            hardware=hw,
            cpu_memory=cpu_memory,
            precisions=tuple(args.precision or PRECISIONS),
            modes=tuple(args.checkpointing or CHECKPOINT_MODES),
            lora=args.lora,
            lora_rank=args.lora_rank,
            loss_chunk_tokens=args.loss_chunk_tokens,
        )
        result = plan(config, request, model_name=name)
    except (SharedModelError, ValueError) as exc:
        print(f"tandem plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(format_plan(result, args.top))
    return 0 if result.recommended is not None else 1


if __name__ == "__main__":
    sys.exit(main())
