"""The example data module: the corpus, tokenized once, packed into fixed-length blocks, served in step order.

Contract:
- `prepare_blocks(cfg, cache_dir, vocab_size, tokenizer=None)` loads the corpus (default: the standard-library
  sources, plus `data.extra`: text files, one document each, or JSONL files, one document per line taken from
  `data.jsonl_field`; `data.format` says which, `auto` goes by the `.jsonl` suffix), uses the given tokenizer (a
  fine-tuned folder's) or `cfg.tokenizer` or trains a byte-level BPE on the training split, encodes every document
  with an EOS after it, and packs each split into rows of `block_size + 1` tokens (inputs and shifted targets).
- The tokenizer and the blocks are cached in `cache_dir` under a key of everything they depend on: the data
  settings, the identity (resolved path, size, mtime) of every `data.extra` file, and the tokenizer (a hash of its
  tokenizer.json, or the vocabulary size of one to be trained); a second call (another rank, a resumed run) only
  reads, and an edited file or another tokenizer makes a new entry. Files are written to a temporary name and
  renamed into place.
- Bad data settings raise `TrainingConfigError` naming the key, before any tokenizing: a `data.extra` entry that
  matches no file (`data.extra: path not found: …`), a JSONL line that is not JSON or lacks the text field
  (`data.extra: FILE line N: …`), a corpus with no documents or too few tokens for one block (`data: …`), a
  `data.tokenizer` that is missing or unreadable (`data.tokenizer: …`), a tokenizer with more ids than the model
  has embeddings. Messages are one line.
- Batch contract (for LitCausalLM and any `model.class_path` module): a training or validation batch is one int64
  tensor [data.batch_size, data.block_size + 1] of token ids; inputs are batch[:, :-1], targets batch[:, 1:].
  Documents are concatenated with the tokenizer's EOS between them; there is no padding and no attention mask.
- `StepLoader` serves the training blocks as a pure function of the micro-step: micro-step m on rank r of w reads
  rows perm_e[(m mod S)·B·w + r·B : … + B] of the epoch-e permutation (e = m div S, seeded). Iteration starts at
  the micro-step the Trainer has reached, so a resumed run sees exactly the batches a straight run would, and
  one process with batch B·w sees the union of what w processes see.
- `CorpusDataModule` wires both into Lightning; it needs `use_distributed_sampler=False` (it shards itself).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from safetensors.torch import load_file, save_file

from lt_plugins.config import DataSection
from lt_plugins.errors import TrainingConfigError, one_line
from shared_model.bundle import tokenizer_id_bound
from shared_model.corpus import Corpus, CorpusConfig, Document, in_validation, load_corpus
from shared_model.errors import SharedModelError
from shared_model.tokenizer import Tokenizer


@dataclass
class Blocks:
    """Packed token rows [N, block_size + 1] (int64) per split, and the tokenizer that made them."""

    train: torch.Tensor
    val: torch.Tensor
    tokenizer: Tokenizer


def _cache_key(cfg: DataSection, vocab_size: int, files: list[Path], tokenizer: Tokenizer | None) -> str:
    fields: dict[str, Any] = asdict(cfg)
    fields.pop("batch_size")
    fields.pop("seed")
    fields["vocab_size"] = cfg.vocab_size or vocab_size
    fields["files"] = [_identity(f) for f in files]
    if tokenizer is not None:  # given or loaded: its exact vocabulary and specials (trained ones follow the data)
        fields["tokenizer"] = tokenizer.fingerprint()
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _identity(path: Path) -> list[Any]:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _pack(docs: list[list[int]], eos: int | None, row: int) -> torch.Tensor:
    flat: list[int] = []
    for ids in docs:
        flat.extend(ids)
        if eos is not None:
            flat.append(eos)
    n = len(flat) // row
    return torch.tensor(flat[: n * row], dtype=torch.int64).view(n, row)


def prepare_blocks(
    cfg: DataSection, cache_dir: str | Path, vocab_size: int, tokenizer: Tokenizer | None = None
) -> Blocks:
    """Tokenize and pack the corpus, or read the cached result (see the module contract). `tokenizer`, when given
    (model.init_from's), is used as is; then data.tokenizer must be None."""
    files = extra_files(cfg.extra)
    if tokenizer is None and cfg.tokenizer is not None:
        tokenizer = _load_tokenizer(cfg.tokenizer)
    folder = Path(cache_dir) / f"data-{_cache_key(cfg, vocab_size, files, tokenizer)}"
    blocks_file = folder / "blocks.safetensors"
    if blocks_file.is_file() and (folder / "tokenizer.json").is_file():
        tensors = load_file(str(blocks_file))
        return Blocks(tensors["train"], tensors["val"], tokenizer or Tokenizer.load(folder))
    corpus = _load_corpus(cfg, files)
    if tokenizer is None:
        tokenizer = _train_tokenizer(cfg, corpus, vocab_size)
    if tokenizer_id_bound(tokenizer) > vocab_size:
        key = "data.tokenizer" if cfg.tokenizer is not None else "data.vocab_size"
        raise TrainingConfigError(
            f"{key}: the tokenizer has {tokenizer_id_bound(tokenizer)} tokens but the model's vocab_size is "
            f"{vocab_size} (data.vocab_size / data.tokenizer / model.init_from vs model.preset)"
        )
    row = cfg.block_size + 1
    train = _pack(tokenizer.encode_batch(corpus.texts("train")), tokenizer.eos_id, row)
    val = _pack(tokenizer.encode_batch(corpus.texts("val")), tokenizer.eos_id, row)
    if len(train) == 0:
        raise TrainingConfigError(
            f"data: the training split holds fewer than data.block_size+1={row} tokens "
            f"({len(corpus.train)} documents); add documents (data.extra, data.include_stdlib) or lower data.block_size"
        )
    tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    tokenizer.save(tmp)
    save_file({"train": train, "val": val}, str(tmp / "blocks.safetensors"))
    with contextlib.suppress(OSError):  # another process finished first: use theirs
        os.rename(tmp, folder)
    return Blocks(train, val, tokenizer)


def extra_files(patterns: list[str]) -> list[Path]:
    """The files `data.extra` names, in order (each pattern's matches sorted); a pattern matching no file is an
    error naming it."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True))
        if not matches:
            raise TrainingConfigError(f"data.extra: path not found: {pattern}")
        found = [m for m in matches if m.is_file()]
        if not found:
            raise TrainingConfigError(f"data.extra: {pattern} matches no file (directories are not read; use a glob)")
        files.extend(found)
    return files


def _is_jsonl(cfg: DataSection, path: Path) -> bool:
    return cfg.format == "jsonl" or (cfg.format == "auto" and path.suffix.lower() == ".jsonl")


def read_jsonl(path: Path, field: str) -> list[Document]:
    """One document per non-blank line, its text the string `field`; documents are named FILE:LINE."""
    docs: list[Document] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise TrainingConfigError(f"data.extra: {path} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrainingConfigError(f"data.extra: {path} line {number}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or field not in record:
            what = "has no" if isinstance(record, dict) else f"is a JSON {type(record).__name__}, not an object with a"
            raise TrainingConfigError(f"data.extra: {path} line {number} {what} field {field!r} (data.jsonl_field)")
        text = record[field]
        if not isinstance(text, str):
            raise TrainingConfigError(
                f"data.extra: {path} line {number}: field {field!r} is a {type(text).__name__}, not a string"
            )
        docs.append(Document(f"{path}:{number}", text))
    return docs


def _load_corpus(cfg: DataSection, files: list[Path]) -> Corpus:
    """The corpus the data section describes; every failure is a one-line `TrainingConfigError` naming the key."""
    jsonl = [f for f in files if _is_jsonl(cfg, f)]
    text = [f for f in files if not _is_jsonl(cfg, f)]
    if not cfg.include_stdlib and not files:
        raise TrainingConfigError("data: the corpus is empty: data.include_stdlib is false and data.extra is empty")
    corpus = Corpus()
    if cfg.include_stdlib or text:
        try:
            corpus = load_corpus(
                CorpusConfig(
                    include_stdlib=cfg.include_stdlib,
                    extra=tuple(glob.escape(str(f)) for f in text),
                    val_fraction=cfg.val_fraction,
                    max_documents=cfg.max_documents,
                )
            )
        except SharedModelError as exc:
            raise TrainingConfigError(f"data: {one_line(exc)}") from None
    budget = None if cfg.max_documents is None else cfg.max_documents - len(corpus.train) - len(corpus.val)
    for path in jsonl:
        for doc in read_jsonl(path, cfg.jsonl_field):
            if budget is not None and budget <= 0:
                break
            (corpus.val if in_validation(doc.name, cfg.val_fraction) else corpus.train).append(doc)
            budget = None if budget is None else budget - 1
    if not corpus.train:
        raise TrainingConfigError(
            f"data: the corpus has no training document ({len(corpus.val)} held out by data.val_fraction, "
            f"{len(corpus.skipped)} not UTF-8); add files with data.extra or data.include_stdlib"
        )
    return corpus


def _train_tokenizer(cfg: DataSection, corpus: Corpus, vocab_size: int) -> Tokenizer:
    """A BPE trained on the training split; failures name the key."""
    try:
        return Tokenizer.train(corpus.texts("train"), cfg.vocab_size or vocab_size)
    except SharedModelError as exc:
        raise TrainingConfigError(f"data.vocab_size: {one_line(exc)}") from None


def _load_tokenizer(path: str) -> Tokenizer:
    """`data.tokenizer` loaded; failures name the key."""
    if not Path(path).exists():
        raise TrainingConfigError(f"data.tokenizer: path not found: {path}")
    try:
        return Tokenizer.load(path)
    except SharedModelError as exc:
        raise TrainingConfigError(f"data.tokenizer: {one_line(exc)}") from None


class StepLoader:
    """Training batches as a function of the micro-step (see the module contract). Batches: [B, block+1] int64."""

    def __init__(
        self,
        rows: torch.Tensor,
        batch_size: int,
        rank: int,
        world: int,
        seed: int,
        start: Callable[[], int] = lambda: 0,
    ) -> None:
        self.rows, self.batch_size, self.rank, self.world, self.seed = rows, batch_size, rank, world, seed
        self.steps_per_epoch = len(rows) // (batch_size * world)
        if self.steps_per_epoch == 0:
            raise TrainingConfigError(
                f"{len(rows)} training blocks cannot fill one global batch of data.batch_size={batch_size} x "
                f"{world} processes; use more documents or a smaller batch"
            )
        self._start = start
        self._perm: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.steps_per_epoch

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.rows), generator=gen))
        return self._perm[1]

    def batch(self, micro_step: int) -> torch.Tensor:
        epoch, pos = divmod(micro_step, self.steps_per_epoch)
        first = pos * self.batch_size * self.world + self.rank * self.batch_size
        return self.rows[self._permutation(epoch)[first : first + self.batch_size]]

    def __iter__(self) -> Iterator[torch.Tensor]:
        step = self._start()
        end = (step // self.steps_per_epoch + 1) * self.steps_per_epoch  # to the end of the current epoch
        for m in range(step, end):
            yield self.batch(m)

    def state_dict(self) -> dict[str, Any]:
        return {"start": self._start()}  # informative only: the position comes from the Trainer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class FixedBatches:
    """A fixed list of batches served as one loader (a bare list would read as several loaders)."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.batches)


class CorpusDataModule(pl.LightningDataModule):
    """Packed corpus blocks for LitCausalLM; validation is the first blocks of the held-out split."""

    def __init__(self, cfg: DataSection, blocks: Blocks) -> None:
        super().__init__()
        self.cfg, self.blocks = cfg, blocks

    def _micro_step(self) -> int:
        trainer = self.trainer
        if trainer is None:
            return 0
        return trainer.global_step * trainer.accumulate_grad_batches

    def train_dataloader(self) -> StepLoader:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return StepLoader(self.blocks.train, self.cfg.batch_size, rank, world, self.cfg.seed, self._micro_step)

    def val_dataloader(self) -> FixedBatches:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        rows = self.blocks.val if len(self.blocks.val) else self.blocks.train[-self.cfg.batch_size :]
        b = self.cfg.batch_size
        batches = [rows[i : i + b] for i in range(0, len(rows) - b + 1, b)]
        usable = len(batches) // world * world  # every rank runs the same number of steps (ZeRO-3 collectives)
        return FixedBatches(batches[:usable][rank::world] if usable else [rows[:b]])
