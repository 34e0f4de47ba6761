"""Held-out perplexity: offline (`shared_model`) equals the service's (prompt logprobs over gRPC and HTTP) on the
same windows, a briefly trained model beats its random initialisation, and `tandem eval` reports both."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from inference_svc.eval_cli import main as eval_main
from inference_svc.evaluation import evaluate_grpc, evaluate_http
from shared_model.bundle import load_bundle, save_bundle
from shared_model.evaluate import evaluate_offline, text_windows, token_nll, windows
from shared_model.model import build_model
from tests.conftest import tiny_config
from tests.inference_svc.server.conftest import engine_config, make_server

TEXTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n        print(os.path.basename(name))\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, x):\n        self.items.append(x)\n",
]


def test_windows_score_every_token_once_with_a_stride() -> None:
    ids = list(range(50))
    for stride in (None, 16, 5, 1):
        ws = windows(ids, 16, stride)
        scored = [t for w in ws for t in w.scored]
        if stride in (None, 16):  # non-overlapping (a stride of a whole window too): each first token is context
            assert scored == [t for t in ids if t % 16 != 0]
        else:
            assert scored == ids[1:]
        assert all(len(w.ids) <= 16 and w.first_scored >= 1 for w in ws)


@pytest.mark.parametrize("stride", [None, 24])
def test_offline_equals_the_service_over_both_protocols(bundle_dir, stride) -> None:
    srv = make_server(bundle_dir, http_port=0, engine=engine_config(kv_cache_memory="4MiB"))
    try:
        bundle = load_bundle(bundle_dir, dtype=torch.float32)
        tok = bundle.tokenizer
        ws = text_windows(tok, TEXTS, 48, stride)
        assert len(ws) >= 2
        offline = evaluate_offline(bundle.model.eval(), tok, TEXTS, 48, stride)
        grpc_res = asyncio.run(evaluate_grpc(srv.target, ws, tok))
        http_res = asyncio.run(evaluate_http(f"http://127.0.0.1:{srv.server.http_port}", ws, tok, max_context=128))
        for res in (grpc_res, http_res):
            assert (res.tokens, res.bytes, res.windows) == (offline.tokens, offline.bytes, offline.windows)
            assert res.perplexity == pytest.approx(offline.perplexity, rel=1e-4)
            assert res.bits_per_byte == pytest.approx(offline.bits_per_byte, rel=1e-4)
        assert offline.bits_per_byte == pytest.approx(offline.nll / math.log(2) / offline.bytes)
    finally:
        srv.close()


def test_a_briefly_trained_model_beats_its_random_init(tmp_path, small_tokenizer) -> None:
    config = tiny_config(vocab_size=small_tokenizer.vocab_size)
    model = build_model(config, seed=0)
    before = evaluate_offline(model.eval(), small_tokenizer, TEXTS, 32)
    ids = torch.tensor([small_tokenizer.encode("\n\n".join(TEXTS * 4))])  # [1, N]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(30):
        lo = (step * 17) % (ids.shape[1] - 33)
        batch = ids[:, lo : lo + 33]
        nll, count = token_nll(model(batch[:, :-1]), batch[:, 1:])
        opt.zero_grad()
        (nll / count).backward()
        opt.step()
    folder = save_bundle(tmp_path / "trained", config, model, small_tokenizer)
    after = evaluate_offline(load_bundle(folder, dtype=torch.float32).model.eval(), small_tokenizer, TEXTS, 32)
    assert after.tokens == before.tokens
    assert after.perplexity < 0.8 * before.perplexity, (before.perplexity, after.perplexity)


def test_tandem_eval_reports_offline_grpc_and_http(bundle_dir, tmp_path, capsys) -> None:
    data = tmp_path / "held-out.py"
    data.write_text("\n\n".join(TEXTS))
    srv = make_server(bundle_dir, http_port=0)
    try:
        argv = ["--model", str(bundle_dir), "--data", str(data), "--target", srv.target, "--protocol", "both"]
        assert eval_main([*argv, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["window"] == 127  # the model's 512 positions, capped by the server's context of 128 - 1
        for path in ("grpc", "http"):
            assert out[path]["relative_difference"] < 1e-4 and out[path]["tokens"] == out["offline"]["tokens"]
        assert eval_main(argv) == 0
        table = capsys.readouterr().out
        assert "perplexity" in table and "grpc" in table and "http" in table
    finally:
        srv.close()
    assert eval_main(["--model", str(bundle_dir), "--data", str(tmp_path / "missing.txt")]) == 2
    assert "is not a file" in capsys.readouterr().err
