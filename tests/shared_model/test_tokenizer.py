"""Tokenizer: exact Unicode round trips (property-based), special tokens, save/load, transformers compatibility."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_model.errors import TokenizerError
from shared_model.tokenizer import BOS_TOKEN, EOS_TOKEN, Tokenizer


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_any_unicode(small_tokenizer, text):
    assert small_tokenizer.decode(small_tokenizer.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["def ", "🤖", "\u0301", "中文", "\r\n", "\x00", EOS_TOKEN, " ", "é"]), max_size=30))
def test_round_trip_mixed_scripts_and_specials(small_tokenizer, parts):
    text = "".join(parts)
    assert small_tokenizer.decode(small_tokenizer.encode(text)) == text


def test_special_tokens_and_bos(small_tokenizer):
    tk = small_tokenizer
    assert (tk.pad_id, tk.bos_id, tk.eos_id) == (0, 1, 2)
    assert tk.encode("x", add_bos=True)[0] == tk.bos_id
    assert tk.decode([tk.bos_id, *tk.encode("hi")], skip_special_tokens=True) == "hi"
    assert tk.vocab_size == 512
    assert tk.encode("import os") and len(tk.encode("import os")) < len("import os")  # BPE merged something


def test_save_load_and_transformers(tmp_path, small_tokenizer):
    small_tokenizer.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    text = "for i in range(10):\n    print(i)  # ünïcödé"
    assert loaded.encode(text) == small_tokenizer.encode(text)
    assert loaded.bos_token == BOS_TOKEN
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.encode(text, add_special_tokens=False) == small_tokenizer.encode(text)
    assert hf.eos_token_id == small_tokenizer.eos_id


def test_errors(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer file not found"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot parse"):
        Tokenizer.load(tmp_path)
    with pytest.raises(TokenizerError, match="vocab_size must be at least 259"):
        Tokenizer.train(["abc"], vocab_size=100)


def test_pickled_tokenizer_keeps_plain_and_literal_encoding(small_tokenizer):
    """A tokenizer process gets its tokenizer pickled: caches built before (the literal copy) must not carry over
    without their flag. Fails if the literal copy is pickled as is (`<|eos|>` turns into a control token)."""
    import pickle

    text = f"a {EOS_TOKEN} b"
    literal = small_tokenizer.encode(text, literal=True)  # builds the literal copy before pickling
    copy = pickle.loads(pickle.dumps(small_tokenizer))
    assert copy.encode(text, literal=True) == literal and small_tokenizer.eos_id not in literal
    assert copy.encode(text) == small_tokenizer.encode(text) and small_tokenizer.eos_id in copy.encode(text)
    assert copy.token_strings() == small_tokenizer.token_strings()
    assert copy.max_chars_per_token == small_tokenizer.max_chars_per_token
