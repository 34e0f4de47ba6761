"""KV-cache events in vLLM's wire format, for prefix-aware routers (llm-d's KV indexer, Ray Serve's and Dynamo's
KV-aware routers) that follow which replica holds which prompt prefix.

Contract:
- `KVEventsConfig.from_json(text)` reads the JSON of vLLM's `--kv-events-config` (`enable_kv_cache_events`,
  `publisher` "zmq" or "null", `endpoint`, `replay_endpoint`, `buffer_steps`, `hwm`, `max_queue_size`, `topic`);
  unknown keys, wrong types and bad endpoints raise `ValueError` naming the key. `publisher` left out means "zmq"
  when enabled. Tandem adds `event_encoding`: "map" (the default: events are msgpack maps tagged by `type`, as
  vLLM's `KVCacheEvent` structs encode today) or "array" (the earlier layout: each event an array, tag first, then
  its fields in declaration order, for consumers written against older vLLM).
- Wire format (one ZeroMQ multipart message per engine step that changed the cache): `[topic, sequence, payload]`;
  `sequence` is an unsigned 8-byte big-endian integer, from 0 and without gaps; `payload` is msgpack of an
  `EventBatch` array `[ts (float, Unix seconds), events, data_parallel_rank (0)]`. Events:
  `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name)`,
  `BlockRemoved(block_hashes, medium)`, `AllBlocksCleared()`; `medium` is "GPU" (vLLM's name for the engine's own
  KV pool, whatever the device); `lora_id`/`lora_name` nil for the base model's blocks, and for a block computed
  under a LoRA adapter its loading's prefix-cache salt and its name (`lora_name` is the recorder's resolver,
  `LoraSlots.name_of_salt`; such blocks' hashes differ from the base's, since the cache keys by adapter). Block
  hashes are Tandem's chain hashes as unsigned 64-bit integers; `parent_block_hash` is nil for a prompt's first
  block; `token_ids` are the stored blocks' tokens, in order (`block_size` of them per hash). Consecutive blocks
  of one chain stored in one step share one `BlockStored`.
- What is published: every block registered in the prefix cache (reusable by a later prompt's prefix hit) as
  stored, every registered block that loses its hash (evicted for a fresh allocation, or discarded after a failure)
  as removed, `BlockManager.reset_prefix_cache()` as all-cleared. Applying the events in sequence order yields
  exactly the set of hashes the block manager holds.
- `KVEventRecorder` is the block manager's event sink (`BlockManager.events`); it runs on the engine thread and
  never blocks it: `end_step()` (called by `Engine.step`) offers the step's batch to the publisher's bounded queue
  (`max_queue_size` batches) with `put_nowait`. A batch that does not fit is dropped and counted
  (`tandem_kv_events_dropped_batches_total`), and the recorder owes a resync: it offers nothing more until the
  publisher thread, once it has sent every batch queued before the drop, takes from it one batch of
  `AllBlocksCleared` followed by `BlockStored` for every block cached at that moment (the recorder's mirror of the
  cache, kept from the events; taken under the recorder's lock, so never half a step), counted in
  `tandem_kv_events_resyncs_total`. So a dropped batch leaves subscribers wrong only until the queue drains, even
  if the engine goes idle meanwhile.
- `KVEventPublisher` owns the sockets, on its own thread (created, used and closed there): a PUB socket on
  `endpoint` (bound when it holds `*` or `::` or is ipc/inproc, else connected, as vLLM does) with high-water mark
  `hwm`, and optionally a ROUTER on `replay_endpoint` (always bound). The publisher numbers batches as it sends
  them and keeps the last `buffer_steps` of them. A replay request `[b"", start_sequence (8 bytes big-endian)]`
  (from a DEALER, which can read the several answers) is answered with every kept batch from `start_sequence` on,
  each `[b"", sequence, payload]`, then the end marker `[b"", -1 as signed 8 bytes, b""]`. `start()` raises
  `ValueError` naming the endpoint when it cannot be bound or connected; `endpoint` / `replay_endpoint` are then
  the resolved addresses (a `*` port resolved). `flush(timeout)` waits until what is queued has been sent;
  `close()` sends what is queued and stops the thread.
- `published` counts batches sent (`tandem_kv_events_published_batches_total`); with a registry the three counters
  are registered there, labelled `model_name` like every `tandem_*` series when one is given.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgpack

log = logging.getLogger(__name__)

MEDIUM = "GPU"
"""vLLM's medium name for the engine's own KV pool (offload tiers are CPU/disk)."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay answer's last frame pair: sequence -1, empty payload."""
_U64 = (1 << 64) - 1
_ENCODINGS = ("map", "array")


def external_hash(h: int) -> int:
    """A Tandem chain hash (a signed 64-bit Python hash) as the unsigned 64-bit integer published."""
    return h & _U64


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` keys (same names, same defaults), plus Tandem's `event_encoding`."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    event_encoding: str = "map"

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name} must be a tcp://, ipc:// or inproc:// address, got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"topic must be a string, got {self.topic!r}")
        if self.event_encoding not in _ENCODINGS:
            raise ValueError(f"event_encoding must be one of {', '.join(_ENCODINGS)}, got {self.event_encoding!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)


# ---------------------------------------------------------------------------------------- encoding
def stored_event(
    hashes: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int, encoding: str,
    lora: tuple[int | None, str | None] = (None, None),
):  # fmt: skip
    """A `BlockStored` as msgpack-ready data (hashes already external); `lora`: (lora_id, lora_name)."""
    if encoding == "array":
        return ["BlockStored", list(hashes), parent, list(tokens), block_size, lora[0], MEDIUM, lora[1]]
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": lora[0],
        "medium": MEDIUM,
        "lora_name": lora[1],
    }


def removed_event(hashes: Sequence[int], encoding: str):
    if encoding == "array":
        return ["BlockRemoved", list(hashes), MEDIUM]
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": MEDIUM}


def cleared_event(encoding: str):
    return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list, data_parallel_rank: int = 0) -> bytes:
    """The `EventBatch` payload: `[ts, events, data_parallel_rank]` in msgpack."""
    return msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)


# ---------------------------------------------------------------------------------------- recorder
class _Pending:
    """One step's events, merged as they come: a chain stored block by block becomes one `BlockStored`."""

    def __init__(self) -> None:
        self.items: list[list] = []  # [kind, hashes, parent, tokens, (lora_id, lora_name)]

    def stored(self, h: int, parent: int | None, tokens: tuple[int, ...], lora: tuple = (None, None)) -> None:
        last = self.items[-1] if self.items else None
        if (
            last is not None and last[0] == "stored" and parent is not None and last[1][-1] == parent
            and last[4] == lora
        ):  # fmt: skip
            last[1].append(h)
            last[3].extend(tokens)
        else:
            self.items.append(["stored", [h], parent, list(tokens), lora])

    def removed(self, h: int) -> None:
        last = self.items[-1] if self.items else None
        if last is not None and last[0] == "removed":
            last[1].append(h)
        else:
            self.items.append(["removed", [h], None, None, None])

    def cleared(self) -> None:
        self.items.append(["cleared", None, None, None, None])


class KVEventRecorder:
    """The block manager's sink: collects a step's events, hands them to the publisher at `end_step` (engine
    thread, never blocking). Keeps a mirror of the cached blocks (external hash → parent, tokens) for resyncs; the
    publisher thread takes a resync from it (`take_resync`) under the same lock, so it never sees half a step."""

    def __init__(
        self, publisher: KVEventPublisher, block_size: int, lora_name: Callable[[int], str | None] | None = None
    ) -> None:
        self.publisher = publisher
        self.lora_name = lora_name
        """A LoRA loading's prefix-cache salt → its adapter's name (None: the server serves no adapters)."""
        self.block_size = block_size
        self.encoding = publisher.config.event_encoding
        self._lock = threading.Lock()
        self._pending = _Pending()
        self._mirror: dict[int, tuple[int | None, tuple[int, ...], tuple]] = {}
        self._owe_resync = False
        publisher.recorder = self

    # -- BlockManager calls these (engine thread)
    def stored(self, h: int, parent: int | None, tokens: tuple[int, ...], salt: int = 0) -> None:
        eh, ep = external_hash(h), None if parent is None else external_hash(parent)
        lora = (None, None) if salt == 0 else (salt, self.lora_name(salt) if self.lora_name else None)
        with self._lock:
            self._mirror[eh] = (ep, tokens, lora)
            self._pending.stored(eh, ep, tokens, lora)

    def removed(self, h: int) -> None:
        eh = external_hash(h)
        with self._lock:
            self._mirror.pop(eh, None)
            self._pending.removed(eh)

    def cleared(self) -> None:
        with self._lock:
            self._mirror.clear()
            self._pending.cleared()

    # -- Engine.step calls this once per step
    def end_step(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, _Pending()
            if self._owe_resync or not pending.items:
                return  # owing a resync: it will cover this step's changes too
            events = [self._event(item) for item in pending.items]
            if not self.publisher.offer(time.time(), events):
                self._owe_resync = True

    # -- the publisher thread calls these once its queue is empty
    @property
    def owes_resync(self) -> bool:
        return self._owe_resync

    def take_resync(self) -> list | None:
        """All-cleared, then every cached block (chains merged), if a batch was dropped since the last resync."""
        with self._lock:
            if not self._owe_resync:
                return None
            self._owe_resync = False
            self._pending = _Pending()  # recorded before now: in the mirror, so in the snapshot
            rebuilt = _Pending()
            for h, (parent, tokens, lora) in self._mirror.items():
                rebuilt.stored(h, parent, tokens, lora)
            return [cleared_event(self.encoding), *(self._event(item) for item in rebuilt.items)]

    @property
    def cached_hashes(self) -> set[int]:
        """The external hashes the recorder believes cached (what a subscriber rebuilds)."""
        with self._lock:
            return set(self._mirror)

    def _event(self, item: list) -> Any:
        kind, hashes, parent, tokens, lora = item
        if kind == "stored":
            return stored_event(hashes, parent, tokens, self.block_size, self.encoding, lora)
        if kind == "removed":
            return removed_event(hashes, self.encoding)
        return cleared_event(self.encoding)


# ---------------------------------------------------------------------------------------- publisher
class KVEventPublisher:
    """ZeroMQ PUB (+ ROUTER replay) on its own thread; a bounded queue in front (see the module docstring)."""

    def __init__(self, config: KVEventsConfig, registry: Any = None, model_name: str = "") -> None:
        self.config = config
        self.endpoint: str = config.endpoint
        self.replay_endpoint: str | None = config.replay_endpoint
        self._queue: queue.Queue[tuple[float, list] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._buffer_lock = threading.Lock()
        self._send_lock = threading.Lock()
        """Held while a batch is taken and sent, so `flush` sees no batch between the queue and the wire."""
        self._topic = config.topic.encode()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stopping = False
        self.published = 0
        """Batches sent (also the next sequence number)."""
        self.dropped = 0
        """Batches dropped because the queue was full."""
        self.resyncs = 0
        """Resync batches sent."""
        self.recorder: KVEventRecorder | None = None
        """The recorder feeding this publisher (it registers itself), asked for resyncs."""
        self._counters: tuple[Any, Any, Any] | None = None
        if registry is not None:
            from prometheus_client import Counter

            labels = {"model_name": model_name} if model_name else {}

            def counter(name: str, text: str) -> Any:
                c = Counter(name, text, tuple(labels), registry=registry)
                return c.labels(**labels) if labels else c

            self._counters = (
                counter("tandem_kv_events_published_batches", "KV-event batches published."),
                counter("tandem_kv_events_dropped_batches",
                        "KV-event batches dropped because the publisher's queue was full (a resync follows)."),
                counter("tandem_kv_events_resyncs",
                        "Resync batches (all-cleared + every cached block) sent after a drop."),
            )  # fmt: skip

    # -- any thread
    def start(self, timeout: float = 30.0) -> None:
        """Create and bind/connect the sockets on the publisher thread; raise `ValueError` naming the endpoint if
        that fails."""
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise ValueError(f"kv events: the publisher did not start within {timeout} s")
        if self._error is not None:
            raise ValueError(f"kv events: {self._error}") from None

    def offer(self, ts: float, events: list) -> bool:
        """Queue one batch without blocking; False (and counted) when the queue is full."""
        if self._stopping:
            return False
        try:
            self._queue.put_nowait((ts, events))
        except queue.Full:
            self.dropped += 1
            if self._counters is not None:
                self._counters[1].inc()
            return False
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every batch queued so far, and any resync owed, has been sent (False if `timeout` passed
        first)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._send_lock:
                owed = self.recorder is not None and self.recorder.owes_resync
                if not self._queue.unfinished_tasks and not owed:
                    return True
            if time.monotonic() > deadline or self._thread is None or not self._thread.is_alive():
                return False
            time.sleep(0.005)

    def replay_buffer(self) -> list[tuple[int, bytes]]:
        with self._buffer_lock:
            return list(self._buffer)

    # -- the publisher thread
    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        pub = replay = None
        try:
            try:
                pub = ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.SNDHWM, self.config.hwm)
                pub.setsockopt(zmq.LINGER, 1000)
                ep = self.config.endpoint
                if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
                    pub.bind(ep)
                    self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
                else:
                    pub.connect(ep)
                if self.config.replay_endpoint is not None:
                    replay = ctx.socket(zmq.ROUTER)
                    replay.setsockopt(zmq.LINGER, 0)
                    replay.setsockopt(zmq.SNDHWM, self.config.buffer_steps + 2)  # a whole replay, never dropped
                    replay.bind(self.config.replay_endpoint)
                    self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            except zmq.ZMQError as exc:
                failed = self.config.endpoint if replay is None and pub is not None else self.config.replay_endpoint
                self._error = ValueError(f"cannot open {failed}: {exc}")
                return
            finally:
                self._ready.set()
            self._loop(pub, replay)
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close()
            ctx.term()

    def _loop(self, pub: Any, replay: Any) -> None:
        import zmq

        while True:
            if replay is not None:
                while replay.poll(0, zmq.POLLIN):
                    self._serve_replay(replay)
            with self._send_lock:
                if self._queue.empty() and self.recorder is not None and self.recorder.owes_resync:
                    resync = self.recorder.take_resync()  # after every batch queued before the drop
                    if resync is not None:
                        self._send(pub, time.time(), resync)
                        self.resyncs += 1
                        if self._counters is not None:
                            self._counters[2].inc()
                        continue
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            with self._send_lock:
                if item is not None:
                    self._send(pub, *item)
                self._queue.task_done()
            if item is None:
                return

    def _send(self, pub: Any, ts: float, events: list) -> None:
        import zmq

        payload = encode_batch(ts, events)
        seq = self.published
        try:
            pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            log.exception("kv events: publishing batch %d failed (it stays available for replay)", seq)
        with self._buffer_lock:
            self._buffer.append((seq, payload))
        self.published += 1
        if self._counters is not None:
            self._counters[0].inc()

    def _serve_replay(self, replay: Any) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in self.replay_buffer():
            if seq >= start:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))
