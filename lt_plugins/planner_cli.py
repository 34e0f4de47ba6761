"""`tandem plan`: which ZeRO stage, offload, precision and checkpointing mode to train with on N GPUs.

Contract: `main(argv) -> exit code`. Reads only the model config (a preset or a model folder), never weights, and
imports neither Lightning nor DeepSpeed. Prints a table (or `--json`): the full-fine-tuning state against one GPU,
the recommendation, every configuration with its per-GPU terms, fit, relative compute and communication and the
limiting term of those that do not fit, and the best choice on 1, 2, 4 and 8 GPUs. Exit code 0 when something
fits, 1 when nothing does, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence

from lt_plugins.memory_model import CHECKPOINT_MODES, PRECISIONS, TERMS, Hardware
from lt_plugins.planner import Candidate, Plan, PlanRequest, plan, short
from shared_model.errors import SharedModelError
from shared_model.ledger import GB, TRAINING_BYTES_PER_PARAM
from shared_model.ledger_cli import resolve_model

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20}
_UNITS |= {"gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """'80GB' → 80e9, '80GiB' → 80·2³⁰, '8e10' → 8e10 (decimal units as in the lecture)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (examples: 80GB, 141GB, 24GiB)")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="preset name or model folder (config.json)")
    p.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs")
    p.add_argument("--gpu-memory", type=parse_bytes, default=80e9, help="memory of one GPU, e.g. 80GB")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-step")
    p.add_argument("--cpu-memory", type=parse_bytes, default=None, help="host memory per node (checked if given)")
    p.add_argument("--reserve", type=float, default=0.1, help="share of GPU memory kept free (default 0.1)")
    p.add_argument("--tflops", type=float, default=312.0, help="16-bit dense peak TFLOP/s of one GPU")
    p.add_argument("--interconnect", type=float, default=100.0, help="GB/s per GPU in collectives")
    p.add_argument("--precision", choices=PRECISIONS, action="append", help="only this precision (repeatable)")
    p.add_argument("--checkpointing", choices=CHECKPOINT_MODES, action="append", help="only this mode (repeatable)")
    p.add_argument("--top", type=int, default=16, help="rows of the table (0: all)")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def _row(c: Candidate) -> str:
    terms = "".join(f"{_gb(c.gpu_bytes[t]):>9}" for t in TERMS)
    fits = "yes" if c.fits else "no"
    why = "" if c.fits else f"  {short(c.limiting or '')}"
    return (
        f"{c.stage:>5} {c.offload:>10} {c.precision:>10} {c.checkpointing:>9}{terms}{_gb(c.total):>9}{fits:>5}"
        f"{c.compute:>8.2f}{_gb(c.comm_bytes):>8}{c.step_s:>8.2f}{why}"
    )


def format_plan(p: Plan, top: int) -> str:
    req, hw = p.request, p.request.hardware
    state = p.num_params * TRAINING_BYTES_PER_PARAM
    lines = [
        f"Training plan: {p.model}, {p.num_params / 1e9:.2f}B parameters, {req.gpus} GPU(s) x "
        f"{hw.gpu_memory / GB:.0f} GB ({hw.usable / GB:.1f} GB usable), micro-batch {req.micro_batch} x "
        f"{req.seq_len} tokens",
        f"Full fine-tuning state, mixed-precision AdamW ({TRAINING_BYTES_PER_PARAM} B/param): {state / GB:.1f} GB "
        + ("> " if state > hw.usable else "<= ")
        + f"{hw.usable / GB:.1f} GB usable on one GPU"
        + (": it does not fit one GPU without sharding or offload." if state > hw.usable else "."),
        "",
    ]
    best = p.recommended
    if best is None:
        lines.append(f"Nothing fits on {req.gpus} GPU(s). See below for more GPUs.")
    else:
        lines.append(
            f"Recommended: {best.name}: {_gb(best.total)} GB per GPU, compute x{best.compute:.2f}, "
            f"{_gb(best.comm_bytes)} GB network per step, ~{best.step_s:.2f} s/step (estimate)"
        )
    header = f"{'stage':>5} {'offload':>10} {'precision':>10} {'ckpt':>9}"
    header += "".join(f"{short(t)[:8]:>9}" for t in TERMS)
    header += f"{'total':>9}{'fits':>5}{'compute':>8}{'commGB':>8}{'s/step':>8}  limited by"
    rows = p.candidates if top <= 0 else p.candidates[:top]
    lines += [
        "",
        "Per-GPU GB by term (activations at their recompute peak), sorted: fitting by step time first",
        header,
    ]
    lines += [_row(c) for c in rows]
    if len(rows) < len(p.candidates):
        lines.append(f"  ... {len(p.candidates) - len(rows)} more (--top 0 shows all)")
    lines += ["", "Best choice by GPU count:"]
    for g, c in p.scaling.items():
        lines.append(f"  {g:>2} GPU(s): " + ("nothing fits" if c is None else f"{c.name} ({_gb(c.total)} GB/GPU)"))
    lines += [
        "",
        f"Estimates assume {hw.bf16_tflops:.0f} TFLOP/s 16-bit peak at {hw.mfu:.0%} MFU (fp32 at half), "
        f"{hw.interconnect_gbps:.0f} GB/s collectives, {hw.pcie_gbps:.0f} GB/s PCIe; compute = FLOPs with recompute"
        " / without. Grads are counted in fp32 as in the lecture (DeepSpeed holds 16-bit grads plus an fp32 shard"
        " at the step).",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config, name, _ = resolve_model(args.model)
        hw = Hardware(
            gpu_memory=args.gpu_memory,
            bf16_tflops=args.tflops,
            interconnect_gbps=args.interconnect,
            reserve=args.reserve,
        )
        request = PlanRequest(
            gpus=args.gpus,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            hardware=hw,
            cpu_memory=args.cpu_memory,
            precisions=tuple(args.precision or PRECISIONS),
            modes=tuple(args.checkpointing or CHECKPOINT_MODES),
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
