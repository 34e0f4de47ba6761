"""LoRA adapters over HTTP and gRPC on a real server: `model` / `lora_name` pick the adapter (greedy output equal to
transformers + PEFT's), unknown names get 404 / NOT_FOUND in OpenAI's shape, /v1/models lists the adapters with
their parent, the load and unload routes sit behind the API key and refuse bad input naming the field, an adapter in
use is not unloaded (409), `vllm:lora_requests_info` names the running adapter, and the flags parse."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import httpx2 as httpx
import pytest
import torch

from inference_svc.cli import build_serve_config
from tests.inference_svc.peft_adapters import greedy, make_adapter, make_base
from tests.inference_svc.server.conftest import ServerThread, engine_config, make_server

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

KEY = "lora-test-key"
PROMPT = list(range(20, 20 + 13))
N = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory, small_tokenizer) -> dict:
    root = tmp_path_factory.mktemp("lora-serving")
    base = make_base(root / "base", small_tokenizer, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    out: dict = {"base": base, "want": {None: greedy(hf, PROMPT, N)}, "dirs": {}}
    for name, seed, rank in (("a", 21, 4), ("c", 22, 8), ("big", 23, 16)):
        model = make_adapter(base, root / name, seed, rank=rank)
        out["want"][name] = greedy(model, PROMPT, N)
        out["dirs"][name] = root / name
    return out


class Hold:
    """Fault hook: the request 'held' stops the engine thread at its second increment until released."""

    def __init__(self) -> None:
        self.held, self.release = threading.Event(), threading.Event()
        self.count = 0

    def __call__(self, out) -> None:
        if out.request_id == "held":
            self.count += 1
            if self.count == 2:
                self.held.set()
                self.release.wait(60)


@pytest.fixture(scope="module")
def hold() -> Hold:
    return Hold()


@pytest.fixture(scope="module")
def srv(models, hold) -> Iterator[ServerThread]:
    config = engine_config(lora_modules=(f"a={models['dirs']['a']}",), max_loras=2, max_lora_rank=8)
    s = make_server(models["base"], engine=config, http_port=0, metrics_port=0, api_keys=(KEY,), fault_hook=hold)
    yield s
    hold.release.set()
    s.close()


def _post(srv: ServerThread, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"http://127.0.0.1:{srv.server.http_port}{path}", json=body, headers=headers, timeout=60)


def _complete(srv: ServerThread, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    return _post(srv, "/v1/completions", body)


def _grpc_ids(srv: ServerThread, lora_name: str = "") -> list[int]:
    with srv.client(timeout=60, api_key=KEY) as c:
        return list(c.generate(PROMPT, lora_name=lora_name, max_new_tokens=N, ignore_eos=True).token_ids)


def test_requests_pick_adapters_by_name(srv, models, small_tokenizer):
    want = models["want"]
    assert want["a"] != want[None]
    assert _grpc_ids(srv, "a") == want["a"]
    assert _grpc_ids(srv) == want[None]
    r = _complete(srv, "a")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "a"
    assert r.json()["choices"][0]["text"] == small_tokenizer.decode(want["a"])
    base = _complete(srv, srv.server.settings.model_name).json()
    assert base["choices"][0]["text"] == small_tokenizer.decode(want[None])
    body = {"model": "a", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True, "stream": True}
    events = _post(srv, "/v1/completions", body).text.split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    assert chunks and all(c["model"] == "a" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == small_tokenizer.decode(want["a"])


def test_unknown_adapter_is_404_in_openai_shape(srv):
    r = _complete(srv, "nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and err["code"] == "NOT_FOUND" and err["param"] == "model"
    assert "'nope' does not exist here" in err["message"] and "a" in err["message"]
    with pytest.raises(grpc.RpcError) as info:
        _grpc_ids(srv, "nope")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in info.value.details()


def test_models_list_adapters_with_their_parent(srv, models):
    base = srv.server.settings.model_name
    r = httpx.get(f"http://127.0.0.1:{srv.server.http_port}/v1/models", headers={"authorization": f"Bearer {KEY}"})
    cards = {c["id"]: c for c in r.json()["data"]}
    assert cards["a"]["parent"] == base and cards["a"]["root"] == str(models["dirs"]["a"].resolve())
    assert base in cards
    one = httpx.get(f"http://127.0.0.1:{srv.server.http_port}/v1/models/a", headers={"authorization": f"Bearer {KEY}"})
    assert one.json()["parent"] == base
    with srv.client(timeout=60, api_key=KEY) as c:  # gRPC: GetModelInfo lists them too
        info = c.model_info()
    assert [(a.name, a.rank) for a in info.lora_adapters] == [("a", 4)] and info.max_loras == 2


def test_load_and_unload_routes(srv, models):
    c_dir = str(models["dirs"]["c"])
    # behind the API key
    assert _post(srv, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": c_dir}, key=None).status_code == 401
    assert _post(srv, "/v1/unload_lora_adapter", {"lora_name": "a"}, key="wrong").status_code == 401
    # refusals, one line naming the field
    big = _post(srv, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(models["dirs"]["big"])})
    assert big.status_code == 400 and big.json()["error"]["param"] == "r"
    assert "rank 16, above --max-lora-rank 8" in big.json()["error"]["message"]
    dup = _post(srv, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": c_dir})
    assert dup.status_code == 400 and dup.json()["error"]["param"] == "lora_name"
    missing = _post(srv, "/v1/load_lora_adapter", {"lora_name": "m", "lora_path": "/nonexistent/adapter"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    # load, serve, unload
    ok = _post(srv, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": c_dir})
    assert ok.status_code == 200 and "'c' added" in ok.text
    assert _grpc_ids(srv, "c") == models["want"]["c"]
    full = _post(srv, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": c_dir})
    assert full.status_code == 400 and full.json()["error"]["param"] == "max_loras"
    assert _post(srv, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    assert _complete(srv, "c").status_code == 404
    gone = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "NOT_FOUND"


def test_adapter_in_use_is_not_unloaded_and_is_reported(srv, hold):
    from tests.inference_svc.server.test_metrics_vllm import _scrape

    engine = srv.server.engine
    results: list = []
    with srv.client(timeout=60, api_key=KEY) as c:
        reader = threading.Thread(
            target=lambda: results.append(
                c.generate(PROMPT, request_id="held", lora_name="a", max_new_tokens=N, ignore_eos=True)
            )
        )
        reader.start()
        try:
            assert hold.held.wait(60), "the held request never reached its second increment"
            [info] = _scrape(srv.server.metrics_port)["vllm:lora_requests_info"].samples
            assert info.labels == {"max_lora": "2", "running_lora_adapters": "a", "waiting_lora_adapters": ""}
            answer: list = []
            unloader = threading.Thread(
                target=lambda: answer.append(_post(srv, "/v1/unload_lora_adapter", {"lora_name": "a"}))
            )
            unloader.start()
            deadline = time.monotonic() + 30
            while engine.thread.inbox.qsize() == 0:  # the unload is queued behind the held step
                assert time.monotonic() < deadline, "the unload never reached the engine's inbox"
                time.sleep(0.01)
        finally:
            hold.release.set()
            reader.join(60)
        unloader.join(60)
    assert answer[0].status_code == 409, answer[0].text
    err = answer[0].json()["error"]
    assert err["param"] == "lora_name" and "'a' serves 1 unfinished request" in err["message"]
    assert len(results) == 1 and len(results[0].token_ids) == N  # the request itself finished untouched


def test_flags_parse(models):
    a, c = models["dirs"]["a"], models["dirs"]["c"]
    argv = [str(models["base"]), "--lora-modules", f"a={a}", "--lora-modules", f"c={c}", "--max-loras", "3",
            "--max-lora-rank", "8"]  # fmt: skip
    _, config, _ = build_serve_config(argv)
    assert config.lora_modules == (f"a={a}", f"c={c}") and config.max_loras == 3 and config.max_lora_rank == 8
    _, plain, _ = build_serve_config([str(models["base"])])
    assert plain.lora_modules == () and not plain.lora_enabled
    with pytest.raises(SystemExit):
        build_serve_config([str(models["base"]), "--lora-modules", "no-equals-sign"])
    with pytest.raises(SystemExit):  # an adapter may not take the served model's own name
        build_serve_config([str(models["base"]), "--served-model-name", "m", "--lora-modules", f"m={a}"])


def test_started_with_a_bad_adapter_refuses_to_start(models):
    from inference_svc.errors import ModelLoadError

    config = engine_config(lora_modules=(f"big={models['dirs']['big']}",), max_lora_rank=8)
    with pytest.raises(Exception) as info:
        make_server(models["base"], engine=config)
    err = info.value
    while not isinstance(err, ModelLoadError) and err.__cause__ is not None:
        err = err.__cause__
    assert "lora_modules: big=" in str(err) and "above --max-lora-rank 8" in str(err)


@pytest.mark.slow
def test_tandem_serve_with_lora_modules_serves_them(models, tmp_path, small_tokenizer):
    """The whole command line: `tandem serve DIR --lora-modules a=... --lora-modules '{"name", "path"}'` in its own
    process; both adapters answer as PEFT does, and /v1/models lists them under the base."""
    from inference_svc.serve_process import ServeProcess, free_port

    http = free_port()
    c = json.dumps({"name": "c", "path": str(models["dirs"]["c"])})
    flags = ["--http-port", str(http), "--metrics-port", "0", "--lora-modules", f"a={models['dirs']['a']}",
             "--lora-modules", c, "--max-loras", "2", "--max-lora-rank", "8", "--dtype", "float32"]  # fmt: skip
    with ServeProcess(models["base"], flags, log=tmp_path / "serve.log") as srv:
        srv.wait_serving(180)
        url = f"http://127.0.0.1:{http}"
        for name in ("a", "c"):
            body = {"model": name, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == small_tokenizer.decode(models["want"][name])
        cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=60).json()["data"]}
        assert cards["a"]["parent"] == cards["c"]["parent"] == models["base"].name
