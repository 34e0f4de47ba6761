"""The paged KV block pool, with prefix caching.

Contract:
- The pool has `num_blocks` blocks of `block_size` token slots. The block manager owns every block's state
  (reference count, prefix hash, tokens); it never touches a Sequence: the scheduler passes token lists and block
  tables in and stores what comes back.
- A block is in exactly one of three states: USED (ref_count > 0), FREE-CACHED (ref_count 0, still holding the
  K/V of a registered prefix, evictable, kept in LRU order) or FREE-EMPTY. free = cached-free + empty;
  used + free = total.
- Prefix caching: a full block is keyed by `chain_hash(previous block's hash, its tokens)`, so equal hashes mean
  equal prefixes up to that block (the tokens are kept and compared too, so a hash collision cannot alias).
  A chain starts from a root keyed by the caller's `salt` (0: the base model; a LoRA adapter's loading has its own,
  `inference_svc.lora.slots`), and the salt is kept and compared with the tokens: K/V computed under one adapter
  is never reused under another, or under the base model.
  A block is registered only after its K/V has been computed (`register`), never at allocation time, so a
  matching request never reads K/V that a chunked prefill has not written yet.
- `allocate(tokens)` reuses the longest registered prefix of whole blocks (never the whole prompt: at least one
  token is left to compute, so the request has logits to sample from) and takes fresh blocks for the rest:
  empty blocks first, then the least recently freed cached block (its hash is dropped: evicted).
- `free(blocks)` releases in reverse so a sequence's tail is evicted before its head. `discard(blocks)` releases
  blocks whose K/V must not be reused (no prefix hash survives) and says which ones the caller must scrub.
- `reset_prefix_cache()` forgets every cached prefix when no block is in use (False, and nothing changes,
  otherwise).
- `events` (None by default) is told of every change to the set of registered hashes, as it happens:
  `stored(hash, parent_hash or None, tokens, salt)` when a block is registered, `removed(hash)` when a registered block
  loses its hash (evicted or discarded), `cleared()` on a reset (`inference_svc.kv_events.KVEventRecorder`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

_ROOT_HASH = 0x7A3D5E1F


def root_hash(salt: int) -> int:
    """The chain's starting hash for prefixes computed under `salt` (0: the base model's, as it always was)."""
    return _ROOT_HASH if salt == 0 else hash((_ROOT_HASH, salt))


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of a full block given the hash of the block before it (deterministic across runs)."""
    return hash((parent, *tokens))


class PrefixEvents(Protocol):
    """What `BlockManager.events` is told (see the module docstring)."""

    def stored(self, h: int, parent: int | None, tokens: tuple[int, ...], salt: int) -> None: ...
    def removed(self, h: int) -> None: ...
    def cleared(self) -> None: ...


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()
    salt: int = 0
    """The prefix-cache namespace its registered prefix was computed under (see the module docstring)."""


@dataclass(frozen=True)
class Allocation:
    blocks: list[int]
    num_cached_tokens: int
    """Leading tokens whose K/V are already in `blocks` (whole blocks from the prefix cache)."""
    hashes: list[int]
    """Chain hashes of the reused blocks."""


class BlockManager:
    """Allocates, shares, caches and frees KV blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._empty: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, oldest first
        self._by_hash: dict[int, int] = {}
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.events: PrefixEvents | None = None

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix (used or evictable)."""
        return len(self._by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ allocation
    def _match(self, tokens: Sequence[int], use_cache: bool = True, salt: int = 0) -> tuple[list[int], list[int]]:
        """Registered blocks of the longest cached prefix (leaving at least one token uncovered), and their hashes."""
        if not self.enable_prefix_caching or not use_cache:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        parent = root_hash(salt)
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = chain_hash(parent, chunk)
            bid = self._by_hash.get(h)
            if bid is None or self.blocks[bid].tokens != chunk or self.blocks[bid].salt != salt:
                break
            blocks.append(bid)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def cached_prefix_tokens(self, tokens: Sequence[int], use_cache: bool = True, salt: int = 0) -> int:
        """How many of `tokens` `allocate(tokens, use_cache, salt)` would find computed now (a read-only look)."""
        return len(self._match(tokens, use_cache, salt)[0]) * self.block_size

    def can_allocate(self, tokens: Sequence[int], use_cache: bool = True, salt: int = 0) -> bool:
        """Whether `allocate(tokens, use_cache, salt)` would succeed now."""
        hit, _ = self._match(tokens, use_cache, salt)
        need = self.blocks_for(len(tokens)) - len(hit)
        need += sum(1 for b in hit if self.blocks[b].ref_count == 0)  # reusing an evictable block takes it
        return need <= self.num_free

    def allocate(self, tokens: Sequence[int], use_cache: bool = True, salt: int = 0) -> Allocation:
        """Blocks covering `tokens`, reusing the cached prefix computed under `salt` unless `use_cache` is False
        (no lookup, not counted as a query). Raises if there is not room (check first)."""
        if not self.can_allocate(tokens, use_cache, salt):
            raise RuntimeError("not enough free KV blocks (call can_allocate first)")
        hit, hashes = self._match(tokens, use_cache, salt)
        for bid in hit:
            self._ref(bid)
        fresh = [self._take() for _ in range(self.blocks_for(len(tokens)) - len(hit))]
        if use_cache:
            self.queried_tokens += len(tokens)
        self.hit_tokens += len(hit) * self.block_size
        return Allocation(hit + fresh, len(hit) * self.block_size, hashes)

    def append_block(self) -> int | None:
        """One more block for a growing sequence, or None when the pool is exhausted."""
        if self.num_free == 0:
            return None
        return self._take()

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced cached blocks become evictable (most recent last)."""
        self._release(blocks, keep_prefix=True)

    def discard(self, blocks: Sequence[int]) -> list[int]:
        """`free` for blocks whose contents must never be read again (a failed sequence's, which may hold NaN):
        each block that no other sequence holds loses its prefix hash and becomes empty. Returns those blocks,
        for the caller to scrub; blocks still shared stay as they are."""
        return self._release(blocks, keep_prefix=False)

    def _release(self, blocks: Sequence[int], keep_prefix: bool) -> list[int]:
        """Drop one reference to each block, tail first; return the blocks no sequence holds any more."""
        released: list[int] = []
        for bid in reversed(blocks):
            block = self.blocks[bid]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {bid}")
            block.ref_count -= 1
            if block.ref_count:
                continue
            released.append(bid)
            if block.hash is not None and keep_prefix:
                self._evictable[bid] = None
                continue
            if block.hash is not None:
                del self._by_hash[block.hash]
                if self.events is not None:
                    self.events.removed(block.hash)
                block.hash, block.tokens = None, ()
            self._empty.append(bid)
        return released

    def register(self, block_id: int, parent_hash: int | None, tokens: Sequence[int], salt: int = 0) -> int:
        """Record that a full, computed block holds `tokens` after the prefix hashed `parent_hash` (None: the first
        block of a prefix computed under `salt`); return its hash.

        If that prefix is already cached in another block, this block stays unregistered (it is freed as a private
        block later); the returned hash is the chain hash either way.
        """
        chunk = tuple(tokens)
        if len(chunk) != self.block_size:
            raise ValueError(f"only full blocks are registered ({len(chunk)} != {self.block_size} tokens)")
        h = chain_hash(root_hash(salt) if parent_hash is None else parent_hash, chunk)
        block = self.blocks[block_id]
        if not self.enable_prefix_caching or block.hash is not None or h in self._by_hash:
            return h
        block.hash, block.tokens, block.salt = h, chunk, salt
        self._by_hash[h] = block_id
        if self.events is not None:
            self.events.stored(h, parent_hash, chunk, salt)
        return h

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (all cached blocks become empty) if no block is in use; else False."""
        if self.num_used:
            return False
        for bid in self._evictable:
            self.blocks[bid].hash, self.blocks[bid].tokens = None, ()
            self._empty.append(bid)
        self._evictable.clear()
        self._by_hash.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    # ------------------------------------------------------------------ internals
    def _ref(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self._evictable[bid]
        block.ref_count += 1

    def _take(self) -> int:
        if self._empty:
            bid = self._empty.popleft()
        else:
            bid, _ = self._evictable.popitem(last=False)  # evict the least recently freed cached block
            block = self.blocks[bid]
            del self._by_hash[block.hash]  # type: ignore[arg-type]
            if self.events is not None:
                self.events.removed(block.hash)  # type: ignore[arg-type]
            block.hash, block.tokens = None, ()
        self.blocks[bid].ref_count = 1
        return bid

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (used by tests)."""
        empty, evictable = set(self._empty), set(self._evictable)
        assert len(empty) == len(self._empty), "duplicate in the empty list"
        assert not empty & evictable, "block both empty and evictable"
        for b in self.blocks:
            assert b.ref_count >= 0
            if b.ref_count == 0:
                assert (b.block_id in empty) != (b.block_id in evictable), f"free block {b.block_id} misplaced"
                assert (b.block_id in evictable) == (b.hash is not None)
            else:
                assert b.block_id not in empty and b.block_id not in evictable
            if b.hash is not None:
                assert self._by_hash.get(b.hash) == b.block_id
        assert len(self._by_hash) == sum(1 for b in self.blocks if b.hash is not None)
        assert self.num_used + self.num_free == self.num_blocks
