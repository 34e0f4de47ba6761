"""benchmarks/speculative.py's pure parts on fake inputs: prompt extraction, llama-lookup parsing, the table, the
default bundle and dtype; no server, no llama.cpp."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _load():
    if "speculative_bench" in sys.modules:
        return sys.modules["speculative_bench"]
    spec = importlib.util.spec_from_file_location("speculative_bench", ROOT / "benchmarks" / "speculative.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["speculative_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def words(text: str) -> list[int]:
    return [len(w) for w in text.split()]  # one "token" per word


def test_cut_prompt_ends_at_the_first_line_boundary_past_the_budget() -> None:
    sb = _load()
    text = "".join(f"w{i} x y\n" for i in range(10))  # 3 tokens a line
    cut = sb.cut_prompt(text, words, 7)
    assert cut == "".join(f"w{i} x y\n" for i in range(3))  # 9 tokens: the first line end at or after 7
    assert sb.cut_prompt(text, words, 9) == cut
    assert sb.cut_prompt(text, words, 30) == text
    assert sb.cut_prompt(text, words, 31) is None
    assert sb.cut_prompt("", words, 1) is None


def test_pick_prompts_skips_short_documents_and_spreads_over_the_rest() -> None:
    sb = _load()
    long_doc = "".join(f"a b c d\n{i}\n" for i in range(40))
    docs = [SimpleNamespace(name=f"d{i}.py", text=long_doc if i % 2 == 0 else "short\n") for i in range(10)]
    picked = sb.pick_prompts(docs, words, 3, 10, 20)
    assert [p["name"] for p in picked] == ["d0.py", "d2.py", "d6.py"]  # 5 usable (even), 3 spread over them
    assert all(p["text"].endswith("\n") and len(p["ids"]) >= 10 for p in picked)
    assert len(sb.pick_prompts(docs, words, 8, 10, 20)) == 5  # fewer when fewer qualify
    assert sb.pick_prompts(docs, words, 3, 10, 10_000) == []


def test_parse_lookup_reads_its_summary() -> None:
    sb = _load()
    out = """
encoded  259 tokens in    0.120 seconds, speed: 2158.333 t/s
decoded  129 tokens in    1.600 seconds, speed:   80.625 t/s

n_draft      = 4
n_predict    = 129
n_drafted    = 120
t_draft_flat = 0.05 ms
t_draft      = 1.00 ms, 8.33 us per token, 120000.00 tokens per second
n_accept     = 60
accept       = 50.000%
"""
    r = sb.parse_lookup(out)
    assert r["n_input"] == 259 and r["n_predict"] == 129 and r["n_drafted"] == 120 and r["n_accept"] == 60
    assert r["tok_s"] == pytest.approx(128 / 1.6) and r["acceptance"] == 0.5 and r["printed_tok_s"] == 80.625
    try:
        sb.parse_lookup("decoded  12 tokens in 1.0 seconds, speed: 12.0 t/s")
    except KeyError as exc:
        assert "encoded" in str(exc)
    else:
        raise AssertionError("a missing line must raise KeyError")


def test_first_difference() -> None:
    sb = _load()
    assert sb.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert sb.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert sb.first_difference([1, 2], [1, 2, 3]) == 2


def _fake_results(identical: bool) -> dict:
    spec = {"tok_s": 120.0, "acceptance": 0.5, "tokens_per_step": 1.8}
    streams = {"plain": {"tok_s": 300.0}, "speculative": {"tok_s": 310.0}}
    tandem = {"status": "ok", "plain": {"tok_s": 80.0}, "speculative": spec, "streams": streams,
              "streams_ratio": 1.04, "greedy_identical": identical}  # fmt: skip
    return {
        "date": "2026-12-01T18:00:00+00:00",
        "command": ".venv/bin/python benchmarks/speculative.py --threads 1,2",
        "machine": {
            "model": "Fake CPU",
            "cores": 2,
            "flags": dict.fromkeys(("avx512f", "avx512_bf16", "avx512_vnni"), True),
            "amx": False,
        },
        "llama_cpp": {"version": "0.3.36", "build_commit": "abc123"},
        "bundle": "runs/demo-x/bundle",
        "dtype": "float32",
        "gguf_type": "F32",
        "prompts": [{"name": "a.py"}, {"name": "b.py"}],
        "prompt_tokens": 256,
        "n_gen": 128,
        "k": 4,
        "notes": ["busy machine"],
        "cases": [
            {
                "threads": 1,
                "llama_bench": {"tg": 100.0},
                "llama_lookup": {"status": "ok", "tok_s": 150.0, "acceptance": 0.6},
                "tandem": tandem,
            },
            {
                "threads": 2,
                "llama_bench": {"status": "error"},
                "llama_lookup": {"status": "not run", "reason": "x"},
                "tandem": {"status": "error"},
            },
        ],
    }


def test_median_round_keeps_the_middle_run_and_every_rounds_figures() -> None:
    sb = _load()
    runs = [
        {"tok_s": 30.0, "tokens": 3, "differs_from_batch1_plain": [], "background_cpu_busy": 0.01},
        {"tok_s": 10.0, "tokens": 1, "differs_from_batch1_plain": [{"prompt": "a", "first_difference": 4}],
         "background_cpu_busy": 0.05},
        {"tok_s": 20.0, "tokens": 2, "differs_from_batch1_plain": [], "background_cpu_busy": 0.02},
    ]  # fmt: skip
    mid = sb.median_round(runs)
    assert (mid["tok_s"], mid["tokens"]) == (20.0, 2)
    assert mid["rounds_tok_s"] == [30.0, 10.0, 20.0]
    assert mid["differs_from_batch1_plain"] == [{"prompt": "a", "first_difference": 4}]  # from any round
    assert mid["background_cpu_busy"] == 0.05
    assert sb.median_round(runs[:2])["tok_s"] == 10.0  # an even count: the lower middle one
    assert runs[2]["differs_from_batch1_plain"] == []  # the inputs are not changed


def test_markdown_rows() -> None:
    sb = _load()
    text = sb.markdown(_fake_results(identical=True))
    rows = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert len(rows) == 3  # header + one row per thread count
    assert rows[1] == "| 1 | 100.0 | 150.0 (60%) | 80.0 | 120.0 | 1.20 | 50% | 1.80 | yes | 300.0 | 310.0 | 1.04 |"
    assert rows[2].startswith("| 2 | error | not run | error | error |")
    assert "avx512f yes" in text and "Command: `.venv/bin/python benchmarks/speculative.py" in text
    assert "Note: busy machine" in text
    assert "| NO |" in sb.markdown(_fake_results(identical=False))


def test_default_bundle_and_dtype(tmp_path: Path) -> None:
    sb = _load()
    assert sb.newest_demo_bundle(tmp_path) is None
    for name, dtype in (("demo-20261201-095011", "float32"), ("demo-20261201-145943", "bfloat16")):
        b = tmp_path / name / "bundle"
        b.mkdir(parents=True)
        (b / "config.json").write_text(json.dumps({"torch_dtype": dtype}))
    (tmp_path / "demo-20261202-000000").mkdir()  # a run without a bundle yet
    newest = sb.newest_demo_bundle(tmp_path)
    assert newest == tmp_path / "demo-20261201-145943" / "bundle"
    assert sb.bundle_dtype(newest) == "bfloat16"
    assert sb.data_section(newest) == {}
    assert sb.pre_tokenizer_for(newest) == "default"  # no tokenizer.json
    (newest / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": {"type": "ByteLevel", "use_regex": True}}))
    assert sb.pre_tokenizer_for(newest) == "gpt-2"


def test_examples_build_flags() -> None:
    _load()
    import llama_cpp

    flags = llama_cpp.example_flags(amx=False)
    assert "-DLLAMA_BUILD_EXAMPLES=ON" in flags and "-DLLAMA_BUILD_EXAMPLES=OFF" not in flags
    assert "-DLLAMA_BUILD_COMMON=ON" in flags and any(f.startswith("-DCMAKE_C_FLAGS=-mno-amx") for f in flags)
