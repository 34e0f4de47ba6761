"""Which grammar engine constrains decoding faster: xgrammar or llguidance, on this machine's CPU.

For each engine that is installed, and a byte-level BPE vocabulary of 8,192 and of 151,936 tokens (Qwen's size;
built here from the words of the installed Python sources: prefix-chain merges, so every token is a real string and
the tokenizer loads in `tokenizers`, nothing downloaded), it measures:
- compile: seconds from a JSON schema to a ready matcher (a cold compile; tokenizer preparation is reported apart);
- mask: milliseconds to fill the token bitmask of 1 and of 16 rows at one step, while the matchers walk a valid
  document token by token (the mean over the document's tokens, each row advanced after each mask).

Prints one JSON line per (engine, vocabulary). Usage:
    python benchmarks/grammar_engines.py [--vocab 8192 151936] [--rows 1 16]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
        },
        "kind": {"enum": ["person", "robot", "other"]},
    },
    "required": ["name", "age", "email", "kind"],
    "additionalProperties": False,
}
DOC = (
    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"], '
    '"address": {"street": "St James Square", "city": "London"}, "kind": "person"}'
)


def build_tokenizer(vocab_size: int) -> HFTokenizer:
    """A byte-level BPE of exactly `vocab_size` tokens (3 specials, 256 bytes, then the most frequent words of the
    installed Python sources as prefix chains)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|pad|>", "<|bos|>", "<|eos|>"]
    vocab: dict[str, int] = {t: i for i, t in enumerate(specials)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    counts: collections.Counter[str] = collections.Counter()
    site = Path(sysconfig.get_paths()["purelib"])
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for i, f in enumerate(sorted(site.rglob("*.py"))):
        if i > 6000 or len(counts) > 4 * vocab_size:
            break
        try:
            text = f.read_text(errors="ignore")[:20000]
        except OSError:
            continue
        counts.update(w for w, _ in pre.pre_tokenize_str(text))
    merges: list[tuple[str, str]] = []
    for word, _ in counts.most_common():
        for j in range(2, len(word) + 1):
            if len(vocab) >= vocab_size:
                break
            piece = word[:j]
            if piece not in vocab:
                vocab[piece] = len(vocab)
                merges.append((word[: j - 1], word[j - 1]))
        if len(vocab) >= vocab_size:
            break
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre
    tk.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tk.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return tk


def bench_llguidance(tk: HFTokenizer, rows: list[int], doc_ids: list[int]) -> dict:
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tk.to_str(), eos_token=2)
    t_tok = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lltok, grammar)
    lt_mask = lt.allocate_token_bitmask(1, tk.get_vocab_size())
    lt.fill_next_token_bitmask(m, lt_mask, 0)  # the first mask is part of being ready
    t_compile = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    executor = llguidance.LLExecutor()
    out = {"engine": f"llguidance {_version('llguidance')}"}
    out.update(tokenizer_s=round(t_tok, 3), compile_s=round(t_compile, 4))
    for n, serial in [(r, s) for r in rows for s in ((False,) if r == 1 else (False, True))]:
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(n)]
        mask = lt.allocate_token_bitmask(n, tk.get_vocab_size())
        times = []
        for tok in doc_ids:
            t0 = time.perf_counter()
            if n == 1 or serial:
                for i, mm in enumerate(matchers):
                    lt.fill_next_token_bitmask(mm, mask, i)
            else:
                lt.fill_next_token_bitmask_par(executor, [(mm, i) for i, mm in enumerate(matchers)], mask)
            times.append(time.perf_counter() - t0)
            for mm in matchers:
                assert mm.consume_token(tok), mm.get_error()
        out[f"mask_ms_{n}" + ("_serial" if serial else "")] = round(1000 * sum(times) / len(times), 4)
    return out


def bench_xgrammar(tk: HFTokenizer, rows: list[int], doc_ids: list[int]) -> dict:
    import xgrammar as xgr

    size = tk.get_vocab_size()
    strings = [""] * size
    for t, i in tk.get_vocab(with_added_tokens=True).items():
        strings[i] = t
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(strings, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=size, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    m = xgr.GrammarMatcher(compiled)
    xm = xgr.allocate_token_bitmask(1, size)
    m.fill_next_token_bitmask(xm, 0)
    t_compile = time.perf_counter() - t0
    out = {
        "engine": f"xgrammar {_version('xgrammar')}",
        "tokenizer_s": round(t_tok, 3),
        "compile_s": round(t_compile, 4),
    }
    batch = xgr.BatchGrammarMatcher()
    for n, serial in [(r, s) for r in rows for s in ((False,) if r == 1 else (False, True))]:
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(n)]
        mask = xgr.allocate_token_bitmask(n, size)
        times = []
        for tok in doc_ids:
            t0 = time.perf_counter()
            if n == 1 or serial:
                for i, mm in enumerate(matchers):
                    mm.fill_next_token_bitmask(mask, i)
            else:
                batch.batch_fill_next_token_bitmask(matchers, mask)
            times.append(time.perf_counter() - t0)
            for mm in matchers:
                assert mm.accept_token(tok)
        out[f"mask_ms_{n}" + ("_serial" if serial else "")] = round(1000 * sum(times) / len(times), 4)
    return out


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192, 151936])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    torch.set_num_threads(1)
    for v in args.vocab:
        t0 = time.perf_counter()
        tk = build_tokenizer(v)
        built = time.perf_counter() - t0
        doc_ids = tk.encode(DOC).ids
        assert tk.decode(doc_ids) == DOC and re.search("Lovelace", DOC)
        for bench in (bench_llguidance, bench_xgrammar):
            try:
                res = bench(tk, args.rows, doc_ids)
            except ImportError as exc:
                print(f"# {bench.__name__}: not installed ({exc})", file=sys.stderr)
                continue
            print(json.dumps({"vocab": v, "doc_tokens": len(doc_ids), "tokenizer_built_s": round(built, 1), **res}))


if __name__ == "__main__":
    main()
