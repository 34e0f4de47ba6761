"""Time per token of LoRA requests against the base model's, at 1 stream and at 16 streams spread over 4 adapters.

Issue 37 asks that a LoRA request decode within 1.2x of the base model's time per token. This benchmark builds a
random Qwen3 bundle (`benchmarks/cpu_peer.py`'s model and cache; ~30M parameters by default) and random PEFT
adapters of rank `--rank` on all seven projections, then, in one process, decodes with:
- `base`: an engine without LoRA (`--compile off`, as a LoRA engine's step is eager), every request on the base;
- `lora`: an engine with `--max-loras 4` and the 4 adapters loaded, every request on an adapter (1 stream: adapter
  0; 16 streams: 4 on each adapter, interleaved, so each step is one base matmul plus 4 adapters' deltas per
  projection); its deltas run as the load plan chose (the fused C++ operator where Tandem's kernels run);
- `lora-base-rows`: a second such engine serving base requests only (what slots cost a step that uses none);
- with `--torch-delta`, also `lora-torch`: a third LoRA engine whose deltas take the torch path (small matmuls),
  as on a machine without the native library, for comparison.
The engines decode side by side, one step of each in turn, so a burst of other work on a shared machine lands on
all of them alike. Each figure is a round's mean decode-step time (ms; a step gives each stream one token, so it
is the time per token of each stream) after a short prompt, the median and the best over `--rounds` (on a machine
shared with other work the best is the steadier estimate of the step's own cost); the ratios are lora / base.
Greedy, EOS ignored. Run it alone on a quiet machine; figures taken on a shared one are marked so in
docs/benchmarks.md.

    .venv/bin/python benchmarks/lora_serving.py --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_peer  # the sibling benchmark: its model builder and bundle cache

STREAMS = (1, 16)
ADAPTERS = 4


def write_adapter(folder: Path, config, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder (A and B both random) on every projection of every layer."""
    from safetensors.torch import save_file

    from inference_svc.lora.adapter import projection_shapes

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for proj, (out, inp) in projection_shapes(config).items():
            where = "self_attn" if proj[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(projection_shapes(config)),
           "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def add_requests(engine, streams: int, names: list[str | None], tokens: int, prompt_len: int, vocab: int) -> None:
    """`streams` greedy requests, request i on adapter names[i % len(names)]."""
    from inference_svc.engine import SamplingParams

    for i in range(streams):
        prompt = [3 + (i * 7 + j) % (vocab - 3) for j in range(prompt_len)]
        sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True, lora_name=names[i % len(names)])
        engine.add_request(f"s{time.monotonic_ns()}-{i}", prompt, sampling)


def step_ms(cases: dict, streams: int, tokens: int, prompt_len: int, vocab: int) -> dict[str, float]:
    """Each case's mean decode-step time (ms) of `streams` requests, the engines stepping in turn."""
    for engine, names in cases.values():
        add_requests(engine, streams, names, tokens, prompt_len, vocab)
    times: dict[str, list[float]] = {case: [] for case in cases}
    while any(engine.has_unfinished_requests() for engine, _ in cases.values()):
        for case, (engine, _) in cases.items():
            if not engine.has_unfinished_requests():
                continue
            sched = engine.scheduler
            decoding = not sched.waiting and all(s.num_output_tokens > 0 for s in sched.running)  # no prefill in it
            start = time.perf_counter()
            engine.step()
            if decoding:
                times[case].append(time.perf_counter() - start)
    return {case: 1000 * statistics.mean(t[1:]) for case, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of every adapter")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--torch-delta", action="store_true", help="also time a LoRA engine on the torch delta path")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from inference_svc.engine import Engine, EngineConfig

    ns = argparse.Namespace(hidden=args.hidden, layers=args.layers, vocab=args.vocab, heads=None, kv_heads=None,
                            intermediate=None)  # fmt: skip
    config = cpu_peer.model_config(ns)
    bundle = cpu_peer.make_bundle(cpu_peer.model_dir(config, 0), config, 0)
    print(f"model: {cpu_peer.param_count(config) / 1e6:.1f}M parameters ({bundle}), {args.dtype}, "
          f"{args.threads} threads, rank {args.rank}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [write_adapter(Path(tmp) / f"a{i}", config, args.rank, seed=i) for i in range(ADAPTERS)]
        common = dict(dtype=args.dtype, device="cpu", compile="off", kv_cache_memory="256MiB",
                      enable_prefix_caching=False)  # fmt: skip
        mods = tuple(f"a{i}={d}" for i, d in enumerate(dirs))
        lora_config = EngineConfig(**common, lora_modules=mods, max_loras=ADAPTERS, max_lora_rank=args.rank)
        adapters = [f"a{i}" for i in range(ADAPTERS)]
        cases = {
            "base": (Engine.from_bundle(bundle, EngineConfig(**common)), [None]),
            "lora": (Engine.from_bundle(bundle, lora_config), adapters),
            "lora-base-rows": (Engine.from_bundle(bundle, lora_config), [None]),
        }
        lora = cases["lora"][0]
        print("lora:", next(c.reason for c in lora.load_plan if c.lever == "lora"), flush=True)
        if args.torch_delta:
            engine = Engine.from_bundle(bundle, lora_config)
            engine.lora.fused = None  # the torch path, as without the native library (every other kernel alike)
            cases["lora-torch"] = (engine, adapters)
        step_ms({c: (e, n[:1]) for c, (e, n) in cases.items()}, 2, 4, args.prompt, args.vocab)  # warm-up
        results: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for streams in STREAMS:
                use = {c: (e, n[:1] if streams == 1 else n) for c, (e, n) in cases.items()}
                for case, ms in step_ms(use, streams, args.tokens, args.prompt, args.vocab).items():
                    results.setdefault((case, streams), []).append(ms)
    torch_col = " | LoRA, torch delta ms/step | torch / base" if args.torch_delta else ""
    head = "| streams | figure | base ms/step | lora ms/step | lora / base | LoRA engine, base rows ms/step"
    print(f"\n{head}{torch_col} |")
    print("|---:|---|---:|---:|---:|---:|" + ("---:|---:|" if args.torch_delta else ""))
    for streams in STREAMS:
        for figure, pick in (("median", statistics.median), ("best", min)):
            b, lo, lb = (pick(results[(c, streams)]) for c in ("base", "lora", "lora-base-rows"))
            extra = ""
            if args.torch_delta:
                lt = pick(results[("lora-torch", streams)])
                extra = f" {lt:.2f} | {lt / b:.2f}x |"
            print(f"| {streams} | {figure} | {b:.2f} | {lo:.2f} | {lo / b:.2f}x | {lb:.2f} |{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
