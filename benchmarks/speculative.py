"""Speculative decoding benchmark: Tandem's served batch-1 decode with prompt-lookup speculation against plain
decoding and against llama.cpp (`llama-bench` tg and its own prompt lookup, `llama-lookup`), same weights, same run.

The goal it measures (one run): on code-completion prompts from the held-out corpus, served batch-1 decode with
speculation reaches at least 1.0x plain llama.cpp (`llama-bench` tg) at the same precision, with greedy output
unchanged; and 16 concurrent streams with speculation on do not fall below plain decoding.

What it does, in one run:
1. the model is a bundle trained by `tandem train` (`--bundle DIR`; default the newest `runs/demo-*/bundle`, made
   by `make demo`; none: a one-line error naming that command). Random weights would make acceptance meaningless.
   Precision: the bundle's own dtype (config.json `torch_dtype`), `--dtype float32|bfloat16` overrides;
2. prompts: the held-out documents of the run's corpus (the data section of the run's `config.yaml` beside the
   bundle, defaults otherwise: a document is held out when SHA-256 of its name falls under `data.val_fraction`,
   `shared_model.corpus.in_validation`, the split `tandem train` and `tandem eval` use; `max_documents` is not
   applied: a held-out document is never trained on either way). Of those with at least `--prompt-tokens` +
   `--n-gen` tokens, sorted by name, `--prompts N` spread evenly over the list; each is the file's beginning cut
   at the first line boundary at or after `--prompt-tokens` tokens (the bundle's tokenizer, no BOS, as trained);
3. llama.cpp (built once, cached, see `benchmarks/llama_cpp.py`; `llama-lookup` in a second build folder,
   `build-examples/`, whose build time is printed): the bundle converted with the sdist's `convert_hf_to_gguf.py`
   to the same precision (F32 for float32, BF16 for bfloat16; cached under `~/.cache/tandem/speculative/`); per
   `--threads` count `llama-bench -m F -t T -p 0 -n N_GEN` (tg, its mean over 5 reps), run again after the
   Tandem case, the two runs' mean reported (the machine's speed drifts over a case), and, per prompt,
   `llama-lookup -m F -t T -p TEXT -n N_GEN --spec-draft-n-max K --temp 0 --ignore-eos -c 2048 -s 0` (this
   version removed `--draft`, which now only errors out, in favour of `--spec-draft-n-max`): its decode tok/s
   recomputed as (n_predict - 1) / its decode time (the first token comes from the prompt's logits, as Tandem's
   does), its n_drafted / n_accept. A llama-lookup that cannot run is reported "not run" with the reason;
4. Tandem: per thread count one `python -m shared_model.cli serve --model BUNDLE --device cpu --dtype D --threads T
   --speculative ngram --num-speculative-tokens K --no-metrics --no-http` on a free loopback port; per prompt one
   untimed request for two tokens (so that both timed runs find the prompt in the prefix cache: a cached prompt's
   last token and an uncached one's run through different kernels, which may round differently in bf16), then two
   streamed greedy requests (temperature 0, ignore_eos, max_new_tokens N_GEN), plain (num_speculative_tokens=0)
   and speculative (num_speculative_tokens=K), in alternating order: decode tok/s = tokens after the first
   message's / (arrival of the last - arrival of the first); acceptance = accepted / drafted and tokens per step =
   completion tokens / decode steps, from each response's Usage, summed over prompts. The speculative token ids
   must equal the plain ones for every prompt (greedy is exact): a difference is printed and the exit status is 1;
5. 16 streams: the same prompts repeated to 16 concurrent streamed requests (same settings), total generated
   tokens / wall time from the first request sent to the last token, plain and speculative, `--stream-rounds`
   (5) rounds in alternating order; the round with the median tok/s is reported, every round's tok/s beside it,
   and the median of each round's speculative / plain. Every prompt was
   already prefilled once by then, so the prefix cache serves both equally. (The engine turns drafting off in a
   step with more than `speculative_max_batch`, default 8, decoding sequences: this row checks that costs
   nothing.) Their token ids are compared with the batch-1 plain ones too (reported, not an error: batched
   numerics may differ).
Before each timed case the share of the CPUs busy with other work is sampled (1 s, nothing of ours running) and
reported; `--quiet-wait S` waits up to S seconds for it to fall below `--quiet-below` (default 10%).
Writes `<out>/speculative.json` and prints a markdown table for docs/benchmarks.md (date, CPU flags, the exact
command). Exit status 1 when a step failed or greedy output differed (the JSON still holds what was measured).

    .venv/bin/python benchmarks/speculative.py --out results/speculative [--bundle runs/demo-.../bundle] \\
        [--threads 1,2] [--prompts 8 --prompt-tokens 256 --n-gen 128 --num-speculative-tokens 4] [--quiet-wait 600]
    .venv/bin/python benchmarks/speculative.py --prompts 2 --n-gen 32 --threads 1 --out /tmp/spec   # smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_peer  # the sibling benchmark (benchmarks/ is not a package): machine, quiet wait, server
import llama_cpp

REPO = Path(__file__).resolve().parents[1]
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16"}
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
MAKE_BUNDLE = "make demo (or: tandem train --config configs/demo.yaml)"
STREAMS = 16
log = cpu_peer.log


# ------------------------------------------------------------------------------------------------ bundle + prompts
def newest_demo_bundle(runs: Path) -> Path | None:
    """The newest `runs/demo-*/bundle` (by the run folder's name, which carries its start time; then mtime)."""
    found = [p for p in runs.glob("demo-*/bundle") if (p / "config.json").is_file()]
    return max(found, key=lambda p: (p.parent.name, p.stat().st_mtime)) if found else None


def bundle_dtype(bundle: Path) -> str:
    """float32 or bfloat16: the dtype the bundle's weights were exported in (config.json `torch_dtype`)."""
    cfg = json.loads((bundle / "config.json").read_text())
    dtype = DTYPE_ALIASES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"))
    if dtype is None:
        raise llama_cpp.StepError(f"{bundle}: torch_dtype {cfg.get('torch_dtype')!r} is not float32 or bfloat16")
    return dtype


def data_section(bundle: Path) -> dict[str, Any]:
    """The data section of the run that made the bundle (`config.yaml` beside it), {} when there is none."""
    path = bundle.parent / "config.yaml"
    if not path.is_file():
        return {}
    import yaml

    return dict((yaml.safe_load(path.read_text()) or {}).get("data") or {})


def heldout_documents(data: dict[str, Any]) -> list[Any]:
    """The run's held-out documents (`shared_model.corpus.Document`), sorted by name: the corpus its data section
    describes (JSONL files left out: they are not source code) split by `in_validation`, without max_documents."""
    from shared_model.corpus import CorpusConfig, load_corpus

    extra = tuple(str(f) for f in data.get("extra") or () if not str(f).endswith((".jsonl", ".jsonl.gz")))
    config = CorpusConfig(
        include_stdlib=bool(data.get("include_stdlib", True)),
        extra=extra,
        val_fraction=float(data.get("val_fraction", 0.02)),
    )
    return sorted(load_corpus(config).val, key=lambda d: d.name)


def cut_prompt(text: str, encode: Callable[[str], list[int]], n_tokens: int) -> str | None:
    """`text`'s beginning up to the first line boundary at or after `n_tokens` tokens (None: text is shorter)."""
    lines = text.splitlines(keepends=True)
    ends, pos = [], 0
    for line in lines:
        pos += len(line)
        ends.append(pos)
    lo, hi = 0, len(ends) - 1  # smallest i with len(encode(text[:ends[i]])) >= n_tokens (prefix lengths grow)
    if not ends or len(encode(text[: ends[hi]])) < n_tokens:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if len(encode(text[: ends[mid]])) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    return text[: ends[lo]]


def pick_prompts(
    docs: Sequence[Any], encode: Callable[[str], list[int]], n: int, prompt_tokens: int, n_gen: int
) -> list[dict[str, Any]]:
    """`n` prompts from documents with at least prompt_tokens + n_gen tokens, spread evenly over `docs`' order:
    [{"name", "text", "ids"}]. Fewer when fewer documents qualify."""
    usable = []
    for d in docs:
        if len(encode(d.text)) < prompt_tokens + n_gen:
            continue
        text = cut_prompt(d.text, encode, prompt_tokens)
        if text is not None and text.strip():
            usable.append({"name": d.name, "text": text, "ids": encode(text)})
    if len(usable) <= n:
        return usable
    return [usable[i * len(usable) // n] for i in range(n)]


# ------------------------------------------------------------------------------------------------ llama.cpp
def gguf_folder(bundle: Path) -> Path:
    """Cache folder of a bundle's GGUF files, keyed by its weights' SHA-256 (tandem_bundle.json) or mtime."""
    manifest = bundle / "tandem_bundle.json"
    key = ""
    if manifest.is_file():
        files = json.loads(manifest.read_text()).get("files", {})
        key = files.get("model.safetensors", {}).get("sha256", "")[:12]
    if not key:
        key = (
            str(int((bundle / "model.safetensors").stat().st_mtime)) if (bundle / "model.safetensors").exists() else "x"
        )
    return llama_cpp.cache_root().parent / "speculative" / f"{bundle.parent.name}-{key}"


def pre_tokenizer_for(bundle: Path) -> str:
    """The llama.cpp pre-tokenizer that splits text as the bundle's tokenizer does: "gpt-2" for a ByteLevel
    pre-tokenizer with its regex (what `Tokenizer.train` makes: GPT-2's split, which llama.cpp's GPT2 type uses),
    else "default". Speed does not depend on it; llama-lookup's prompt tokens (and so its drafts) do."""
    try:
        pre = json.loads((bundle / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return "default"
    return "gpt-2" if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) else "default"


def make_gguf(tools: llama_cpp.Tools, bundle: Path, gtype: str, pre: str) -> tuple[Path, bool]:
    """The bundle as a `gtype` (F32/BF16) GGUF (converted once, cached), and whether the converter did not know the
    pre-tokenizer, so that it was mapped to `pre`."""
    folder = gguf_folder(bundle)
    folder.mkdir(parents=True, exist_ok=True)
    out, note_file = folder / f"model-{gtype}-pre-{pre}.gguf", folder / "convert.json"
    note = json.loads(note_file.read_text()) if note_file.is_file() else {}
    if not out.is_file():
        t0 = time.monotonic()
        mapped = llama_cpp.convert_to_gguf(tools.source, bundle, out, gtype.lower(), folder / "convert.log", pre=pre)
        note[out.name] = {"pre_tokenizer_mapped": mapped}
        note_file.write_text(json.dumps(note) + "\n")
        log(f"  converted {bundle} to {gtype} in {time.monotonic() - t0:.0f} s: {out}")
    return out, bool(note.get(out.name, {}).get("pre_tokenizer_mapped", False))


_LOOKUP_PATTERNS = {
    "n_input": r"encoded\s+(\d+) tokens in",
    "n_predict": r"decoded\s+(\d+) tokens in",
    "decode_s": r"decoded\s+\d+ tokens in\s+([0-9.]+) seconds",
    "printed_tok_s": r"decoded\s+\d+ tokens in\s+[0-9.]+ seconds, speed:\s+([0-9.]+) t/s",
    "n_drafted": r"n_drafted\s*=\s*(\d+)",
    "n_accept": r"n_accept\s*=\s*(\d+)",
}


def parse_lookup(text: str) -> dict[str, float]:
    """llama-lookup's summary lines → numbers; decode tok/s = (n_predict - 1) / decode seconds (the first token is
    sampled from the prompt's logits, no decode pass of its own). KeyError names a line that is missing."""
    out: dict[str, float] = {}
    for key, pattern in _LOOKUP_PATTERNS.items():
        m = re.search(pattern, text)
        if m is None:
            raise KeyError(f"llama-lookup printed no {pattern!r} line")
        out[key] = float(m.group(1))
    if out["printed_tok_s"] > 0:  # its seconds are printed to 1 ms; n_predict / speed has more digits
        out["decode_s"] = out["n_predict"] / out["printed_tok_s"]
    out["tok_s"] = (out["n_predict"] - 1) / out["decode_s"] if out["decode_s"] > 0 else float("nan")
    out["acceptance"] = out["n_accept"] / out["n_drafted"] if out["n_drafted"] else 0.0
    return out


def lookup_command(binary: Path, gguf: Path, threads: int, prompt: str, n_gen: int, k: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-p", prompt, "-n", str(n_gen), "--spec-draft-n-max",
            str(k), "--temp", "0", "--ignore-eos", "-c", "2048", "-s", "0"]  # fmt: skip


def run_lookup(
    binary: Path, gguf: Path, threads: int, prompt: str, n_gen: int, k: int, timeout_s: float, cwd: Path
) -> dict:
    """One llama-lookup run, in `cwd` (where it would save a dynamic n-gram cache if it were given one). Its
    summary goes through llama.cpp's asynchronous logger; a run that exits 0 without it (seen once in about 70
    runs here) is repeated once, and its output kept in `cwd` as lookup-missing-summary-N.log."""
    cmd = lookup_command(binary, gguf, threads, prompt, n_gen, k)
    cwd.mkdir(parents=True, exist_ok=True)
    for attempt in (1, 2):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout_s, cwd=cwd)
        except subprocess.TimeoutExpired:
            raise llama_cpp.StepError(f"llama-lookup timed out after {timeout_s:.0f} s") from None
        text = proc.stdout + proc.stderr
        if proc.returncode != 0:
            tail = " | ".join(ln for ln in text.splitlines()[-6:] if ln.strip())
            raise llama_cpp.StepError(f"llama-lookup failed (exit {proc.returncode}): {tail}")
        try:
            return {**parse_lookup(text), "attempts": attempt}
        except KeyError:
            n = len(list(cwd.glob("lookup-missing-summary-*.log")))
            (cwd / f"lookup-missing-summary-{n}.log").write_text(shlex.join(cmd) + "\n" + text)
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def lookup_case(
    binary: Path | None, why_not: str, gguf: Path, threads: int, prompts: list[dict], args, out_dir: Path
) -> dict:
    """llama-lookup over the prompts: mean tok/s, acceptance summed over prompts; {"status": "not run"} when it
    cannot run (the reason given)."""
    if binary is None:
        return {"status": "not run", "reason": why_not}
    runs = []
    try:
        for p in prompts:
            r = run_lookup(
                binary, gguf, threads, p["text"], args.n_gen, args.k, args.lookup_timeout, out_dir / "lookup"
            )
            runs.append({"prompt": p["name"], "tandem_prompt_tokens": len(p["ids"]), **r})
    except (llama_cpp.StepError, KeyError) as exc:
        return {"status": "not run", "reason": str(exc).strip("'\""), "runs": runs}
    drafted, accepted = sum(r["n_drafted"] for r in runs), sum(r["n_accept"] for r in runs)
    return {
        "status": "ok",
        "tok_s": statistics.mean(r["tok_s"] for r in runs),
        "acceptance": accepted / drafted if drafted else 0.0,
        "command": shlex.join(lookup_command(binary, gguf, threads, "PROMPT_TEXT", args.n_gen, args.k)),
        "prompt_tokens_as_tandem": all(r["n_input"] == r["tandem_prompt_tokens"] for r in runs),
        "runs": runs,
    }


# ------------------------------------------------------------------------------------------------ Tandem
class SpecServer(cpu_peer.Server):
    """`tandem serve` with speculation on by default (requests turn it off with num_speculative_tokens=0)."""

    def __init__(self, bundle: Path, dtype: str, threads: int, k: int, log_path: Path, compile_mode: str = "auto"):
        spec = ["--speculative", "ngram", "--num-speculative-tokens", str(k)]
        super().__init__(bundle, dtype, None, threads, True, log_path, compile_mode, extra_flags=spec)


def stream_one(client, ids: list[int], n_gen: int, k: int, timeout_s: float) -> dict[str, Any]:
    """One streamed greedy request: decode tok/s, its token ids, its Usage's speculation counters."""
    arrivals: list[tuple[float, int]] = []
    tokens: list[int] = []
    usage = None
    t0 = time.perf_counter()
    stream = client.generate_stream(
        ids, timeout=timeout_s, max_new_tokens=n_gen, ignore_eos=True, temperature=0.0, num_speculative_tokens=k
    )
    for msg in stream:
        if msg.token_ids:
            arrivals.append((time.perf_counter(), len(msg.token_ids)))
            tokens.extend(msg.token_ids)
        if msg.usage is not None:
            usage = msg.usage
    t_end = time.perf_counter()
    if len(tokens) != n_gen or len(arrivals) < 2:
        raise llama_cpp.StepError(f"request returned {len(tokens)} tokens in {len(arrivals)} messages, not {n_gen}")
    span = arrivals[-1][0] - arrivals[0][0]
    return {
        "tok_s": (len(tokens) - arrivals[0][1]) / span if span > 0 else float("nan"),
        "first_message_tokens": arrivals[0][1],
        "messages": len(arrivals),
        "ttft_s": arrivals[0][0] - t0,
        "wall_s": t_end - t0,
        "ids": tokens,
        "completion_tokens": usage.completion_tokens if usage else len(tokens),
        "draft_tokens": usage.draft_tokens if usage else 0,
        "accepted_draft_tokens": usage.accepted_draft_tokens if usage else 0,
        "decode_steps": usage.decode_steps if usage else 0,
    }


def speculation_totals(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    drafted = sum(r["draft_tokens"] for r in runs)
    accepted = sum(r["accepted_draft_tokens"] for r in runs)
    steps = sum(r["decode_steps"] for r in runs)
    return {
        "draft_tokens": drafted,
        "accepted_draft_tokens": accepted,
        "acceptance": accepted / drafted if drafted else 0.0,
        "tokens_per_step": sum(r["completion_tokens"] for r in runs) / steps if steps else 0.0,
    }


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or of the shorter one's end), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def many_streams(target: str, prompts: list[dict], n_gen: int, k: int, timeout_s: float) -> dict[str, Any]:
    """STREAMS concurrent streamed requests (the prompts repeated): total generated tokens / wall time."""
    from inference_svc.client import NO_RETRY, TandemClient

    jobs = [prompts[i % len(prompts)] for i in range(STREAMS)]
    with TandemClient(target, retry=NO_RETRY, timeout=timeout_s) as c, concurrent.futures.ThreadPoolExecutor(16) as ex:
        t0 = time.perf_counter()
        futures = [ex.submit(stream_one, c, p["ids"], n_gen, k, timeout_s) for p in jobs]
        runs = [f.result() for f in futures]
        wall = time.perf_counter() - t0
    total = sum(len(r["ids"]) for r in runs)
    per_request = [
        {**{k: v for k, v in r.items() if k != "ids"}, "prompt": p["name"]} for r, p in zip(runs, jobs, strict=True)
    ]
    return {
        "tok_s": total / wall,
        "tokens": total,
        "wall_s": wall,
        **speculation_totals(runs),
        "runs": per_request,
        "_ids": [r["ids"] for r in runs],
    }


def run_llama_bench(tools, gguf: Path, threads: int, args, results: dict[str, Any]) -> dict[str, Any]:
    """One `llama-bench -p 0 -n N_GEN` (its tg, the mean of its 5 reps), or {"status": "error", ...}."""
    try:
        lb = llama_cpp.bench(tools, gguf, threads, 0, args.n_gen, args.bench_timeout)
        if lb["raw"]:
            results["llama_cpp"]["build_commit"] = lb["raw"][0].get("build_commit", "?")
        log(f"  llama-bench tg{args.n_gen}: {lb['tg']:.1f} tok/s")
        return lb
    except (llama_cpp.StepError, KeyError, ValueError) as exc:
        results["errors"].append(f"llama-bench t{threads}: {exc}")
        print(f"error: llama-bench t{threads}: {str(exc).splitlines()[0]}", file=sys.stderr)
        return {"status": "error", "error": str(exc)}


def median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median tok/s (the lower middle one for an even count), with every round's tok/s beside
    it and the streams that differed from batch-1 plain in any round."""
    ranked = sorted(runs, key=lambda s: s["tok_s"])
    mid = dict(ranked[(len(ranked) - 1) // 2])
    mid["rounds_tok_s"] = [s["tok_s"] for s in runs]
    mid["differs_from_batch1_plain"] = [d for s in runs for d in s["differs_from_batch1_plain"]]
    mid["background_cpu_busy"] = max(s["background_cpu_busy"] for s in runs)
    return mid


def tandem_case(bundle: Path, dtype: str, threads: int, prompts: list[dict], args, out_dir: Path) -> dict:
    from inference_svc.client import NO_RETRY, TandemClient

    log_path = out_dir / "servers" / f"t{threads}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = SpecServer(bundle, dtype, threads, args.k, log_path, args.compile)
    result: dict[str, Any] = {"server_command": shlex.join(server.cmd)}
    try:
        server.wait_serving(args.server_timeout)
        timeout = args.request_timeout
        with TandemClient(server.target, retry=NO_RETRY, timeout=timeout) as c:
            info = c.model_info()
            result["dtype"] = info.dtype
            result["compiled"], result["compile_seconds"] = info.compiled, info.compile_seconds
            log(f"  Tandem: compiled in {info.compile_seconds:.0f} s" if info.compiled else "  Tandem: eager")
            warm = prompts[0]["ids"][: max(8, len(prompts[0]["ids"]) // 2)]
            for k in (0, args.k):  # warm-up: both paths (a verify step is a T = K + 1 forward)
                stream_one(c, warm, min(args.n_gen, 16), k, timeout)
            result["background_cpu_busy"] = cpu_peer.wait_quiet(args.quiet_wait, args.quiet_below)
            log(f"  Tandem batch-1 (other work on the CPUs: {result['background_cpu_busy']:.0%})")
            plain, spec = [], []
            for i, p in enumerate(prompts):
                # both timed runs find the prompt in the prefix cache: a cached prompt's last token runs as a short
                # chunk (the row kernel), an uncached one's in the prefill GEMM, which may round otherwise (bf16)
                stream_one(c, p["ids"], 2, 0, timeout)
                order = (0, args.k) if i % 2 == 0 else (args.k, 0)
                got = {k: stream_one(c, p["ids"], args.n_gen, k, timeout) for k in order}
                plain.append(got[0])
                spec.append(got[args.k])
                s = got[args.k]
                log(f"    {p['name']}: plain {got[0]['tok_s']:.1f} tok/s, speculative {s['tok_s']:.1f} tok/s, "
                    f"{s['accepted_draft_tokens']}/{s['draft_tokens']} drafts kept")  # fmt: skip
        mismatches = []
        for p, a, b in zip(prompts, plain, spec, strict=True):
            at = first_difference(a["ids"], b["ids"])
            if at is not None:
                mismatches.append({"prompt": p["name"], "first_difference": at, "plain": a["ids"][at : at + 8],
                                   "speculative": b["ids"][at : at + 8]})  # fmt: skip
        result.update(
            plain={"tok_s": statistics.mean(r["tok_s"] for r in plain), **speculation_totals(plain)},
            speculative={"tok_s": statistics.mean(r["tok_s"] for r in spec), **speculation_totals(spec)},
            greedy_identical=not mismatches,
            mismatches=mismatches,
            per_prompt=[
                {"prompt": p["name"], "plain": {k: v for k, v in a.items() if k != "ids"},
                 "speculative": {k: v for k, v in b.items() if k != "ids"}}
                for p, a, b in zip(prompts, plain, spec, strict=True)
            ],
        )  # fmt: skip
        rounds: dict[str, list[dict[str, Any]]] = {"plain": [], "speculative": []}
        reference = {p["name"]: a["ids"] for p, a in zip(prompts, plain, strict=True)}
        for r in range(args.stream_rounds):  # alternating order: a drift in the machine's speed hits both alike
            cases = (("plain", 0), ("speculative", args.k))
            for name, k in cases if r % 2 == 0 else cases[::-1]:
                busy = cpu_peer.wait_quiet(args.quiet_wait, args.quiet_below)
                log(f"  Tandem {STREAMS} streams, {name}, round {r + 1} (other work on the CPUs: {busy:.0%})")
                s = many_streams(server.target, prompts, args.n_gen, k, timeout)
                ids = s.pop("_ids")
                diffs = [
                    (q["prompt"], first_difference(reference[q["prompt"]], t))
                    for q, t in zip(s["runs"], ids, strict=True)
                ]
                s["differs_from_batch1_plain"] = [
                    {"prompt": n, "first_difference": at} for n, at in diffs if at is not None
                ]
                if s["differs_from_batch1_plain"]:
                    log(f"    {len(s['differs_from_batch1_plain'])} of {STREAMS} streams differ from batch-1 plain")
                s["background_cpu_busy"] = busy
                rounds[name].append(s)
                log(f"    {s['tok_s']:.1f} tok/s ({s['tokens']} tokens in {s['wall_s']:.1f} s), "
                    f"{s['accepted_draft_tokens']}/{s['draft_tokens']} drafts kept")  # fmt: skip
        result["streams"] = {name: median_round(runs) for name, runs in rounds.items()}
        # each round's speculative / plain, the two run back to back: less exposed to the machine's drift than the
        # ratio of the two medians
        paired = [sp["tok_s"] / pl["tok_s"] for pl, sp in zip(rounds["plain"], rounds["speculative"], strict=True)]
        result["streams_ratio_rounds"] = paired
        result["streams_ratio"] = statistics.median(paired)
        result["status"] = "ok"
        return result
    finally:
        server.close()


# ------------------------------------------------------------------------------------------------ report
def fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None or x != x else f"{x:,.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"Speculative decoding benchmark, {results['date']}: {m['model']}, {m['cores']} cores "
        f"({cpu_peer.flags_line(m)}); "
        f"llama.cpp from llama-cpp-python {results['llama_cpp'].get('version', '?')} "
        f"(`{results['llama_cpp'].get('build_commit', '?')}`), GGML_NATIVE=ON.",
        f"Model: `{results['bundle']}` ({results['dtype']} ↔ {results['gguf_type']}); {len(results['prompts'])} "
        f"held-out code-completion prompts of ~{results['prompt_tokens']} tokens "
        f"({', '.join(p['name'] for p in results['prompts'])}), {results['n_gen']} tokens greedy, ignore_eos, "
        f"K = {results['k']} drafted tokens at most.",
        f"Command: `{results['command']}`",
        "",
        "| threads | llama-bench tg | llama-lookup tok/s (acceptance) | Tandem plain | Tandem speculative | "
        "speculative / llama-bench (goal ≥ 1.0) | acceptance | tokens/step | greedy identical | "
        f"{STREAMS} streams plain | {STREAMS} streams speculative | {STREAMS} streams speculative / plain |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|:-:|--:|--:|--:|",
    ]
    for c in results["cases"]:
        lb, lk, td = c.get("llama_bench", {}), c.get("llama_lookup", {}), c.get("tandem", {})
        lbt = fmt(lb.get("tg")) if "tg" in lb else lb.get("status", "error")
        lkt = (f"{fmt(lk['tok_s'])} ({lk['acceptance']:.0%})" if lk.get("status") == "ok"
               else lk.get("status", "error"))  # fmt: skip
        if td.get("status") != "ok":
            status = td.get("status", "error")
            lines.append(f"| {c['threads']} | {lbt} | {lkt} | {status} | {status} | – | – | – | – | – | – | – |")
            continue
        sp, pl, st = td["speculative"], td["plain"], td["streams"]
        ratio = fmt(sp["tok_s"] / lb["tg"], 2) if lb.get("tg") else "–"
        lines.append(
            f"| {c['threads']} | {lbt} | {lkt} | {fmt(pl['tok_s'])} | {fmt(sp['tok_s'])} | {ratio} "
            f"| {sp['acceptance']:.0%} | {sp['tokens_per_step']:.2f} | {'yes' if td['greedy_identical'] else 'NO'} "
            f"| {fmt(st['plain']['tok_s'])} | {fmt(st['speculative']['tok_s'])} "
            f"| {fmt(td['streams_ratio'], 2) if 'streams_ratio' in td else '–'} |"
        )
    lines += [
        "",
        f"tok/s. llama-bench: `-p 0 -n {results['n_gen']}`, the mean of two runs (each its mean over 5 reps), one "
        "before the llama-lookup and Tandem cases and one after. llama-lookup: `--spec-draft-n-max "
        f"{results['k']} --temp 0 --ignore-eos`, per prompt (n_predict - 1) / its decode time, mean over prompts; "
        "acceptance n_accept / n_drafted. Tandem: served over gRPC, batch 1, per prompt tokens after the first "
        "message's / their arrival span, mean over prompts; acceptance and tokens/step from Usage "
        "(accepted / drafted, completion tokens / decode steps). Greedy identical: the speculative token ids "
        "equal the plain ones for every prompt (each prompt is sent once for two tokens first, so that both timed "
        f"runs find it in the prefix cache). {STREAMS} streams: the prompts repeated to {STREAMS} concurrent "
        "requests, all generated tokens / wall time, the median of the rounds; speculative / plain: the median of "
        "each round's ratio (the two run back to back).",
    ]
    lines += [f"Note: {n}" for n in results["notes"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "results" / "speculative", help="folder for speculative.json")
    p.add_argument("--bundle", type=Path, default=None, help="bundle made by `tandem train` (default: newest demo)")
    p.add_argument("--runs", type=Path, default=REPO / "runs", help="where the default bundle is looked for")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="override the bundle's dtype")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--prompts", type=int, default=8, help="held-out code-completion prompts")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (cut at the next line boundary)")
    p.add_argument("--n-gen", type=int, default=128, help="generated tokens per request")
    p.add_argument("--num-speculative-tokens", "-k", dest="k", type=int, default=4,
                   help="most drafted tokens per step (Tandem and llama-lookup --draft)")  # fmt: skip
    p.add_argument("--llama-cpp-version", default=llama_cpp.VERSION, help="llama-cpp-python sdist to build from")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds a server may take to report SERVING")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline of one request in seconds")
    p.add_argument("--bench-timeout", type=float, default=1200.0, help="seconds one llama-bench call may take")
    p.add_argument("--lookup-timeout", type=float, default=600.0, help="seconds one llama-lookup call may take")
    p.add_argument("--no-lookup", action="store_true", help="skip llama-lookup (and its build)")
    p.add_argument("--no-install", action="store_true", help="fail instead of pip-installing converter deps")
    p.add_argument(
        "--stream-rounds",
        type=int,
        default=5,
        help=f"rounds of the {STREAMS}-stream case, plain and speculative alternating; the median is kept",
    )
    p.add_argument("--quiet-wait", type=float, default=0.0, help="seconds to wait before each case for a calm CPU")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="`tandem serve --compile` mode")
    p.add_argument("--quiet-below", type=float, default=0.1, help="share of the CPUs that counts as calm")
    args = p.parse_args(argv)
    args.thread_counts = [int(t) for t in args.threads.split(",") if t.strip()]
    if not args.thread_counts or min(args.thread_counts) < 1:
        p.error("--threads must be positive integers")
    if args.prompts < 1 or args.prompt_tokens < 1 or args.n_gen < 2 or not 1 <= args.k <= 16 or args.stream_rounds < 1:
        p.error("--prompts, --prompt-tokens and --stream-rounds must be positive, --n-gen at least 2, -k in 1..16")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    exe = os.path.relpath(sys.executable) if sys.executable.startswith(str(REPO)) else sys.executable
    command = shlex.join([exe, *(sys.argv if argv is None else [__file__, *argv])])
    bundle = args.bundle or newest_demo_bundle(args.runs)
    if bundle is None or not (bundle / "config.json").is_file():
        where = bundle if bundle is not None else f"{args.runs}/demo-*/bundle"
        print(f"error: no trained bundle at {where}; make one with: {MAKE_BUNDLE}", file=sys.stderr)
        return 1
    bundle = bundle.resolve()
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    cpu = cpu_peer.cpu_summary()
    try:
        dtype = args.dtype or bundle_dtype(bundle)
    except (llama_cpp.StepError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    gtype = GGUF_TYPES[dtype]
    results: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "machine": cpu,
        "bundle": os.path.relpath(bundle, REPO) if bundle.is_relative_to(REPO) else str(bundle),
        "dtype": dtype,
        "dtype_source": "--dtype" if args.dtype else "the bundle's config.json",
        "gguf_type": gtype,
        "prompt_tokens": args.prompt_tokens,
        "n_gen": args.n_gen,
        "k": args.k,
        "notes": [],
        "cases": [],
        "errors": [],
    }
    log(f"speculative: {cpu['model']}, {cpu['cores']} cores, {cpu_peer.flags_line(cpu)}")
    log(f"bundle {bundle} ({dtype}, {results['dtype_source']})")

    from shared_model.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(bundle)
    data = data_section(bundle)
    try:
        docs = heldout_documents(data)
    except Exception as exc:  # shared_model.errors.SharedModelError: an extra file pattern that matches nothing
        print(f"error: the run's corpus (data section of {bundle.parent / 'config.yaml'}): {exc}", file=sys.stderr)
        return 1
    prompts = pick_prompts(docs, tokenizer.encode, args.prompts, args.prompt_tokens, args.n_gen)
    results["heldout"] = {"documents": len(docs), "val_fraction": float(data.get("val_fraction", 0.02)),
                          "data_section": "run config.yaml" if data else "defaults"}  # fmt: skip
    results["prompts"] = [{"name": p["name"], "tokens": len(p["ids"]), "chars": len(p["text"])} for p in prompts]
    if not prompts:
        print(
            f"error: none of {len(docs)} held-out documents has {args.prompt_tokens + args.n_gen} tokens",
            file=sys.stderr,
        )
        return 1
    if len(prompts) < args.prompts:
        results["notes"].append(f"only {len(prompts)} held-out documents are long enough for {args.prompts} prompts")
    log(f"prompts: {len(prompts)} of {len(docs)} held-out documents: "
        + ", ".join(f"{p['name']} ({len(p['ids'])} tokens)" for p in prompts))  # fmt: skip

    try:
        tools = llama_cpp.ensure_tools(args.llama_cpp_version, log=lambda m, **_: log(m))
    except llama_cpp.StepError as exc:
        print(f"error: llama.cpp build: {exc}", file=sys.stderr)
        return 1
    results["llama_cpp"] = {"version": tools.version, "tools_build_s": tools.info.get("build_s"),
                            "cmake_flags": tools.info.get("cmake_flags"), "build_commit": "?"}  # fmt: skip
    lookup_bin, why_not = None, "--no-lookup"
    if not args.no_lookup:
        try:
            ex = llama_cpp.ensure_examples(tools, ["llama-lookup"], log=lambda m, **_: log(m))
            lookup_bin, why_not = ex.bins["llama-lookup"], ""
            state = "cached build" if ex.cached else "built now"
            log(f"llama-lookup ({state}; the build took {ex.info.get('build_s', 0):.0f} s on {ex.info.get('built_at')}"
                f" with {ex.info.get('jobs')} jobs): {lookup_bin}")  # fmt: skip
            results["llama_cpp"]["lookup"] = {
                "binary": str(lookup_bin),
                "build_s": ex.info.get("build_s"),
                "built_now": not ex.cached,
                "cmake_flags": ex.info.get("cmake_flags"),
            }
        except llama_cpp.StepError as exc:
            why_not = f"llama-lookup build failed: {str(exc).splitlines()[0]}"
            log(f"  {why_not}")
            results["notes"].append(why_not)
    try:
        installed = llama_cpp.ensure_converter(tools.source, not args.no_install)
        if installed:
            results["notes"].append(f"installed for convert_hf_to_gguf.py: {' '.join(installed)}")
        pre = pre_tokenizer_for(bundle)
        gguf, mapped = make_gguf(tools, bundle, gtype, pre)
    except (llama_cpp.StepError, subprocess.TimeoutExpired) as exc:
        print(f"error: GGUF conversion: {exc}", file=sys.stderr)
        return 1
    results["gguf"] = str(gguf)
    if mapped:
        results["notes"].append(f"the bundle's tokenizer is unknown to convert_hf_to_gguf.py's pre-tokenizer table; "
                                f"it was mapped to llama.cpp's {pre!r} (the same split as the bundle's ByteLevel "
                                "regex when 'gpt-2')")  # fmt: skip

    mismatch = False
    for threads in args.thread_counts:
        case: dict[str, Any] = {"threads": threads}
        case["background_cpu_busy"] = cpu_peer.wait_quiet(args.quiet_wait, args.quiet_below)
        log(f"[{threads}T] llama-bench (other work on the CPUs: {case['background_cpu_busy']:.0%})")
        lb = run_llama_bench(tools, gguf, threads, args, results)
        case["llama_bench"] = lb
        busy = cpu_peer.wait_quiet(args.quiet_wait, args.quiet_below) if lookup_bin else float("nan")
        log(f"[{threads}T] llama-lookup (other work on the CPUs: {busy:.0%})")
        lk = lookup_case(lookup_bin, why_not, gguf, threads, prompts, args, out_dir)
        lk["background_cpu_busy"] = busy
        case["llama_lookup"] = lk
        if lk["status"] == "ok":
            log(f"  llama-lookup: {lk['tok_s']:.1f} tok/s, acceptance {lk['acceptance']:.0%}")
            if not lk["prompt_tokens_as_tandem"] and threads == args.thread_counts[0]:
                counts = ", ".join(f"{r['n_input']:.0f} vs {r['tandem_prompt_tokens']}" for r in lk["runs"])
                results["notes"].append(f"llama-lookup tokenized the prompt texts differently ({counts} tokens)")
        else:
            log(f"  llama-lookup: not run ({lk['reason']})")
        log(f"[{threads}T] Tandem")
        try:
            td = tandem_case(bundle, dtype, threads, prompts, args, out_dir)
        except Exception as exc:  # one case failing must not lose the others
            td = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            results["errors"].append(f"tandem t{threads}: {td['error']}")
            print(f"error: tandem t{threads}: {td['error'].splitlines()[0]}", file=sys.stderr)
        case["tandem"] = td
        if lb.get("status") != "error":  # again after Tandem: the machine's speed drifts; the mean brackets both
            busy = cpu_peer.wait_quiet(args.quiet_wait, args.quiet_below)
            log(f"[{threads}T] llama-bench again (other work on the CPUs: {busy:.0%})")
            again = run_llama_bench(tools, gguf, threads, args, results)
            if again.get("status") != "error":
                lb["tg_runs"] = [lb["tg"], again["tg"]]
                lb["tg"] = statistics.mean(lb["tg_runs"])
                log(f"  llama-bench tg{args.n_gen}: {lb['tg']:.1f} tok/s, the mean of the two runs")
        if td.get("status") == "ok":
            log(f"  Tandem: plain {td['plain']['tok_s']:.1f} tok/s, speculative {td['speculative']['tok_s']:.1f} "
                f"tok/s, acceptance {td['speculative']['acceptance']:.0%}, {td['speculative']['tokens_per_step']:.2f} "
                "tokens/step")  # fmt: skip
            for name, st in td["streams"].items():
                if st["differs_from_batch1_plain"]:
                    results["notes"].append(
                        f"{threads}T, {STREAMS} streams {name}: {len(st['differs_from_batch1_plain'])} of {STREAMS} "
                        "greedy outputs differ from the same prompt's batch-1 plain output (first differing token per "
                        "stream in the JSON): batched decode is not bit-identical to batch 1 here"
                    )
            for mm in td["mismatches"]:
                mismatch = True
                print(f"GREEDY MISMATCH t{threads} {mm['prompt']}: first difference at token {mm['first_difference']}"
                      f": plain {mm['plain']} vs speculative {mm['speculative']}", file=sys.stderr)  # fmt: skip
        results["cases"].append(case)

    busy = [b for c in results["cases"] for b in _busy_readings(c) if b == b]
    results["background_cpu_busy_max"] = max(busy) if busy else None
    if busy and max(busy) > 0.15:
        results["notes"].append(
            f"other work on the machine used up to {max(busy):.0%} of its CPUs just before a case (median "
            f"{statistics.median(busy):.0%}; background_cpu_busy per case in the JSON): the figures are noisy"
        )
    if mismatch:
        results["errors"].append("greedy output differed with speculation (see mismatches in the JSON)")
    results["wall_s"] = time.monotonic() - t_start
    (out_dir / "speculative.json").write_text(json.dumps(results, indent=1) + "\n")
    log("")
    log(markdown(results))
    log("")
    log(f"wrote {out_dir / 'speculative.json'}; wall time {results['wall_s']:.0f} s")
    return 1 if results["errors"] else 0


def _busy_readings(case: dict[str, Any]) -> list[float]:
    td = case.get("tandem", {})
    out = [case.get("background_cpu_busy", float("nan")), case.get("llama_lookup", {}).get("background_cpu_busy")]
    out += [td.get("background_cpu_busy")] + [s.get("background_cpu_busy") for s in td.get("streams", {}).values()]
    return [float(b) for b in out if b is not None]


if __name__ == "__main__":
    sys.exit(main())
