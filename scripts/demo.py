"""`make demo`: the main job end to end, on this machine's CPUs.

Steps: build the tokenizer and the `tiny` model from the default corpus (the standard library's own sources),
write a bundle, load it back and check the logits round-trip, then print the memory ledger of that model and of
qwen3-8b. Everything lands under ./runs/demo (override with TANDEM_DEMO_DIR).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from shared_model.bundle import load_bundle, save_bundle
from shared_model.config import get_preset
from shared_model.corpus import load_corpus
from shared_model.ledger_cli import main as ledger_main
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def build_bundle(out: Path) -> Path:
    step("tokenizer + tiny model from the default corpus")
    t0 = time.perf_counter()
    corpus = load_corpus()
    config = get_preset("tiny")
    tokenizer = Tokenizer.train(corpus.texts(), vocab_size=config.vocab_size)
    print(
        f"corpus: {len(corpus.train)} train / {len(corpus.val)} val files, {corpus.num_bytes / 1e6:.1f} MB; "
        f"tokenizer: {tokenizer.vocab_size} tokens ({time.perf_counter() - t0:.1f} s)"
    )
    model = build_model(config, seed=0)
    print(f"model: {config.num_parameters():,} parameters")
    path = save_bundle(out / "bundle-init", config, model, tokenizer, overwrite=True)
    print(f"bundle written: {path} ({', '.join(sorted(p.name for p in path.iterdir()))})")

    step("load the bundle back and compare logits")
    bundle = load_bundle(path)
    sample = corpus.val[0].text[:2000] if corpus.val else corpus.train[0].text[:2000]
    ids = torch.tensor([tokenizer.encode(sample)[:256]])
    with torch.no_grad():
        delta = (bundle.model(ids) - model(ids)).abs().max().item()
    print(f"max |Δ logits| over {ids.shape[1]} tokens: {delta:.3g}")
    if delta != 0.0:
        raise SystemExit("demo: logits did not round-trip through the bundle")
    return path


def main() -> int:
    out = Path(os.environ.get("TANDEM_DEMO_DIR", "runs/demo")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = build_bundle(out)
    step("memory ledger of the bundle")
    ledger_main(["--model", str(path), "--context", "2048"])
    step("memory ledger of qwen3-8b (the lecture's table)")
    ledger_main(["--model", "qwen3-8b"])
    print("\ndemo: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
