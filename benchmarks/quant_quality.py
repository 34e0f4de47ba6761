"""Quality of weight-only quantization: held-out perplexity of a model trained by `tandem train`, dense vs int8 vs int4.

What it does:
  1. Takes a bundle exported by `tandem train` (`--bundle DIR`), or trains one first: `tandem train --config
     configs/tiny-cpu.yaml` for `--steps N` on `--max-documents` of the default corpus (random weights say
     nothing about quality, so it never measures an untrained model).
  2. Scores the validation split of the training corpus (the documents `tandem train` held out) in windows of
     `--window` tokens: the model in bf16 with dense weights, then the same model with `quantize_weights(..., int8)`
     and `(..., int4)`, exactly as `tandem serve --quantization` prepares it.
  3. Scores int8 and int4 again with every layer's activation rows rounded as a decode step rounds them on a CPU
     with AVX-512 VNNI (`shared_model.int8_gemv`: int8 in groups of up to 256 inputs; `shared_model.int4_gemv`:
     int8 in the weight's groups).
     A window scored at once sees each row as decoding would see it token by token; the plain scoring runs the
     multi-row path, which does not round activations.
  4. Prints each perplexity and its ratio to dense bf16 against the goals (int8 within 0.5%, int4 within 3%),
     and writes JSON (`--out`).

    .venv/bin/python benchmarks/quant_quality.py --steps 400 --out results/quant_quality.json
    .venv/bin/python benchmarks/quant_quality.py --bundle runs/<run>/bundle
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shared_model import int4_gemv, int8_gemv
from shared_model.bundle import load_bundle
from shared_model.corpus import CorpusConfig, load_corpus
from shared_model.quantize import QuantizedLinear, dequantize_int8, quantize_weights, serving_weight_bytes

REPO = Path(__file__).resolve().parents[1]
GOALS = {"int8": 0.005, "int4": 0.03}
CASES = ("int8", "int4", "int8-decode", "int4-decode")


def train(steps: int, max_documents: int) -> Path:
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(REPO / "configs" / "tiny-cpu.yaml")]
    cmd += [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", f"checkpoints.every_n_steps={steps}"]
    cmd += [f"data.max_documents={max_documents}", "data.batch_size=8", "optim.warmup_steps=20"]
    cmd += ["trainer.precision=32-true"]  # fp32 training; the scoring below runs the model in bf16
    cmd += ["run_name=quant-quality"]
    print("training:", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    bundles = [line.removeprefix("bundle: ").strip() for line in out.stdout.splitlines() if line.startswith("bundle: ")]
    if out.returncode != 0 or not bundles:
        raise SystemExit(f"quant_quality: training failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    print(f"trained {steps} steps in {time.perf_counter() - t0:.0f} s: {bundles[-1]}", flush=True)
    return Path(bundles[-1])


def held_out_ids(bundle: Path, max_documents: int, limit: int) -> torch.Tensor:
    """Token ids of the validation documents of the corpus `tandem train` used, up to `limit` tokens."""
    tokenizer = load_bundle(bundle).tokenizer
    assert tokenizer is not None
    corpus = load_corpus(CorpusConfig(max_documents=max_documents))
    ids: list[int] = []
    for text in corpus.texts("val"):
        ids += tokenizer.encode(text)
        if len(ids) >= limit:
            break
    return torch.tensor(ids[:limit])


class RowRounded(torch.nn.Module):
    """A `QuantizedLinear` computed as its row kernel computes a decode row, for every row: the activation rounded
    to int8 per group (`int8_gemv`: groups of up to 256 inputs; `int4_gemv`: the weight's groups), times the exact
    dequantized weight, in fp32."""

    def __init__(self, layer: QuantizedLinear) -> None:
        super().__init__()
        self.layer = layer
        if layer.kind == "int8":
            self.group = int8_gemv.activation_group(layer.in_features)
            assert self.group is not None, "rows not a multiple of 64: the kernel would not run on this layer"
            self.weight = dequantize_int8(layer.qweight, layer.scales, layer.dtype)  # fp32 [N, K]
        else:
            assert layer._row_kernel, "this int4 layer keeps torch's kernel, which does not round activations"
            self.group = layer.group_size
            self.weight = int4_gemv.dequantize(layer.qweight, layer.scales_and_zeros, layer.group_size)  # fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(self.layer.dtype).float()  # [M, K]
        xq = int8_gemv.quantize_activation(x2.reshape(-1), self.group).view_as(x2)  # groups never span rows
        y = F.linear(xq, self.weight).to(self.layer.dtype)
        if self.layer.bias is not None:
            y = y + self.layer.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def round_decode_rows(model: torch.nn.Module) -> torch.nn.Module:
    """Every layer of a `quantize_weights` model whose decode rows a row kernel runs, wrapped in `RowRounded` (in
    place): the int8 ones, and the int4 ones where `int4_gemv` runs."""

    def wrap(layer: torch.nn.Module) -> torch.nn.Module:
        rounded = isinstance(layer, QuantizedLinear) and (layer.kind == "int8" or layer._row_kernel)
        return RowRounded(layer) if rounded else layer

    for block in model.layers:
        for name in ("qkv", "o_proj", "gate_up", "down_proj"):
            setattr(block, name, wrap(getattr(block, name)))
    model.lm_head = wrap(model.lm_head)
    return model


@torch.inference_mode()
def perplexity(model: torch.nn.Module, ids: torch.Tensor, window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        logits = model(chunk[:-1][None])[0].float()  # [T, vocab]
        nll += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=None, help="a bundle exported by tandem train (default: train one)")
    p.add_argument("--steps", type=int, default=400, help="training steps when no --bundle is given")
    p.add_argument("--max-documents", type=int, default=300, help="the corpus size the run was trained on")
    p.add_argument("--tokens", type=int, default=32768, help="held-out tokens scored")
    p.add_argument("--window", type=int, default=256, help="tokens per scored window")
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = p.parse_args(argv)
    bundle = args.bundle or train(args.steps, args.max_documents)
    ids = held_out_ids(bundle, args.max_documents, args.tokens)
    results: dict = {"bundle": str(bundle), "held_out_tokens": len(ids), "window": args.window}
    for case in ("none", "int8", "int4", "int8-decode", "int4-decode"):
        kind = case.removesuffix("-decode")
        model = quantize_weights(load_bundle(bundle, dtype=torch.bfloat16).model, kind)  # "none": merged only
        if case.endswith("-decode"):
            round_decode_rows(model)
        t0 = time.perf_counter()
        ppl = perplexity(model, ids, args.window)
        results[case] = {"perplexity": ppl, "weight_bytes": serving_weight_bytes(model)}
        results[case]["seconds"] = time.perf_counter() - t0
    dense = results["none"]["perplexity"]
    print(f"held-out perplexity over {len(ids)} tokens (windows of {args.window}), bf16 activations:")
    print(f"  dense bf16  {dense:9.3f}   weights {results['none']['weight_bytes'] / 1e6:7.1f} MB")
    for kind, goal in [(case, GOALS[case.removesuffix("-decode")]) for case in results if case in CASES]:
        r = results[kind]
        r["ratio_to_dense"] = r["perplexity"] / dense
        r["goal_met"] = r["ratio_to_dense"] - 1 <= goal
        verdict = "met" if r["goal_met"] else "NOT met"
        print(
            f"  {kind:12s}{r['perplexity']:9.3f}   weights {r['weight_bytes'] / 1e6:7.1f} MB   "
            f"{100 * (r['ratio_to_dense'] - 1):+.2f}% (goal within {100 * goal:.1f}%: {verdict})"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
