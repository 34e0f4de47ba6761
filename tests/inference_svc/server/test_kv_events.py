"""KV-cache events in vLLM's wire format (issue 36, goal 2), over real ZeroMQ sockets on loopback.

The subscriber below is written from the documented format (vLLM's docs/features/kv_events.md and
vllm/distributed/kv_events.py; Tandem's inference_svc/kv_events.py docstring), not from Tandem's encoder:
multipart `[topic, 8-byte big-endian sequence, msgpack EventBatch]`, the batch an array `[ts, events, dp_rank]`,
each event a map tagged `type` (or, with `event_encoding: array`, an array with the tag first), a DEALER replay
request `[b"", start sequence]` answered by `[b"", sequence, payload]` frames and an end marker of sequence -1.
It follows the stream, fills every gap by replay, and rebuilds the set of cached blocks; the tests compare that set
with the engine's block manager after randomized workloads whose small KV pool forces evictions. Every wait is
bounded; none asserts a duration.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

zmq = pytest.importorskip("zmq")

from inference_svc.engine.engine import Engine  # noqa: E402
from inference_svc.engine.types import SamplingParams  # noqa: E402
from inference_svc.kv_events import KVEventPublisher, KVEventRecorder, KVEventsConfig  # noqa: E402
from inference_svc.settings import ScaleOutSettings, SettingsError  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.inference_svc.server.conftest import engine_config, make_server  # noqa: E402

TOPIC = "kv-events"
U64 = (1 << 64) - 1


class Subscriber:
    """A router's view of one replica, rebuilt from the published stream alone."""

    def __init__(self, endpoint: str, replay_endpoint: str, start_seq: int = 0, bind: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        (self.sub.bind if bind else self.sub.connect)(endpoint)
        self.replayer = self.ctx.socket(zmq.DEALER)
        self.replayer.setsockopt(zmq.LINGER, 0)
        self.replayer.connect(replay_endpoint)
        self.next_seq = start_seq
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.replays = 0

    def close(self) -> None:
        self.sub.close()
        self.replayer.close()
        self.ctx.term()

    # -- decoding, from the documented format
    def apply(self, payload: bytes) -> None:
        batch = msgpack.unpackb(payload, raw=False)
        assert isinstance(batch, list) and len(batch) == 3, batch
        ts, events, rank = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 3600 and rank == 0
        for event in events:
            if isinstance(event, dict):
                kind = event["type"]
                fields = event
            else:
                kind, names = event[0], {
                    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                    "medium", "lora_name"),
                    "BlockRemoved": ("block_hashes", "medium"),
                    "AllBlocksCleared": (),
                }[event[0]]  # fmt: skip
                assert len(event) == 1 + len(names), event
                fields = dict(zip(names, event[1:], strict=True))
            self.counts[kind] += 1
            if kind == "BlockStored":
                hashes, parent, tokens, bs = (fields[k] for k in ("block_hashes", "parent_block_hash", "token_ids",
                                                                  "block_size"))  # fmt: skip
                assert fields["medium"] == "GPU" and fields["lora_id"] is None and fields["lora_name"] is None
                assert hashes and len(tokens) == len(hashes) * bs, fields
                for i, h in enumerate(hashes):
                    assert 0 <= h <= U64
                    assert h not in self.blocks, f"block {h:#x} stored twice without a removal"
                    self.blocks[h] = (parent if i == 0 else hashes[i - 1], tuple(tokens[i * bs : (i + 1) * bs]))
            elif kind == "BlockRemoved":
                assert fields["medium"] == "GPU"
                for h in fields["block_hashes"]:
                    assert h in self.blocks, f"removal of unknown block {h:#x}"
                    del self.blocks[h]
            else:
                self.blocks.clear()

    # -- transport
    def replay(self) -> None:
        """Ask for everything from `next_seq` on and apply it; the publisher's buffer must still hold it."""
        self.replays += 1
        self.replayer.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            assert self.replayer.poll(30_000), "no replay answer within 30 s"
            empty, seq_bytes, payload = self.replayer.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return
            if seq < self.next_seq:
                continue
            assert seq == self.next_seq, f"replay skipped from {self.next_seq} to {seq}: the buffer lost batches"
            self.apply(payload)
            self.next_seq += 1

    def follow(self, until_seq: int, timeout: float = 60.0) -> None:
        """Read live batches (filling gaps by replay) until every batch before `until_seq` has been applied."""
        self.replay()
        deadline = time.monotonic() + timeout
        while self.next_seq < until_seq:
            assert time.monotonic() < deadline, f"stuck at {self.next_seq} of {until_seq}"
            if not self.sub.poll(500):
                self.replay()  # nothing live (a slow join, or the stream is idle): catch up from the buffer
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode() and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self.next_seq:
                continue
            if seq > self.next_seq:
                self.replay()
                continue  # the replay applied this one too
            self.apply(payload)
            self.next_seq += 1


def engine_view(engine: Engine) -> dict[int, tuple[int, ...]]:
    """The block manager's own view: every block holding a registered prefix (hash as published → tokens)."""
    return {b.hash & U64: b.tokens for b in engine.block_manager.blocks if b.hash is not None}


def assert_same(sub: Subscriber, engine: Engine) -> None:
    view = engine_view(engine)
    assert set(sub.blocks) == set(view), (
        f"{len(set(sub.blocks) - set(view))} extra, {len(set(view) - set(sub.blocks))} missing"
    )
    assert all(sub.blocks[h][1] == tokens for h, tokens in view.items())


def run_workload(engine: Engine, rng: random.Random, requests: int, prefix: str) -> None:
    """Randomized requests sharing three prefixes, added between steps, run to completion."""
    prefixes = [[rng.randrange(3, 200) for _ in range(24)] for _ in range(3)]
    pending = list(range(requests))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            i = pending.pop()
            prompt = rng.choice(prefixes)[: rng.randrange(4, 25)] + [
                rng.randrange(3, 200) for _ in range(rng.randrange(6))
            ]
            engine.add_request(
                f"{prefix}-{i}", prompt, SamplingParams(max_new_tokens=rng.randrange(1, 12), ignore_eos=True)
            )
        engine.step()
        steps += 1
        assert steps < 20_000


def publisher_for(encoding: str = "map", **overrides: Any) -> tuple[KVEventPublisher, str]:
    """A started publisher on loopback ports the OS picks (`*`: no port chosen beforehand that another socket could
    take first), and its replay endpoint as bound."""
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", topic=TOPIC,
        replay_endpoint="tcp://127.0.0.1:*", event_encoding=encoding, **overrides,
    )  # fmt: skip
    publisher = KVEventPublisher(config)
    publisher.start()
    return publisher, publisher.replay_endpoint or ""


@pytest.fixture(scope="module")
def small_engine(bundle_dir: Path) -> Engine:
    engine = Engine.from_bundle(bundle_dir, engine_config(kv_cache_memory="24KiB", block_size=4))
    assert engine.block_manager.num_blocks < 40, engine.block_manager.num_blocks  # small: evictions are certain
    return engine


def _attach(engine: Engine, publisher: KVEventPublisher) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.reset_prefix_cache()  # start from a known-empty cache
    engine.block_manager.events = KVEventRecorder(publisher, engine.block_manager.block_size)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_subscriber_rebuilds_exactly_the_engines_cached_blocks(small_engine: Engine, encoding: str) -> None:
    engine = small_engine
    publisher, replay = publisher_for(encoding)
    _attach(engine, publisher)
    sub = Subscriber(publisher.endpoint, replay)
    try:
        run_workload(engine, random.Random(1), 40, "a")
        sub.follow(publisher_published(publisher))
        assert_same(sub, engine)
        assert sub.counts["BlockStored"] > 0 and sub.counts["BlockRemoved"] > 0, sub.counts  # evictions happened
        # a reset is published as all-cleared, and the stream goes on from there
        assert engine.block_manager.reset_prefix_cache()
        engine.step()  # the step publishes the batch
        sub.follow(publisher_published(publisher))
        assert sub.counts["AllBlocksCleared"] == 1 and sub.blocks == {}
        run_workload(engine, random.Random(2), 15, "b")
        sub.follow(publisher_published(publisher))
        assert_same(sub, engine)
        assert publisher.dropped == 0
    finally:
        engine.block_manager.events = None
        sub.close()
        publisher.close()


def publisher_published(publisher: KVEventPublisher) -> int:
    """The number of batches sent, once everything queued so far is (bounded wait)."""
    assert publisher.flush(30), "the publisher did not drain its queue"
    return publisher.published


def test_a_restarted_subscriber_catches_up_by_replay(small_engine: Engine) -> None:
    engine = small_engine
    publisher, replay = publisher_for()
    _attach(engine, publisher)
    first = Subscriber(publisher.endpoint, replay)
    try:
        run_workload(engine, random.Random(3), 20, "c")
        first.follow(publisher_published(publisher))
        assert_same(first, engine)
        state, resume = dict(first.blocks), first.next_seq
    finally:
        first.close()  # the router goes down; the engine goes on
    run_workload(engine, random.Random(4), 20, "d")
    # it comes back with the state it had persisted, and asks for what it missed
    back = Subscriber(publisher.endpoint, replay, start_seq=resume)
    back.blocks = state
    # and a new router with nothing starts from 0
    fresh = Subscriber(publisher.endpoint, replay)
    try:
        end = publisher_published(publisher)
        assert end > resume
        back.follow(end)
        fresh.follow(end)
        assert_same(back, engine)
        assert_same(fresh, engine)
        assert back.replays >= 1
    finally:
        engine.block_manager.events = None
        back.close()
        fresh.close()
        publisher.close()


def test_overflow_is_counted_never_blocks_and_is_healed_by_a_resync(small_engine: Engine) -> None:
    from prometheus_client import CollectorRegistry

    engine = small_engine
    registry = CollectorRegistry()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", topic=TOPIC,
                            replay_endpoint="tcp://127.0.0.1:*", max_queue_size=2)  # fmt: skip
    publisher = KVEventPublisher(config, registry=registry)
    _attach(engine, publisher)  # not started yet: nothing drains the 2-batch queue, so steps overflow it
    run_workload(engine, random.Random(5), 20, "e")  # returns: a full queue never blocks a step
    assert publisher.dropped > 0
    assert registry.get_sample_value("tandem_kv_events_dropped_batches_total") == publisher.dropped
    publisher.start()
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint or "")
    try:
        run_workload(engine, random.Random(6), 5, "f")  # the next step sends the resync
        sub.follow(publisher_published(publisher))
        assert_same(sub, engine)
        assert publisher.resyncs >= 1
        assert registry.get_sample_value("tandem_kv_events_resyncs_total") == publisher.resyncs
        assert registry.get_sample_value("tandem_kv_events_published_batches_total") == publisher.published
    finally:
        engine.block_manager.events = None
        sub.close()
        publisher.close()


def test_connect_mode_endpoint_reaches_a_binding_subscriber(small_engine: Engine) -> None:
    """An endpoint without `*` is connected to, as vLLM does: the subscriber binds (loopback here)."""
    engine = small_engine
    port = free_port()
    sub_endpoint = f"tcp://127.0.0.1:{port}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=sub_endpoint, topic=TOPIC, replay_endpoint=replay)
    sub = Subscriber(sub_endpoint, replay, bind=True)
    publisher = KVEventPublisher(config)
    publisher.start()
    _attach(engine, publisher)
    try:
        run_workload(engine, random.Random(7), 8, "g")
        sub.follow(publisher_published(publisher))
        assert_same(sub, engine)
    finally:
        engine.block_manager.events = None
        sub.close()
        publisher.close()


def test_config_is_vllms_json_and_bad_values_are_named(tmp_path: Path) -> None:
    text = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                       "topic": "kv-events", "replay_endpoint": "tcp://*:5558"})  # fmt: skip
    config = ScaleOutSettings(kv_events_config=text).kv_events
    assert config.enabled and config.endpoint == "tcp://*:5557" and config.buffer_steps == 10_000
    assert not ScaleOutSettings().kv_events.enabled
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for bad, word in (
        ('{"enable_kv_cache_events": true, "endpoint": "http://x"}', "endpoint"),
        ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events"),
        ('{"enable": true}', "unknown key"),
        ('{"enable_kv_cache_events": true, "max_queue_size": 0}', "max_queue_size"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ):
        with pytest.raises(SettingsError, match="kv_events_config") as err:
            ScaleOutSettings(kv_events_config=bad)
        assert word in str(err.value)
    from inference_svc.cli import build_serve_config

    settings = build_serve_config(["--model", str(tmp_path), "--kv-events-config", text])[0]
    assert settings.scale_out.kv_events.topic == "kv-events"
    with pytest.raises(SystemExit):
        build_serve_config(["--model", str(tmp_path), "--kv-events-config", '{"enable": true}'])


def test_a_served_engine_publishes_from_warmup_on(bundle_dir: Path) -> None:
    """`--kv-events-config` on a real server: the warm-up and a request are published, the counters exported, and
    a subscriber's set equals the served engine's."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    text = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "topic": TOPIC,
                       "replay_endpoint": replay})  # fmt: skip
    srv = make_server(bundle_dir, engine=engine_config(block_size=4), scale_out=ScaleOutSettings(kv_events_config=text))
    try:
        publisher = srv.server.kv_events
        assert publisher is not None and publisher.endpoint.startswith("tcp://127.0.0.1:")
        with srv.client(timeout=60) as c:
            c.generate(list(range(5, 40)), max_new_tokens=4, ignore_eos=True)
        sub = Subscriber(publisher.endpoint, replay)
        try:
            sub.follow(publisher_published(publisher))
            engine = srv.server.engine.engine
            assert_same(sub, engine)
            assert len(sub.blocks) >= 8  # the 35-token prompt's 8 whole blocks at least
        finally:
            sub.close()
        text = srv.server.metrics.render().decode()
        assert f'tandem_kv_events_published_batches_total{{model_name="bundle"}} {float(publisher.published)}' in text
    finally:
        srv.close()


def test_an_endpoint_that_cannot_be_bound_is_named() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", replay_endpoint=taken)
        publisher = KVEventPublisher(config)
        with pytest.raises(ValueError, match=taken.replace(".", r"\.")):
            publisher.start()
