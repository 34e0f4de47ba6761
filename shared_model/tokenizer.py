"""Tokenizer: byte-level BPE trained with the `tokenizers` library, or any `tokenizer.json` loaded as is.

Contract:
- `Tokenizer.train(texts, vocab_size)` builds a byte-level BPE with special tokens pad, bos, eos (ids 0, 1, 2).
  Byte-level means every Unicode string encodes, and `decode(encode(s)) == s` exactly.
- `Tokenizer.load(folder_or_file)` reads `tokenizer.json` (+ `tokenizer_config.json` for the special tokens when
  present) written by Tandem or by Hugging Face.
- `save(folder)` writes `tokenizer.json` and `tokenizer_config.json` that transformers' `AutoTokenizer` reads.
- A loaded Hugging Face tokenizer keeps what its folder says beyond the vocabulary: the `chat_template` (from
  `chat_template.jinja` when the folder has one, else from tokenizer_config.json) and every other
  tokenizer_config.json key (`added_tokens_decoder`, `additional_special_tokens`, `tokenizer_class`, ...).
  `save` writes them back the way they came (a `chat_template.jinja` file stays a file), so load → save → load
  keeps the chat template and the special tokens of a fine-tuned model's source folder.
- `encode(text)` tokenizes as transformers does: special-token text typed in `text` (e.g. `<|eos|>`) becomes that
  control token, which keeps parity for plain prompts. `encode(text, literal=True)` never produces a control token
  from text (it is split like ordinary characters): for text a user typed inside a structure Tandem renders
  itself, such as a chat message's content.
- Long texts (over `_GIL_FREE_CHARS`) go through the library's batch path, which releases the GIL while it works,
  so one big prompt does not stall the other threads of a server.
- `fingerprint()` identifies the tokenization (vocabulary, merges, normalizers, special tokens) for cache keys.
- `max_chars_per_token`: an upper bound on the characters of text one token can stand for; a text longer than
  `n * max_chars_per_token` cannot encode to `n` tokens or fewer (used to refuse oversized prompts unread).
- Immutable after construction apart from caches built on first use (the literal copy, the character bound, the
  id → string table),
  which a race can only build twice; safe to share between threads.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from shared_model.errors import TokenizerError

_GIL_FREE_CHARS = 4096
"""Texts longer than this are encoded with the GIL released (the batch path; the same ids)."""
_NORMALIZER_SLACK = 4
"""A normalizer can shrink text (NFC composes up to ~3 characters into one): the bound allows for it."""

CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"


class Tokenizer:
    """Text ↔ token ids, with optional bos/eos/pad tokens."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        bos_token: str | None = BOS_TOKEN,
        eos_token: str | None = EOS_TOKEN,
        pad_token: str | None = PAD_TOKEN,
        model_max_length: int | None = None,
        chat_template: str | list | None = None,
        config_extra: dict | None = None,
        chat_template_file: bool = False,
    ) -> None:
        self._tk = tokenizer
        self.chat_template = chat_template
        """The folder's chat template (a Jinja string, or HF's list of {name, template}), or None."""
        self.config_extra: dict = dict(config_extra or {})
        """The source tokenizer_config.json without its chat_template, written back by `save` (the special tokens and
        model_max_length this object holds win where they differ)."""
        self.chat_template_file = chat_template_file
        """The template came from (and is saved to) chat_template.jinja rather than tokenizer_config.json."""
        self._literal_tk: HFTokenizer | None = None  # built on first use of `literal=True`
        self._max_chars_per_token: int | None = None
        self._token_strings: tuple[str, ...] | None = None
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.model_max_length = model_max_length
        self.bos_id = self._id_of(bos_token)
        self.eos_id = self._id_of(eos_token)
        self.pad_id = self._id_of(pad_token)

    def __getstate__(self) -> dict:
        """Pickled without the caches built on first use: they are rebuilt where it is unpickled (the literal copy
        would lose its `encode_special_tokens` flag, which the library does not pickle)."""
        return {**self.__dict__, "_literal_tk": None, "_token_strings": None, "_max_chars_per_token": None}

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self._tk.token_to_id(token)
        if tid is None:
            raise TokenizerError(f"special token {token!r} is not in the vocabulary")
        return tid

    # ------------------------------------------------------------------ construction
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
        """Train a byte-level BPE on `texts`; the result has at most `vocab_size` entries."""
        specials = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + len(specials):
            raise TokenizerError(
                f"vocab_size must be at least {len(alphabet) + len(specials)} (256 bytes + 3 specials), "
                f"got {vocab_size}"
            )
        tk = HFTokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=specials,
            initial_alphabet=alphabet,
            show_progress=False,
        )
        tk.train_from_iterator(texts, trainer=trainer)
        return cls(tk)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` from a folder (or the file itself), with special tokens from its config."""
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenizerError(f"tokenizer file not found: {file}")
        try:
            tk = HFTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust library raises plain Exception subclasses
            raise TokenizerError(f"cannot parse {file}: {exc}") from exc
        specials: dict[str, str | None] = {"bos_token": None, "eos_token": None, "pad_token": None}
        max_len = None
        cfg: dict = {}
        cfg_file = folder / CONFIG_FILE
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as exc:
                raise TokenizerError(f"{cfg_file} is not valid JSON: {exc}") from exc
            if not isinstance(cfg, dict):
                raise TokenizerError(f"{cfg_file} must hold a JSON object")
            for key in specials:
                specials[key] = _token_str(cfg.get(key))
            max_len = cfg.get("model_max_length")
            if not isinstance(max_len, int) or max_len > 10**9:
                max_len = None
        elif tk.token_to_id(BOS_TOKEN) is not None:  # a Tandem tokenizer without its config
            specials = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
        template_file = folder / CHAT_TEMPLATE_FILE
        in_file = path.is_dir() and template_file.is_file()  # transformers reads the file first, so do we
        template = template_file.read_text() if in_file else cfg.get("chat_template")
        extra = {k: v for k, v in cfg.items() if k != "chat_template"}
        return cls(
            tk,
            model_max_length=max_len,
            chat_template=template,
            config_extra=extra,
            chat_template_file=in_file,
            **specials,
        )

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json into `folder` (which must exist)."""
        folder = Path(folder)
        self._tk.save(str(folder / "tokenizer.json"))
        config: dict = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        if self.config_extra:  # a loaded folder's keys, as found (no Tandem defaults added to them)
            config.update(self.config_extra)
        else:
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **config,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
            }
        for key in ("bos_token", "eos_token", "pad_token"):  # a {"content": ...} entry naming the same token stays
            if _token_str(config[key]) != getattr(self, key):
                config[key] = getattr(self, key)
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        if self.chat_template is not None and self.chat_template_file:
            (folder / CHAT_TEMPLATE_FILE).write_text(str(self.chat_template))
        elif self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    def fingerprint(self) -> str:
        """SHA-256 of what tokenizing depends on: the tokenizer.json content and the bos/eos/pad tokens."""
        digest = hashlib.sha256(self._tk.to_str().encode())
        digest.update(json.dumps([self.bos_token, self.eos_token, self.pad_token]).encode())
        return digest.hexdigest()

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False, literal: bool = False) -> list[int]:
        """Token ids of `text`; `literal=True`: special-token text in it stays text (see the module docstring)."""
        tk = self._literal() if literal else self._tk
        if len(text) > _GIL_FREE_CHARS:
            ids = tk.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = tk.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def _literal(self) -> HFTokenizer:
        """A copy of the tokenizer that splits special-token text like any text (the flag is per instance, not per
        call, so it lives on a copy; two threads racing here build two equal copies, and one is kept)."""
        if self._literal_tk is None:
            literal = HFTokenizer.from_str(self._tk.to_str())
            literal.encode_special_tokens = True
            self._literal_tk = literal
        return self._literal_tk

    @property
    def max_chars_per_token(self) -> int:
        """Upper bound on the characters one token covers (its vocabulary string is at least as long as the text it
        encodes: byte-level symbols are one per byte, byte fallbacks `<0x41>` longer), with slack for normalizers."""
        if self._max_chars_per_token is None:
            longest = max((len(t) for t in self._tk.get_vocab(with_added_tokens=True)), default=1)
            slack = _NORMALIZER_SLACK if self._tk.normalizer is not None else 1
            self._max_chars_per_token = max(1, longest) * slack
        return self._max_chars_per_token

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tk.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    def token_strings(self) -> tuple[str, ...]:
        """Every id's vocabulary string ("" for an unused id), built once: a long text's tokens then share these
        objects instead of allocating one string per token."""
        if self._token_strings is None:
            by_id = [""] * self.vocab_size
            for token, i in self._tk.get_vocab(with_added_tokens=True).items():
                if 0 <= i < len(by_id):
                    by_id[i] = token
            self._token_strings = tuple(by_id)
        return self._token_strings

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None)

    def control_ids(self) -> frozenset[int]:
        """Every control token's id: bos/eos/pad and each added token marked special (`<|im_end|>`, ...), whose
        text a grammar must never produce as content."""
        added = self._tk.get_added_tokens_decoder()
        return self.special_ids | frozenset(i for i, tok in added.items() if tok.special)


def _token_str(value: object) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None
