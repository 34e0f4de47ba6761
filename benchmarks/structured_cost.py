"""What a grammar costs per generated token: constrained (a JSON schema) against unconstrained decoding.

A random 2-layer qwen3 (hidden 256) over a byte-level BPE of `--vocab` tokens (built locally as in
`grammar_engines.py`), run by the engine offline (`Engine.generate`, greedy, `--tokens` new tokens per stream) at 1
and 16 streams. Constrained runs use a JSON schema whose array of strings never has to end, so every stream
generates the same number of tokens as the unconstrained run (`ignore_eos`, finish reason "length"). Reports
milliseconds per step (wall time / tokens per stream), best of `--repeats` interleaved runs, after a warm-up.
The two runs emit different tokens (so their detokenizing differs too); the grammar's own work per step is also
timed alone: the bitmasks of S matchers walking a schema-valid document (`ConstrainedDecoding.masks`) and the mask
applied to [S, V] logits (`sampler.constrain`), per step, the median over three walks of the document.
Usage:
    python benchmarks/structured_cost.py [--vocab 8192 151936] [--streams 1 16] [--tokens 64]
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
from grammar_engines import build_tokenizer

from inference_svc.engine import Engine, EngineConfig
from inference_svc.engine.types import SamplingParams, StructuredOutput
from shared_model.bundle import save_bundle
from shared_model.config import ModelConfig
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "words": {"type": "array", "items": {"type": "string"}}},
    "required": ["id", "words"],
    "additionalProperties": False,
}


DOC = '{"id": 7, "words": ["alpha", "beta gamma", "delta", "epsilon zeta eta", "theta"]}'


def _grammar_work(engine: Engine, so: StructuredOutput, streams: int) -> dict[str, float]:
    """Mean ms per step of the masks and of applying them, for `streams` matchers walking DOC."""
    from inference_svc.engine.grammar import MaskItem
    from inference_svc.engine.sampler import SampleRequest, constrain

    cd = engine._constrained_decoding()
    ids = [f"bench-{i}" for i in range(streams)]
    for rid in ids:
        cd.add(rid, so)
    doc = engine.tokenizer.encode(DOC)
    logits = torch.randn(streams, engine.model_config.vocab_size)  # [S, V]
    requests = [SampleRequest(SamplingParams(structured=so), [1], None, 1)] * streams
    t_mask: list[float] = []
    t_apply: list[float] = []
    for _ in range(3):  # the document three times, the matchers reset between walks
        for tok in doc:
            t0 = time.perf_counter()
            masks = cd.masks([MaskItem(rid) for rid in ids])
            t1 = time.perf_counter()
            constrain(logits, logits, torch.cat(masks), requests)  # type: ignore[arg-type]
            t2 = time.perf_counter()
            t_mask.append(t1 - t0)
            t_apply.append(t2 - t1)
            for rid in ids:
                cd.advance(rid, [tok])
        for rid in ids:
            cd.forget(rid)
            cd.add(rid, so)
    for rid in ids:
        cd.forget(rid)
    return {
        "mask_ms": round(1000 * statistics.median(t_mask), 3),
        "apply_ms": round(1000 * statistics.median(t_apply), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192, 151936])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for vocab in args.vocab:
        tok = Tokenizer(build_tokenizer(vocab))
        config = ModelConfig(
            model_type="qwen3", vocab_size=vocab, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=64, intermediate_size=512, qk_norm=True, max_position_embeddings=1024,
        )  # fmt: skip
        model = build_model(config, seed=0)
        with tempfile.TemporaryDirectory() as tmp:
            folder = save_bundle(Path(tmp) / "m", config, model, tok)
            engine = Engine.from_bundle(folder, EngineConfig(dtype="float32", kv_cache_memory="256MiB"))
        so = StructuredOutput("json", json.dumps(SCHEMA))
        for streams in args.streams:
            prompts = [f"Record {i}: " for i in range(streams)]
            row = {"vocab": vocab, "streams": streams, "tokens": args.tokens}
            runs = {"plain": None, "json_schema": so}
            params = {
                k: SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, structured=v) for k, v in runs.items()
            }
            for p in params.values():
                engine.generate(prompts, p)  # warm-up (and the grammar's compile, cached from here on)
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(args.repeats):  # interleaved: a noisy moment hits both kinds alike
                for name, p in params.items():
                    t0 = time.perf_counter()
                    out = engine.generate(prompts, p)
                    best[name] = min(best[name], time.perf_counter() - t0)
                    assert all(len(r.token_ids) == args.tokens for r in out), [len(r.token_ids) for r in out]
            for name in runs:
                row[f"{name}_ms_per_step"] = round(1000 * best[name] / args.tokens, 3)
            row.update(_grammar_work(engine, so, streams))
            row["overhead_pct"] = round(100 * (row["json_schema_ms_per_step"] / row["plain_ms_per_step"] - 1), 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
