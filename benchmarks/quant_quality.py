"""Quality of weight-only quantization: held-out perplexity of a model trained by `tandem train`, dense vs int8 vs int4.

What it does:
  1. Takes a bundle exported by `tandem train` (`--bundle DIR`), or trains one first: `tandem train --config
     configs/tiny-cpu.yaml` for `--steps N` on `--max-documents` of the default corpus (random weights say
     nothing about quality, so it never measures an untrained model).
  2. Scores the validation split of the training corpus (the documents `tandem train` held out) in windows of
     `--window` tokens: the model in bf16 with dense weights, then the same model with `quantize_weights(..., int8)`
     and `(..., int4)`, exactly as `tandem serve --quantization` prepares it.
  3. Prints each perplexity and its ratio to dense bf16 against the goals (int8 within 0.5%, int4 within 3%),
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

from shared_model.bundle import load_bundle
from shared_model.corpus import CorpusConfig, load_corpus
from shared_model.fuse import fuse_projections
from shared_model.quantize import quantize_weights, serving_weight_bytes

REPO = Path(__file__).resolve().parents[1]
GOALS = {"int8": 0.005, "int4": 0.03}


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
    for kind in ("none", "int8", "int4"):
        model = fuse_projections(load_bundle(bundle, dtype=torch.bfloat16).model)
        quantize_weights(model, kind)
        t0 = time.perf_counter()
        ppl = perplexity(model, ids, args.window)
        results[kind] = {"perplexity": ppl, "weight_bytes": serving_weight_bytes(model)}
        results[kind]["seconds"] = time.perf_counter() - t0
    dense = results["none"]["perplexity"]
    print(f"held-out perplexity over {len(ids)} tokens (windows of {args.window}), bf16 activations:")
    print(f"  dense bf16  {dense:9.3f}   weights {results['none']['weight_bytes'] / 1e6:7.1f} MB")
    for kind, goal in GOALS.items():
        r = results[kind]
        r["ratio_to_dense"] = r["perplexity"] / dense
        r["goal_met"] = r["ratio_to_dense"] - 1 <= goal
        verdict = "met" if r["goal_met"] else "NOT met"
        print(
            f"  {kind:10s}  {r['perplexity']:9.3f}   weights {r['weight_bytes'] / 1e6:7.1f} MB   "
            f"{100 * (r['ratio_to_dense'] - 1):+.2f}% (goal within {100 * goal:.1f}%: {verdict})"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
