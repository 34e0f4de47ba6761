"""`POST /v1/embeddings` against a real server on a loopback port, with the official `openai` SDK, checked against
transformers: a random Qwen3 folder saved by `save_pretrained`, its pooled final-norm hidden states
(`AutoModel(...).last_hidden_state`, one input at a time, unpadded) equal Tandem's (batched, right-padded) within
1e-4, for the default pooling (last token, L2-normalized) and a folder that declares sentence-transformers' mean
pooling without normalization; token ids and text inputs, float and base64 encodings, `dimensions` truncation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch

from shared_model.tokenizer import Tokenizer
from tests.inference_svc.engine.conftest import _hf_model, _save_model
from tests.inference_svc.server.conftest import ServerThread, make_server

transformers = pytest.importorskip("transformers")

TEXTS = ["def read(self, size=-1):", "import os", "x"]
IDS = [[5, 9, 200, 31, 7, 7, 400], [3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72]]


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory, small_tokenizer: Tokenizer) -> Path:
    return _save_model(tmp_path_factory.mktemp("embed"), "qwen3-embed", _hf_model("qwen3", seed=11), small_tokenizer)


@pytest.fixture(scope="module")
def mean_folder(qwen3_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights declaring sentence-transformers' mean pooling and no Normalize module."""
    import shutil

    folder = tmp_path_factory.mktemp("embed-mean") / "qwen3-mean"
    shutil.copytree(qwen3_folder, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))  # fmt: skip
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False})
    )
    return folder


def _serve(folder: Path) -> ServerThread:
    from tests.inference_svc.server.conftest import engine_config

    # a small batch budget: the 3 inputs run in more than one padded batch
    return make_server(folder, http_port=0, engine=engine_config(max_num_batched_tokens=16, max_model_len=128))


@pytest.fixture(scope="module")
def last_server(qwen3_folder: Path) -> Iterator[ServerThread]:
    srv = _serve(qwen3_folder)
    yield srv
    srv.close()


def _sdk(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server.http_port}/v1", api_key="unused", max_retries=0)


def _reference(folder: Path, ids: list[list[int]], mode: str, normalize: bool) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(folder).eval()
    rows = []
    with torch.no_grad():
        for seq in ids:
            hidden = model(torch.tensor([seq])).last_hidden_state[0]  # [T, H], after the final norm
            rows.append(hidden[-1] if mode == "last" else hidden.mean(0))
    out = torch.stack(rows)
    return torch.nn.functional.normalize(out, dim=-1) if normalize else out


def _vectors(response) -> torch.Tensor:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return torch.tensor([d.embedding for d in response.data])


def test_last_token_normalized_equals_transformers(last_server: ServerThread, qwen3_folder: Path) -> None:
    tok = Tokenizer.load(qwen3_folder)
    text_ids = [tok.encode(t) for t in TEXTS]
    want_ids = _reference(qwen3_folder, IDS, "last", True)
    want_text = _reference(qwen3_folder, text_ids, "last", True)
    with _sdk(last_server) as client:
        by_ids = client.embeddings.create(model="qwen3-embed", input=IDS, encoding_format="float")
        by_text = client.embeddings.create(model="qwen3-embed", input=TEXTS)  # the SDK asks for base64 and decodes
        one = client.embeddings.create(model="qwen3-embed", input=IDS[0], encoding_format="float")
        cut = client.embeddings.create(model="qwen3-embed", input=IDS, dimensions=16, encoding_format="float")
    torch.testing.assert_close(_vectors(by_ids), want_ids, atol=1e-4, rtol=0)
    torch.testing.assert_close(_vectors(by_text), want_text, atol=1e-4, rtol=0)
    torch.testing.assert_close(_vectors(one), want_ids[:1], atol=1e-4, rtol=0)
    torch.testing.assert_close(
        _vectors(cut), torch.nn.functional.normalize(want_ids[:, :16], dim=-1), atol=1e-4, rtol=0
    )
    assert by_ids.usage.prompt_tokens == sum(len(s) for s in IDS) == by_ids.usage.total_tokens
    assert by_text.usage.prompt_tokens == sum(len(s) for s in text_ids)


def test_mean_pooling_declared_by_the_folder(mean_folder: Path) -> None:
    srv = _serve(mean_folder)
    try:
        with _sdk(srv) as client:
            got = client.embeddings.create(model="qwen3-mean", input=IDS, encoding_format="float")
    finally:
        srv.close()
    want = _reference(mean_folder, IDS, "mean", False)
    torch.testing.assert_close(_vectors(got), want, atol=1e-4, rtol=0)
    assert not torch.allclose(want.norm(dim=-1), torch.ones(len(IDS)))  # really not normalized


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "x", "dimensions": 65}, 400, "dimensions"),
        ({"input": "x", "dimensions": 0}, 400, "dimensions"),
        ({"input": []}, 400, "input"),
        ({"input": [[1, 2], [10**6]]}, 400, "input"),
        ({"input": ""}, 400, "input"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "model": "other"}, 404, "model"),
    ],
)
def test_embedding_errors_name_the_parameter(last_server: ServerThread, body: dict, status: int, param: str) -> None:
    r = httpx.post(f"http://127.0.0.1:{last_server.server.http_port}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_pooling_from_folder_reads_sentence_transformers_modules(tmp_path: Path) -> None:
    from inference_svc.engine.pooling import Pooling
    from inference_svc.errors import ModelLoadError

    assert Pooling.from_folder(tmp_path) == Pooling("last", True)
    modules = [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    config = tmp_path / "1_Pooling" / "config.json"
    config.write_text(json.dumps({"pooling_mode_lasttoken": True}))
    pooling = Pooling.from_folder(tmp_path)
    assert (pooling.mode, pooling.normalize) == ("last", True)
    config.write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert Pooling.from_folder(tmp_path).mode == "cls"
    for bad in ({"pooling_mode_max_tokens": True}, {}, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": 1}):
        config.write_text(json.dumps(bad))
        with pytest.raises(ModelLoadError, match=r"config\.json"):
            Pooling.from_folder(tmp_path)
    config.write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot be read as JSON"):
        Pooling.from_folder(tmp_path)


def test_grpc_embed_equals_http(last_server: ServerThread, qwen3_folder: Path) -> None:
    import grpc

    from inference_svc.proto_gen import inference_pb2 as pb
    from inference_svc.proto_gen import inference_pb2_grpc as pb_grpc

    inputs = [pb.EmbedInput(token_ids=pb.TokenIds(ids=ids)) for ids in IDS] + [pb.EmbedInput(text=TEXTS[0])]
    with grpc.insecure_channel(last_server.target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        got = stub.Embed(pb.EmbedRequest(inputs=inputs), timeout=60)
        cut = stub.Embed(pb.EmbedRequest(inputs=inputs[:1], dimensions=8), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(token_ids=pb.TokenIds(ids=[10**6]))]), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput()]), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs[0]" in err.value.details()
    tok = Tokenizer.load(qwen3_folder)
    want = _reference(qwen3_folder, [*IDS, tok.encode(TEXTS[0])], "last", True)
    vectors = torch.tensor([list(e.values) for e in got.embeddings])
    torch.testing.assert_close(vectors, want, atol=1e-4, rtol=0)
    assert got.pooling == "last+normalize" and got.prompt_tokens == sum(len(s) for s in IDS) + len(tok.encode(TEXTS[0]))
    torch.testing.assert_close(
        torch.tensor([list(cut.embeddings[0].values)]), torch.nn.functional.normalize(want[:1, :8], dim=-1),
        atol=1e-4, rtol=0,
    )  # fmt: skip
    with last_server.client() as client:  # the Python client's spelling of the same call
        torch.testing.assert_close(torch.tensor(client.embed([*IDS, TEXTS[0]])), want, atol=1e-4, rtol=0)
