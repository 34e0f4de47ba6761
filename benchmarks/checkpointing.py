"""Activation checkpointing modes on the `small` preset: saved bytes, extra FLOPs and step time against `none`.

Usage: python benchmarks/checkpointing.py [--seq-len 256] [--batch 1] [--dtype fp32] [--attention fused|math]
                                          [--repeats 3] [--out benchmarks/checkpointing.json]
One row per mode: bytes saved for backward (SavedActivationMeter: all of them, and the decoder layers alone), the
memory_model formula beside them, recomputed FLOPs in % of the step without checkpointing (flop_counter), and the
median fwd+bwd time as a ratio to `none`, modes interleaved in a rotating order (the machine is noisy). Then the
Megatron theory (Korthikanti et al. 2022) for the same shape, and JSON to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lt_plugins.activation_meter import SavedActivationMeter, flop_counter
from lt_plugins.checkpointing import MODES, CheckpointingConfig, apply_checkpointing, remove_checkpointing
from lt_plugins.memory_model import activation_bytes, head_saved_bytes_per_token
from shared_model.config import get_preset
from shared_model.model import build_model


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())


def _attention_ctx(kind: str) -> contextlib.AbstractContextManager:
    return sdpa_kernel(SDPBackend.MATH) if kind == "math" else contextlib.nullcontext()


def measure(model: torch.nn.Module, ids: torch.Tensor, mode: str, attention: str) -> dict[str, float]:
    apply_checkpointing(model, CheckpointingConfig(mode=mode))
    with _attention_ctx(attention):
        with SavedActivationMeter(exclude=model.parameters()) as meter:
            loss = _loss(model, ids)
        saved = meter.bytes
        del loss
        with flop_counter() as counter:
            _loss(model, ids).backward()
        model.zero_grad(set_to_none=True)
    return {"saved": saved, "flops": counter.get_total_flops()}


def time_step(model: torch.nn.Module, ids: torch.Tensor, mode: str, attention: str) -> float:
    apply_checkpointing(model, CheckpointingConfig(mode=mode))
    with _attention_ctx(attention):
        start = time.perf_counter()
        _loss(model, ids).backward()
        elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def megatron_theory(h: int, heads: int, s: int) -> dict[str, float]:
    """Korthikanti et al. (2022), 16-bit activations per layer per token, no tensor/sequence parallelism:
    none 34h + 5·a·s, selective (core attention recomputed) 34h, full 2h (the layer input)."""
    none = 34 * h + 5 * heads * s
    return {"none": none, "attention": 34 * h, "full": 2 * h}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32", help="CPUs without bf16 matmul: fp32")
    parser.add_argument("--attention", choices=("fused", "math"), default="fused")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per mode (0: bytes and FLOPs only)")
    parser.add_argument("--out", default="benchmarks/checkpointing.json")
    args = parser.parse_args()

    config = get_preset(args.preset)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    b = 2 if args.dtype == "bf16" else 4
    model = build_model(config, dtype=dtype)
    ids = torch.randint(
        0, config.vocab_size, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    tokens = args.batch * args.seq_len
    head = tokens * head_saved_bytes_per_token(config, b)

    rows = {mode: measure(model, ids, mode, args.attention) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    if args.repeats:
        for mode in MODES:  # warm-up: allocator and kernels, once per mode
            time_step(model, ids, mode, args.attention)
    for rep in range(args.repeats):
        for mode in MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]:  # rotate the order: no mode always first
            times[mode].append(time_step(model, ids, mode, args.attention))
    remove_checkpointing(model)

    base = rows["none"]
    theory = megatron_theory(config.hidden_size, config.num_heads, args.seq_len)
    prec = "bf16-mixed" if b == 2 else "32-true"
    header = (
        f"{'mode':<10}{'saved MB':>10}{'vs none':>9}{'layers MB':>11}{'vs none':>9}{'formula MB':>12}"
        f"{'extra FLOPs':>13}{'step ratio':>12}{'Megatron':>10}"
    )
    print(
        f"{args.preset}: batch {args.batch} x {args.seq_len} tokens, {args.dtype}, {args.attention} attention, "
        f"median of {args.repeats}"
    )
    print(header)
    result_rows = []
    for mode in MODES:
        r = rows[mode]
        layers = r["saved"] - head
        formula = activation_bytes(config, args.batch, args.seq_len, mode, prec)["saved"]
        extra = (r["flops"] - base["flops"]) / base["flops"]
        step_s = statistics.median(times[mode]) if times[mode] else None
        ratio = None if step_s is None else step_s / statistics.median(times["none"])
        meg = theory.get(mode)
        meg_ratio = None if meg is None else meg / theory["none"]
        row = {
            "mode": mode,
            "saved_bytes": r["saved"],
            "saved_vs_none": r["saved"] / base["saved"],
            "layer_bytes": layers,
            "layer_vs_none": layers / (base["saved"] - head),
            "formula_bytes": formula,
            "extra_flops": extra,
            "step_time_s": step_s,
            "step_ratio": ratio,
            "megatron_layer_ratio": meg_ratio,
        }
        result_rows.append(row)
        shown = "-" if ratio is None else f"{ratio:.2f}"
        print(
            f"{mode:<10}{r['saved'] / 1e6:>10.1f}{row['saved_vs_none']:>9.2f}{layers / 1e6:>11.1f}"
            f"{row['layer_vs_none']:>9.2f}{formula / 1e6:>12.1f}{extra:>12.1%}{shown:>12}"
            f"{'-' if meg_ratio is None else format(meg_ratio, '.2f'):>10}"
        )
    print(
        f"Megatron theory at s={args.seq_len}, h={config.hidden_size}, a={config.num_heads} (16-bit, per layer): "
        f"none {theory['none']} B/token, selective {theory['attention']} ({theory['attention'] / theory['none']:.2f}), "
        f"full {theory['full']} ({theory['full'] / theory['none']:.3f}); the 5as term is the score matrices a fused "
        "attention kernel never stores."
    )
    meta = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__}".strip(),
        "threads": torch.get_num_threads(),
        "args": vars(args),
        "megatron": theory,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**meta, "rows": result_rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
