"""`make demo`: the main job end to end, on this machine's CPUs (about 4 minutes on 2 cores, set-up excluded).

1. Train the `tiny` model on the default corpus (the standard library's own sources) for about 3 minutes:
   1 CPU process, DeepSpeed ZeRO-2, fp32 state with bf16 matmuls where the CPU has native bf16
   (`tandem train --config configs/demo.yaml`, `trainer.autocast=auto`); the run exports a bundle.
2. Load the bundle in shared_model and in transformers, compare their logits, and compare the held-out loss of the
   trained model with that of its random initialisation (the windows `tandem eval` scores).
3. Print the memory ledger of the bundle and of qwen3-8b (the lecture's table).
4. Serve the bundle over gRPC (`tandem serve`), stream the greedy completion of a Python prompt with its TTFT and
   time per token, check that it reads as Python (distinct keywords, identifiers, an indented line), then stop the
   server with SIGTERM.
5. The comparison table of serving configurations (`compare_configurations`, last).

Runs land under ./runs (a new timestamped folder per run).
"""

from __future__ import annotations

import keyword
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "demo.yaml"

PROMPT = "import os\nimport sys\n\n\ndef main():"
"""A Python prompt whose next line is the body. It stops at the colon, not after a newline: the tokenizer merges a
newline with the indentation after it, so a prompt ending in a bare newline would ask for an unindented line."""
MAX_NEW_TOKENS = 96
"""Long enough that the check below reads a few lines, not one: at 64 tokens the bf16-trained model of
docs/benchmarks.md §48 met the keyword bound exactly (4), at 96 it shows 6 (fp32's: 6, then 7). About 0.2 s more."""
REPETITION_PENALTY = 1.3
"""Greedy decoding with a CTRL-style repetition penalty: plain greedy from a model this small loops on one line
(`self.assertEqual(self.path, ...)` over and over); 1.3 keeps it moving through more of what it learned."""
MIN_KEYWORDS = 4
EVAL_WINDOW = 128
"""Held-out windows as long as the training blocks (configs/demo.yaml data.block_size)."""
EVAL_MAX_TOKENS = 8192
DEMO_SERVE_FLAGS = ("--compile", "off")
"""Every server of the demo runs its step eagerly. Each lives for seconds (one completion; one configuration of
the comparison table), and compiling the 5M model's step costs about 50 s a server on 2 cores (five servers:
about 4 of the demo's minutes, docs/benchmarks.md §26) for about 1 ms a token back. `tandem serve` on its own
keeps `--compile auto` (compiled, and warm from its compile cache at the next start)."""


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def train() -> Path:
    step(
        "train: tiny model, 1 CPU process, ZeRO-2, fp32 state with bf16 matmuls where the CPU has native bf16, "
        "~3 min (tandem train --config configs/demo.yaml)"
    )
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(CONFIG)]
    t0 = time.perf_counter()
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}  # no "unable to detect" warning
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
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
    from shared_model.evaluate import evaluate_offline, heldout_texts, text_windows
    from shared_model.model import build_model

    step("load the bundle in shared_model and in transformers; held-out loss vs random init")
    bundle = load_bundle(bundle_dir, dtype=torch.float32)
    assert bundle.tokenizer is not None
    texts = heldout_texts()
    init = build_model(bundle.config, seed=0).eval()
    before = evaluate_offline(init, bundle.tokenizer, texts, EVAL_WINDOW, max_tokens=EVAL_MAX_TOKENS)
    after = evaluate_offline(bundle.model, bundle.tokenizer, texts, EVAL_WINDOW, max_tokens=EVAL_MAX_TOKENS)
    print(
        f"held-out loss over {after.tokens} tokens ({after.windows} windows of {EVAL_WINDOW}; "
        f"tandem eval --model DIR --window {EVAL_WINDOW}):"
    )
    for name, r in (("random init", before), ("trained", after)):
        ppl, bpb = r.perplexity, r.bits_per_byte
        print(f"  {name:<11}  {r.mean_nll:5.2f} nats/token   perplexity {ppl:8.1f}   {bpb:.2f} bits/byte")
    vocab = bundle.config.vocab_size
    print(f"(uniform guessing over {vocab} tokens is ln V = {math.log(vocab):.2f})")
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers not installed: skipping the cross-check")
        return
    ids = torch.tensor([text_windows(bundle.tokenizer, texts, 256, max_tokens=256)[0].ids])  # [1, 256]
    hf = AutoModelForCausalLM.from_pretrained(bundle_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        delta = (hf(ids).logits - bundle.model(ids)).abs().max().item()
    print(f"transformers AutoModelForCausalLM vs shared_model: max |Δ logits| = {delta:.3g} over {ids.shape[1]} tokens")
    if delta > 1e-4:
        raise SystemExit("demo: the bundle's logits differ between transformers and shared_model")


def ledger(bundle_dir: Path) -> None:
    from shared_model.ledger_cli import main as ledger_main

    step("memory ledger of the bundle (tandem ledger --model DIR --context 2048)")
    ledger_main(["--model", str(bundle_dir), "--context", "2048"])
    step("memory ledger of qwen3-8b: the lecture's table (tandem ledger --model qwen3-8b)")
    ledger_main(["--model", "qwen3-8b"])


@dataclass
class PythonCheck:
    """How much a completion reads as Python."""

    keywords: list[str]
    """Distinct Python keywords (keyword.kwlist), in order of appearance."""
    identifiers: list[str]
    """Distinct identifiers that are not keywords, in order of appearance."""
    indented_lines: int
    """Lines that start with 4 spaces or a tab and hold code (not only a string or a comment)."""

    @property
    def ok(self) -> bool:
        return len(self.keywords) >= MIN_KEYWORDS and len(self.identifiers) >= 2 and self.indented_lines >= 1

    def summary(self) -> str:
        return (
            f"{len(self.keywords)} distinct Python keywords (need {MIN_KEYWORDS}): {', '.join(self.keywords) or '-'}; "
            f"{len(self.identifiers)} identifiers: {', '.join(self.identifiers[:10])}"
            f"{', …' if len(self.identifiers) > 10 else ''}; {self.indented_lines} indented lines"
        )


_NOT_CODE = re.compile(r"(\"\"\"|''')[\s\S]*?\1|(\"\"\"|''')[^\n]*|\"[^\"\n]*\"|'[^'\n]*'|#[^\n]*")
"""String literals and comments. A triple-quoted string the model never closes ends with its line: what follows it
reads as code to a person, so it counts as code here."""


def check_python(completion: str) -> PythonCheck:
    """Count the Python in a completion alone (the prompt's own `import`/`def` do not count), outside strings and
    comments (an `if` in a docstring's English is not code)."""
    code = _NOT_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), completion)  # blanked, lines kept
    words = list(dict.fromkeys(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code)))
    keywords = [w for w in words if w in keyword.kwlist]
    identifiers = [w for w in words if w not in keyword.kwlist]
    indented = sum(1 for line in code.splitlines() if re.match(r"(    |\t)+\S", line))
    return PythonCheck(keywords, identifiers, indented)


class _Tee:
    """A text stream that writes through to stdout and keeps a copy."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()

    @property
    def text(self) -> str:
        return "".join(self.parts)


def serve(bundle_dir: Path) -> PythonCheck:
    from inference_svc.generate_cli import stream_completion
    from inference_svc.serve_process import ServeProcess

    step("serve the bundle over gRPC and stream the greedy completion of a Python prompt")
    flags = ["--metrics-port", "0", "--http-port", "0", "--shutdown-grace", "10", *DEMO_SERVE_FLAGS]
    server = ServeProcess(bundle_dir, flags, echo=True)
    print(f"$ tandem serve --model {bundle_dir} --port {server.port} {' '.join(DEMO_SERVE_FLAGS)}", flush=True)
    try:
        target = server.target
        server.wait_serving(300)
        print(
            f"$ tandem generate --target {target} {PROMPT!r} --max-new-tokens {MAX_NEW_TOKENS} --temperature 0 "
            f"--repetition-penalty {REPETITION_PENALTY}",
            flush=True,
        )
        sys.stdout.write(PROMPT)  # the prompt, then the completion as it streams
        out = _Tee()
        stream_completion(
            target,
            PROMPT,
            out=out,
            max_new_tokens=MAX_NEW_TOKENS,
            temperature=0.0,
            repetition_penalty=REPETITION_PENALTY,
        )
        sys.stderr.flush()
    finally:
        code = server.stop(60)  # SIGTERM: the server drains and exits 0
    if code != 0:
        raise SystemExit(f"demo: the server exited with {code}")
    check = check_python(out.text)
    if check.ok:
        print(f"reads as Python: {check.summary()}", flush=True)
    else:
        print(f"WARNING: the completion does not read as Python yet: {check.summary()}", flush=True)
    return check


def compare_configurations(bundle_dir: Path) -> None:
    """The lecture's comparison table: the bundle served as fp32, bf16, int8 and int4, each server started and
    stopped by `tandem bench --compare` (perplexity through the server, TTFT, time per token, throughput at 1 and
    16 streams, ledger vs measured memory); about 40 s of the demo's 7 minutes."""
    configs = "fp32,bf16,int8,int4"
    out = bundle_dir.parent / "compare"
    args = ["--compare", "--model", str(bundle_dir), "--configs", configs, "--streams", "1,16", "--num-requests", "16",
            "--input-len", "64", "--output-len", "32", "--eval-tokens", "2048", "--eval-window", "128",
            "--warmup", "1", "--out", str(out), "--", "--kv-cache-memory", "32MiB", *DEMO_SERVE_FLAGS]  # fmt: skip
    step(f"compare serving configurations: quality, latency, throughput, memory (tandem bench {' '.join(args)})")
    proc = subprocess.run([sys.executable, "-m", "shared_model.cli", "bench", *args], cwd=REPO, timeout=600)
    if proc.returncode != 0:
        print(f"demo: WARNING: the comparison ended with exit {proc.returncode} (see {out})")


def main() -> int:
    t0 = time.perf_counter()
    bundle = train()
    check_bundle(bundle)
    ledger(bundle)
    check = serve(bundle)
    compare_configurations(bundle)
    verdict = "the completion reads as Python" if check.ok else "WARNING: the completion did not read as Python"
    print(f"\ndemo: done in {time.perf_counter() - t0:.0f} s ({verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
