"""The default corpus: stdlib sources, user files, deterministic split."""

from __future__ import annotations

import pytest

from shared_model.corpus import CorpusConfig, in_validation, load_corpus, stdlib_files
from shared_model.errors import SharedModelError


def test_stdlib_is_found_and_sorted():
    files = stdlib_files()
    assert len(files) > 500
    assert files == sorted(files)
    assert any(f.name == "os.py" for f in files)
    assert not any("site-packages" in f.parts for f in files)


def test_split_is_deterministic_and_disjoint():
    a = load_corpus(CorpusConfig(max_documents=300, val_fraction=0.1))
    b = load_corpus(CorpusConfig(max_documents=300, val_fraction=0.1))
    assert [d.name for d in a.val] == [d.name for d in b.val]
    assert a.val and a.train
    assert not {d.name for d in a.train} & {d.name for d in a.val}
    assert all(in_validation(d.name, 0.1) for d in a.val)
    # growing the corpus never moves an existing document between splits
    c = load_corpus(CorpusConfig(max_documents=400, val_fraction=0.1))
    assert {d.name for d in a.val} <= {d.name for d in c.val}


def test_extra_files_and_globs(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("world")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00")
    corpus = load_corpus(CorpusConfig(include_stdlib=False, extra=(str(tmp_path / "**" / "*.txt"),), val_fraction=0))
    assert sorted(d.text for d in corpus.train) == ["hello", "world"]
    assert corpus.skipped == [str(tmp_path / "bad.txt")]
    with pytest.raises(SharedModelError, match="matches no file"):
        load_corpus(CorpusConfig(include_stdlib=False, extra=(str(tmp_path / "*.md"),)))
    with pytest.raises(SharedModelError, match="val_fraction"):
        CorpusConfig(val_fraction=1.5)
