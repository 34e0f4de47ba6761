"""Fixtures for the gRPC server tests: a tiny random bundle and real servers on free loopback ports.

`ServerThread` runs a `TandemServer` in its own thread and event loop, so tests talk to it through real gRPC
channels with the ordinary blocking client, exactly like another process would.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from inference_svc.client import TandemClient
from inference_svc.engine.config import EngineConfig
from inference_svc.server import TandemServer
from inference_svc.settings import AdmissionLimits, ServerSettings
from shared_model.bundle import save_bundle
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer
from tests.conftest import free_port, tiny_config

MAX_CONTEXT = 128
MAX_NEW_TOKENS_LIMIT = 64


@pytest.fixture(scope="session")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory, small_tokenizer: Tokenizer) -> Path:
    """A 2-layer qwen3 with peaked logits (std 0.2: few greedy near-ties) and the session tokenizer."""
    config = tiny_config()
    model = build_model(config, seed=0)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(3))
    return save_bundle(tmp_path_factory.mktemp("server-model") / "bundle", config, model, small_tokenizer)


@pytest.fixture(scope="session")
def long_bundle(tmp_path_factory: pytest.TempPathFactory, small_tokenizer: Tokenizer) -> Path:
    """`bundle_dir`'s model with a 2,048-position context (tool definitions make long prompts)."""
    config = tiny_config(max_position_embeddings=2048)
    model = build_model(config, seed=0)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(3))
    return save_bundle(tmp_path_factory.mktemp("long-model") / "bundle", config, model, small_tokenizer)


def engine_config(**overrides: Any) -> EngineConfig:
    base: dict[str, Any] = dict(
        kv_cache_memory="2MiB",
        max_model_len=MAX_CONTEXT,
        max_new_tokens_limit=MAX_NEW_TOKENS_LIMIT,
        dtype="float32",
        device="cpu",
        attention_backend="torch",
    )
    base.update(overrides)
    return EngineConfig(**base)


class ServerThread:
    """A TandemServer on 127.0.0.1:<free port>, its event loop in a background thread."""

    def __init__(self, server: TandemServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self._thread.start()
        self.call(server.start(), timeout=120)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def call(self, coro: Any, timeout: float = 60) -> Any:
        future: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def submit(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stats(self) -> Any:
        assert self.server.engine is not None
        return self.call(self.server.engine.stats())

    def client(self, **kwargs: Any) -> TandemClient:
        return TandemClient(self.target, **kwargs)

    def close(self, grace: float = 0.0) -> None:
        if not self.server.draining:
            self.call(self.server.shutdown(grace), timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def make_server(
    bundle: Path,
    *,
    engine: EngineConfig | None = None,
    admission: AdmissionLimits | None = None,
    fault_hook: Callable | None = None,
    **settings: Any,
) -> ServerThread:
    base: dict[str, Any] = dict(
        model=str(bundle),
        host="127.0.0.1",
        port=free_port(),
        metrics_port=None,
        http_port=None,
        shutdown_grace=5.0,
        admission=admission or AdmissionLimits(),
    )
    base.update(settings)
    server = TandemServer(ServerSettings(**base), engine or engine_config(), fault_hook=fault_hook)
    return ServerThread(server)


@pytest.fixture(scope="module")
def server(bundle_dir: Path) -> Iterator[ServerThread]:
    """One plain server shared by a module's tests (they must leave it idle)."""
    srv = make_server(bundle_dir, max_request_bytes=4096)
    yield srv
    srv.close()


@pytest.fixture
def slow_steps(server: ServerThread) -> Iterator[None]:
    """Test-only fault hook: 50 ms of extra latency per increment of requests whose id starts with 'slow-'."""
    engine = server.server.engine
    assert engine is not None

    def slow(out) -> None:
        if out.request_id.startswith("slow-"):
            time.sleep(0.05)

    engine.fault_hook = slow
    yield
    engine.fault_hook = None


@pytest.fixture
def client(server: ServerThread) -> Iterator[TandemClient]:
    with server.client(timeout=60) as c:
        yield c


def wait_idle(server: ServerThread, timeout: float = 30.0) -> Any:
    """Poll until the engine holds no request and no KV block (bounded: fails naming what was left behind); returns
    the idle engine's stats."""
    deadline = time.monotonic() + timeout
    while True:
        st = server.stats()
        if st.num_running == 0 and st.num_waiting == 0 and st.kv_blocks_used == 0:
            assert server.server.engine is not None and server.server.engine.num_in_flight == 0
            return st
        assert time.monotonic() < deadline, f"KV blocks or requests left behind: {st}"
        time.sleep(0.02)


def metric_value(text: str | bytes, name: str, **labels: str) -> float:
    """The value of the one sample `name` (exposition name, e.g. `tandem_request_errors_total`) whose labels include
    `labels` (other labels, such as `model_name`, may be present); 0.0 when no such sample exists yet."""
    from prometheus_client.parser import text_string_to_metric_families

    body = text.decode() if isinstance(text, bytes) else text
    found = [
        s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    assert len(found) <= 1, f"{len(found)} samples {name}{labels}: ask for more labels"
    return found[0] if found else 0.0


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""A minimal chat template for the tests that serve chat (role: content lines, then `assistant:`)."""


def with_chat_template(bundle: Path, folder: Path, template: str = CHAT_TEMPLATE) -> Path:
    """A copy of `bundle` at `folder` whose tokenizer_config.json carries `template`."""
    shutil.copytree(bundle, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def chat_bundle(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's bundle with `CHAT_TEMPLATE`."""
    return with_chat_template(bundle_dir, tmp_path_factory.mktemp("chat") / "chat-model")
