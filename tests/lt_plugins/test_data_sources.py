"""Your own data: text globs and JSONL in `data.extra`, their one-line errors (file and line named), and the
tokenized-blocks cache key (the files' identity and the tokenizer are part of it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lt_plugins.config import DataSection
from lt_plugins.data import prepare_blocks
from lt_plugins.errors import TrainingConfigError
from shared_model.tokenizer import Tokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu "


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train([WORDS * 20, '0123456789 {}":,'], 300)


def _section(*extra: object, **kw: object) -> DataSection:
    base: dict = dict(include_stdlib=False, block_size=8, batch_size=1, val_fraction=0.0)
    base.update(kw)
    return DataSection(extra=[str(e) for e in extra], **base)


def _texts(tokenizer: Tokenizer, rows) -> str:  # type: ignore[no-untyped-def]
    return tokenizer.decode(rows.flatten().tolist())


def test_text_glob_reads_every_matching_file(tmp_path: Path, tokenizer: Tokenizer) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "one.txt").write_text("alpha beta " * 10)
    (tmp_path / "a" / "b" / "two.txt").write_text("gamma delta " * 10)
    (tmp_path / "a" / "skip.md").write_text("theta " * 10)
    blocks = prepare_blocks(_section(tmp_path / "a" / "**" / "*.txt"), tmp_path / "cache", 512, tokenizer)
    text = _texts(tokenizer, blocks.train)
    assert "alpha" in text and "gamma" in text and "theta" not in text


def test_jsonl_documents_come_from_the_field(tmp_path: Path, tokenizer: Tokenizer) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"id": i, "body": "kappa lambda " * 5, "text": "x"}) for i in range(4)) + "\n\n")
    blocks = prepare_blocks(_section(f, jsonl_field="body"), tmp_path / "cache", 512, tokenizer)
    assert "kappa lambda" in _texts(tokenizer, blocks.train) and '"id"' not in _texts(tokenizer, blocks.train)
    plain = tmp_path / "d.txt"  # format=jsonl reads any suffix as JSONL; auto reads .txt as text
    plain.write_text(f.read_text())
    assert '"id"' in _texts(tokenizer, prepare_blocks(_section(plain), tmp_path / "c2", 512, tokenizer).train)
    as_jsonl = prepare_blocks(_section(plain, format="jsonl", jsonl_field="body"), tmp_path / "c3", 512, tokenizer)
    assert '"id"' not in _texts(tokenizer, as_jsonl.train)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (['{"text": "mu mu"}', '{"text": "mu", oops}'], r"d\.jsonl line 2: invalid JSON"),
        (['{"text": "mu mu"}', "", '{"body": "mu"}'], r"d\.jsonl line 3 has no field 'text' \(data\.jsonl_field\)"),
        (['["text"]'], r"d\.jsonl line 1 is a JSON list, not an object with a field 'text'"),
        (['{"text": 7}'], r"d\.jsonl line 1: field 'text' is a int, not a string"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path: Path, tokenizer: Tokenizer, lines: list[str], expected: str) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(TrainingConfigError, match=r"^data\.extra: .*" + expected):
        prepare_blocks(_section(f), tmp_path / "cache", 512, tokenizer)


def test_glob_without_match_names_the_pattern(tmp_path: Path, tokenizer: Tokenizer) -> None:
    pattern = str(tmp_path / "nothing" / "**" / "*.jsonl")
    with pytest.raises(TrainingConfigError, match=rf"^data\.extra: path not found: {pattern}$".replace("*", r"\*")):
        prepare_blocks(_section(pattern), tmp_path / "cache", 512, tokenizer)
    with pytest.raises(TrainingConfigError, match=r"data\.format must be one of auto, text, jsonl"):
        _section(format="csv")


def test_cache_key_follows_files_and_tokenizer(tmp_path: Path, tokenizer: Tokenizer) -> None:
    f = tmp_path / "a.txt"
    f.write_text("alpha beta " * 10)
    cache = tmp_path / "cache"
    cfg = _section(f)
    first = prepare_blocks(cfg, cache, 512, tokenizer)
    assert len(list(cache.iterdir())) == 1
    again = prepare_blocks(cfg, cache, 512, tokenizer)  # unchanged: read back
    assert len(list(cache.iterdir())) == 1 and again.train.equal(first.train)
    f.write_text("gamma delta " * 10)  # same size, new content and mtime
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    edited = prepare_blocks(cfg, cache, 512, tokenizer)
    assert len(list(cache.iterdir())) == 2 and "gamma" in _texts(tokenizer, edited.train)
    other = Tokenizer.train([WORDS * 20], 280)
    assert other.fingerprint() != tokenizer.fingerprint()
    prepare_blocks(cfg, cache, 512, other)
    assert len(list(cache.iterdir())) == 3
