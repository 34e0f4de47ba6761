"""The default training corpus: the running interpreter's standard-library sources, plus the user's own files.

Contract:
- No download, ever. `stdlib_files()` lists the `.py` files under `sysconfig`'s stdlib path, excluding
  site-packages, sorted by path so every machine with the same Python lists them in the same order.
- `load_corpus(CorpusConfig)` reads them (and any extra files or glob patterns), skips files that are not valid
  UTF-8 (counted in `Corpus.skipped`), and splits documents into train/validation deterministically: a document
  goes to validation when the SHA-256 of its name falls under `val_fraction`. The split never depends on order,
  count or random state.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from shared_model.errors import SharedModelError


@dataclass(frozen=True)
class CorpusConfig:
    """Which text files make up the corpus."""

    include_stdlib: bool = True
    """Include the running interpreter's standard-library `.py` sources."""
    extra: tuple[str, ...] = ()
    """Additional files or glob patterns (`**` allowed)."""
    val_fraction: float = 0.02
    """Share of documents held out for validation (by hash of the document name)."""
    max_documents: int | None = None
    """Keep only the first N documents (in sorted order) — for fast tests."""

    def __post_init__(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise SharedModelError(f"corpus.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_documents is not None and self.max_documents <= 0:
            raise SharedModelError(f"corpus.max_documents must be > 0, got {self.max_documents}")


@dataclass(frozen=True)
class Document:
    name: str
    """Path relative to its root (stdlib files) or as given (extra files)."""
    text: str


@dataclass
class Corpus:
    train: list[Document] = field(default_factory=list)
    val: list[Document] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Files that were not valid UTF-8."""

    def texts(self, split: str = "train") -> list[str]:
        return [d.text for d in (self.train if split == "train" else self.val)]

    @property
    def num_bytes(self) -> int:
        return sum(len(d.text.encode()) for d in self.train + self.val)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """Sorted `.py` files of the standard library (site-packages excluded)."""
    root = stdlib_root()
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def _extra_files(patterns: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True))
        matches = [m for m in matches if m.is_file()]
        if not matches:
            raise SharedModelError(f"corpus.extra: {pattern!r} matches no file")
        files.extend(matches)
    return files


def in_validation(name: str, val_fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of SHA-256(name) as a fraction of 2^64."""
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def load_corpus(config: CorpusConfig | None = None) -> Corpus:
    config = config or CorpusConfig()
    named: list[tuple[str, Path]] = []
    if config.include_stdlib:
        root = stdlib_root()
        named += [(str(p.relative_to(root)), p) for p in stdlib_files()]
    named += [(str(p), p) for p in _extra_files(config.extra)]
    if not named:
        raise SharedModelError("the corpus is empty: enable include_stdlib or give extra files")
    if config.max_documents is not None:
        named = named[: config.max_documents]
    corpus = Corpus()
    for name, path in named:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            corpus.skipped.append(name)
            continue
        split = corpus.val if in_validation(name, config.val_fraction) else corpus.train
        split.append(Document(name, text))
    return corpus
