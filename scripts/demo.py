"""`make demo`: the main job end to end, on this machine's CPUs.

1. Train the `tiny` model on the default corpus (the standard library's own sources) with 2 CPU processes under
   DeepSpeed ZeRO-2 in bf16 (`tandem train --config configs/demo.yaml`); the run exports a bundle.
2. Load the bundle in shared_model and in transformers, compare their logits, and compare the held-out loss of the
   trained model with that of its random initialisation.
3. Print the memory ledger of the bundle and of qwen3-8b (the lecture's table).
4. Serve the bundle over gRPC (`tandem serve`), stream a completion with its TTFT and time per token, then stop the
   server with SIGTERM.

Runs land under ./runs (a new timestamped folder per run).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def train() -> Path:
    step("train: tiny model, 2 CPU processes, ZeRO-2, bf16-mixed (tandem train --config configs/demo.yaml)")
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(REPO / "configs" / "demo.yaml")]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    bundle: Path | None = None
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        if line.startswith("bundle: "):
            bundle = Path(line.removeprefix("bundle: ").strip())
    if proc.wait() != 0 or bundle is None:
        raise SystemExit(f"demo: training failed (exit {proc.returncode})")
    print(f"trained and exported in {time.perf_counter() - t0:.0f} s: {bundle}")
    return bundle


def check_bundle(bundle_dir: Path) -> None:
    from shared_model.bundle import load_bundle
    from shared_model.corpus import CorpusConfig, load_corpus
    from shared_model.model import build_model

    step("load the bundle in shared_model and in transformers; held-out loss vs random init")
    bundle = load_bundle(bundle_dir, dtype=torch.float32)
    assert bundle.tokenizer is not None
    val = load_corpus(CorpusConfig(max_documents=300)).val
    text = "\n".join(d.text for d in val)[:20000]
    ids = torch.tensor([bundle.tokenizer.encode(text)[:256]])  # [1, 256]
    with torch.no_grad():
        logits = bundle.model(ids)
        trained = F.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
        init = build_model(bundle.config, seed=0)
        untrained = F.cross_entropy(init(ids)[0, :-1], ids[0, 1:]).item()
    print(f"held-out loss over {ids.shape[1]} tokens: random init {untrained:.2f} -> trained {trained:.2f}")
    vocab = bundle.config.vocab_size
    print(f"(uniform guessing over {vocab} tokens is ln V = {math.log(vocab):.2f})")
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers not installed: skipping the cross-check")
        return
    hf = AutoModelForCausalLM.from_pretrained(bundle_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        delta = (hf(ids).logits - logits).abs().max().item()
    print(f"transformers AutoModelForCausalLM vs shared_model: max |Δ logits| = {delta:.3g}")
    if delta > 1e-4:
        raise SystemExit("demo: the bundle's logits differ between transformers and shared_model")


def ledger(bundle_dir: Path) -> None:
    from shared_model.ledger_cli import main as ledger_main

    step("memory ledger of the bundle (tandem ledger --model DIR --context 2048)")
    ledger_main(["--model", str(bundle_dir), "--context", "2048"])
    step("memory ledger of qwen3-8b: the lecture's table (tandem ledger --model qwen3-8b)")
    ledger_main(["--model", "qwen3-8b"])


def serve(bundle_dir: Path) -> None:
    from inference_svc.cli import serve_and_stream

    step("serve the bundle over gRPC and stream a completion")
    figures = serve_and_stream(str(bundle_dir), "def main():", max_new_tokens=48)
    if figures.get("server_exit_code") != 0:
        raise SystemExit(f"demo: the server exited with {figures.get('server_exit_code')}")


def main() -> int:
    bundle = train()
    check_bundle(bundle)
    ledger(bundle)
    serve(bundle)
    print("\ndemo: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
