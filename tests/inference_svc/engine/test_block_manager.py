"""Randomized block-manager test: admit, grow, finish, preempt and prefix-share, checking invariants each time."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from inference_svc.engine.block_manager import BlockManager


class _Model:
    """Sequences as the scheduler would drive them: tokens, block table, registered-hash chain."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.seqs: dict[int, dict] = {}

    def check(self) -> None:
        self.bm.check_invariants()
        refs = Counter(b for s in self.seqs.values() for b in s["blocks"])
        for block in self.bm.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id} ref count"
        assert self.bm.num_used == len(refs)
        assert self.bm.num_used + self.bm.num_free == self.bm.num_blocks

    def register_full(self, s: dict) -> None:
        bs = self.bm.block_size
        for i in range(len(s["hashes"]), len(s["tokens"]) // bs):
            parent = s["hashes"][-1] if s["hashes"] else None
            s["hashes"].append(self.bm.register(s["blocks"][i], parent, s["tokens"][i * bs : (i + 1) * bs]))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caching", [True, False])
def test_random_operations_keep_invariants(seed, caching):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.randrange(4, 40), block_size=rng.choice([1, 2, 4]), enable_prefix_caching=caching)
    m = _Model(bm)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    next_id = 0
    for _ in range(400):
        op = rng.choice(["admit", "admit", "grow", "grow", "grow", "finish", "preempt", "fail"])
        if op == "admit":
            tokens = rng.choice(prefixes)[: rng.randrange(1, 13)] + [rng.randrange(50) for _ in range(rng.randrange(3))]
            if not tokens:
                continue
            if not bm.can_allocate(tokens):
                with pytest.raises(RuntimeError):
                    bm.allocate(tokens)
                continue
            alloc = bm.allocate(tokens)
            assert len(alloc.blocks) == bm.blocks_for(len(tokens))
            assert alloc.num_cached_tokens < len(tokens)
            assert alloc.num_cached_tokens % bm.block_size == 0
            if not caching:
                assert alloc.num_cached_tokens == 0
            for i, h in enumerate(alloc.hashes):  # a hit really holds these tokens
                block = bm.blocks[alloc.blocks[i]]
                assert block.hash == h and list(block.tokens) == tokens[i * bm.block_size : (i + 1) * bm.block_size]
            s = {"tokens": tokens, "blocks": alloc.blocks, "hashes": list(alloc.hashes)}
            m.seqs[next_id] = s
            next_id += 1
            m.register_full(s)  # prefill computed
        elif op == "grow" and m.seqs:
            s = m.seqs[rng.choice(list(m.seqs))]
            s["tokens"].append(rng.randrange(50))
            if len(s["blocks"]) < bm.blocks_for(len(s["tokens"])):
                block = bm.append_block()
                if block is None:
                    assert bm.num_free == 0
                    s["tokens"].pop()
                    m.check()
                    continue
                s["blocks"].append(block)
            m.register_full(s)
        elif op in ("finish", "preempt") and m.seqs:
            sid = rng.choice(list(m.seqs)) if op == "finish" else max(m.seqs)  # preempt the newest
            bm.free(m.seqs.pop(sid)["blocks"])
        elif op == "fail" and m.seqs:  # a failed sequence: its unshared blocks lose their prefix and come back empty
            blocks = m.seqs.pop(rng.choice(list(m.seqs)))["blocks"]
            shared = {b for other in m.seqs.values() for b in other["blocks"]}
            scrubbed = bm.discard(blocks)
            assert set(scrubbed) == set(blocks) - shared
            assert all(bm.blocks[b].hash is None and bm.blocks[b].ref_count == 0 for b in scrubbed)
        m.check()
    for sid in list(m.seqs):
        bm.free(m.seqs.pop(sid)["blocks"])
    m.check()
    assert bm.num_free == bm.num_blocks, "blocks leaked"


def test_double_free_is_an_error():
    bm = BlockManager(4, 2)
    alloc = bm.allocate([1, 2, 3])
    bm.free(alloc.blocks)
    with pytest.raises(RuntimeError):
        bm.free(alloc.blocks)


def test_lru_eviction_keeps_recent_prefixes():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.allocate([1, 2, 3, 4, 5])  # 3 blocks
    for i in range(2):
        bm.register(a.blocks[i], None if i == 0 else bm.blocks[a.blocks[0]].hash, [1, 2, 3, 4][2 * i : 2 * i + 2])
    bm.free(a.blocks)
    assert bm.num_cached == 2 and bm.num_free == 4
    again = bm.allocate([1, 2, 3, 4, 9])
    assert again.num_cached_tokens == 4 and again.blocks[:2] == a.blocks[:2]
    bm.free(again.blocks)
    bm.allocate([7, 7, 7, 7, 7, 7, 7])  # 4 blocks: evicts both cached ones
    assert bm.num_cached == 0


class _Events:
    """A `PrefixEvents` sink that keeps the registered set the events describe."""

    def __init__(self) -> None:
        self.cached: dict[int, tuple[int, ...]] = {}
        self.log: list[str] = []

    def stored(self, h: int, parent: int | None, tokens: tuple[int, ...], salt: int = 0) -> None:
        assert h not in self.cached
        self.cached[h] = tokens
        self.log.append("stored")

    def removed(self, h: int) -> None:
        del self.cached[h]
        self.log.append("removed")

    def cleared(self) -> None:
        self.cached.clear()
        self.log.append("cleared")


@pytest.mark.parametrize("seed", range(4))
def test_events_describe_the_registered_set_and_reset(seed):
    """Every registration, eviction and discard reaches `events` as it happens; `reset_prefix_cache` clears the
    cache (refused while a block is in use) and says so."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.randrange(6, 20), block_size=2)
    sink = bm.events = _Events()
    m = _Model(bm)
    prefixes = [[rng.randrange(20) for _ in range(10)] for _ in range(3)]
    for n in range(300):
        live = list(m.seqs)
        if live and rng.random() < 0.4:
            s = m.seqs.pop(rng.choice(live))
            (bm.discard if rng.random() < 0.2 else bm.free)(s["blocks"])
        else:
            tokens = [*rng.choice(prefixes)[: rng.randrange(2, 11)], rng.randrange(20)]
            if bm.can_allocate(tokens):
                alloc = bm.allocate(tokens)
                s = m.seqs[n] = {"tokens": tokens, "blocks": alloc.blocks, "hashes": list(alloc.hashes)}
                m.register_full(s)
        m.check()
        assert sink.cached == {b.hash: b.tokens for b in bm.blocks if b.hash is not None}
    assert "removed" in sink.log
    if m.seqs:
        assert not bm.reset_prefix_cache()  # blocks in use: refused, nothing changed
        assert sink.log[-1] != "cleared"
    for s in m.seqs.values():
        bm.free(s["blocks"])
    m.seqs.clear()
    assert bm.reset_prefix_cache()
    assert sink.log[-1] == "cleared" and sink.cached == {} and bm.num_cached == 0 and bm.num_free == bm.num_blocks
    m.check()
