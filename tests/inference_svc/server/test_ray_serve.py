"""Tandem on Ray Serve (issue 36, goal 3): a local Ray instance, 2 tiny replicas on loopback behind Ray Serve's
`PrefixCacheAffinityRouter`. Requests sharing a long prefix land on the replica that holds it (its prefix-cache hit
counter shows it, the other's does not move); a replica killed mid-stream ends that stream with an error event
instead of hanging, new requests keep being served, and Ray starts a replacement.

Ray's resources are kept minimal (2 CPUs, half a CPU per replica, no dashboard, a 100 MiB object store). Every wait
is bounded; none asserts a duration. The slow stream relies on the engine's test-only fault hook
(`serve_with_slow_steps.slow_steps`: each increment of a request whose id starts with 'slow-' takes >= 20 ms).
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from inference_svc.ray_serve import REPLICA_HEADER, build_app, routing_text  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.inference_svc.server.conftest import engine_config  # noqa: E402
from tests.inference_svc.server.serve_with_slow_steps import slow_steps  # noqa: E402

MODEL = "bundle"
PREFIX = "def handle_request(self, request, context):\n    " + "value = compute(value, context) + 1\n    " * 6


@pytest.fixture(scope="module")
def app(bundle_dir: Path) -> Iterator[int]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20,
             namespace="tandem-ray-test")  # fmt: skip
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = engine_config(block_size=4, max_model_len=512, kv_cache_memory="8MiB", max_new_tokens_limit=480)
        serve.run(build_app(str(bundle_dir), replicas=2, engine_config=config, num_cpus=0.5, fault_hook=slow_steps),
                  name="tandem", route_prefix="/")  # fmt: skip
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def post(port: int, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read() or b"{}")
    finally:
        conn.close()


def replica_stats(seen_at_least: int = 2, exclude: frozenset[str] = frozenset(), timeout: float = 240) -> dict:
    """Every live replica's stats, by replica id: `stats()` carries no prompt, so the router spreads the calls
    (power of two choices); ask until `seen_at_least` distinct replicas, none of them in `exclude`, answered."""
    handle = serve.get_deployment_handle("TandemReplica", app_name="tandem")
    found: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = handle.stats.remote().result(timeout_s=60)
            found[s["replica"]] = s
        except Exception:  # a replica being replaced
            time.sleep(0.5)
        live = {k: v for k, v in found.items() if k not in exclude}
        if len(live) >= seen_at_least:
            return live
        assert time.monotonic() < deadline, f"only {sorted(found)} answered"
        if len(found) > seen_at_least + 3:
            found.clear()


def test_serve_ray_flags_and_app_are_validated(tmp_path: Path) -> None:
    from inference_svc.ray_serve import _parser, prefix_affinity_router

    args = _parser().parse_args(["--model", str(tmp_path), "--replicas", "3", "--kv-cache-memory", "64MiB"])
    assert args.replicas == 3 and args.kv_cache_memory == "64MiB" and args.imbalanced_threshold == float("inf")
    with pytest.raises(ValueError, match="replicas"):
        build_app(str(tmp_path), replicas=0)
    assert prefix_affinity_router().__name__ == "PrefixCacheAffinityRouter"


def test_routing_text_is_what_the_router_matches() -> None:
    assert routing_text("/v1/completions", json.dumps({"prompt": "abc"}).encode()) == "abc"
    chat = {
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "u"}]}]
    }
    assert routing_text("/v1/chat/completions", json.dumps(chat).encode()) == "su"
    assert routing_text("/v1/completions", json.dumps({"prompt": [5, 6]}).encode()) == "5 6 "
    assert routing_text("/v1/models", b"") == "/v1/models"  # never empty
    assert routing_text("/v1/completions", b"{not json") == "/v1/completions"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_shared_prefix_lands_on_the_replica_that_holds_it(app: int) -> None:
    before = replica_stats()
    status, headers, first = post(app, "/v1/completions", {"model": MODEL, "prompt": PREFIX + "first", "max_tokens": 2})
    assert status == 200, first
    holder = headers[REPLICA_HEADER]
    cached = []
    for suffix in ("second", "third", "fourth", "fifth"):
        status, headers, out = post(
            app, "/v1/completions", {"model": MODEL, "prompt": PREFIX + suffix, "max_tokens": 2}
        )
        assert status == 200, out
        assert headers[REPLICA_HEADER] == holder, "a request sharing the prefix went to the other replica"
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert all(c > 0 for c in cached), cached
    after = replica_stats()
    assert set(after) == set(before)
    [other] = set(after) - {holder}
    hits = {r: after[r]["prefix_cache_hit_tokens"] - before[r]["prefix_cache_hit_tokens"] for r in after}
    assert hits[holder] == sum(cached) > 0
    assert hits[other] == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_replica_ends_its_stream_with_an_error_and_is_replaced(app: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", app, timeout=120)
    body = {"model": MODEL, "prompt": "while True:", "max_tokens": 450, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"content-type": "application/json", "x-request-id": "slow-victim"})  # fmt: skip
    response = conn.getresponse()
    assert response.status == 200
    victim = response.getheader(REPLICA_HEADER)
    assert victim
    events: list[str] = []
    while not events:
        line = response.readline().decode().strip()
        if line.startswith("data: "):
            events.append(line[6:])
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    while True:  # bounded by the socket timeout: a hang fails the test
        line = response.readline()
        if not line:
            break
        text = line.decode().strip()
        if text.startswith("data: "):
            events.append(text[6:])
    conn.close()
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])
    assert error["error"]["code"] == "UNAVAILABLE", error
    tokens = [e for e in events[:-2] if "choices" in e]
    assert 0 < len(tokens) < 450  # cut mid-run
    for i in range(4):  # served at once by the survivor (a request sent to the dead replica is retried)
        status, headers, out = post(app, "/v1/completions", {"model": MODEL, "prompt": f"x = {i}", "max_tokens": 2})
        assert status == 200, out
        assert headers[REPLICA_HEADER] != victim
    stats = replica_stats(exclude=frozenset({victim}))  # Ray started a replacement
    assert len(stats) == 2 and victim not in stats
    status, _, out = post(app, "/v1/completions", {"model": MODEL, "prompt": "y = 1", "max_tokens": 2})
    assert status == 200, out
