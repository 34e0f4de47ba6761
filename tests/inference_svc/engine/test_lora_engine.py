"""LoRA adapters in the engine's step: greedy output equal to transformers + PEFT's, mixed batches equal to each
request alone, base rows bit-identical to an engine without LoRA, the prefix cache keyed by adapter, and every bad
adapter refused in one line naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import tandem_native
from inference_svc.engine import EngineConfig
from inference_svc.engine.config import EngineConfigError
from inference_svc.engine.types import SamplingParams
from inference_svc.errors import AdapterInUseError, ModelLoadError, ModelNotFoundError
from inference_svc.lora.adapter import AdapterError, load_adapter
from tests.inference_svc.peft_adapters import MLP, greedy, make_adapter

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PROMPTS = [list(range(5, 5 + 11)), list(range(40, 40 + 23)), list(range(300, 300 + 7)), list(range(90, 90 + 19))]
N = 8


@pytest.fixture(scope="module")
def adapters(qwen3_dir: Path, tmp_path_factory) -> dict:
    """Two adapters of the qwen3 folder ('a': every projection, rank 4; 'b': q, v and the MLP, rank 8), their PEFT
    models' greedy outputs, and the base model's."""
    root = tmp_path_factory.mktemp("adapters")
    base = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    out: dict = {"base": [greedy(base, p, N) for p in PROMPTS], "dirs": {}}
    for name, seed, rank, targets in (("a", 11, 4, None), ("b", 12, 8, ("q_proj", "v_proj", *MLP))):
        kwargs = {"targets": targets} if targets else {}
        model = make_adapter(qwen3_dir, root / name, seed, rank=rank, **kwargs)
        out[name] = [greedy(model, p, N) for p in PROMPTS]
        out["dirs"][name] = root / name
        with torch.no_grad():  # each prompt token's log-probability given the ones before it (PEFT's forward)
            logits = model(input_ids=torch.tensor([PROMPTS[1]])).logits[0, :-1].float()
        out[f"{name}-prompt-logprobs"] = logits.log_softmax(-1).gather(1, torch.tensor(PROMPTS[1][1:])[:, None])[:, 0]
    return out


def _lora_engine(make_engine, qwen3_dir, adapters, **kw):
    mods = tuple(f"{n}={d}" for n, d in adapters["dirs"].items())
    kw.setdefault("max_loras", 3)
    return make_engine(qwen3_dir, lora_modules=mods, max_lora_rank=8, compile="auto", **kw)


def _params(name: str | None, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=N, ignore_eos=True, lora_name=name, **kw)


def test_each_adapter_matches_peft_greedy(qwen3_dir, adapters, make_engine):
    engine = _lora_engine(make_engine, qwen3_dir, adapters)
    for name in ("a", "b"):
        got = [r.token_ids for r in (engine.generate([p], _params(name))[0] for p in PROMPTS)]
        assert got == adapters[name], name
        assert got != adapters["base"]  # the adapters do change the output (B is not zero)
    base = [engine.generate([p], _params(None))[0].token_ids for p in PROMPTS]
    assert base == adapters["base"]
    plan = engine.load_plan
    assert plan.value("lora") == "2/3"
    assert plan.value("compile") == "off" and "LoRA" in next(c.reason for c in plan if c.lever == "compile")
    fused = tandem_native.available()  # the C++ kernels are on by default where they run
    assert ("fused" in next(c.reason for c in plan if c.lever == "lora")) == fused
    assert ("tandem::lora_delta_" in next(c.reason for c in plan if c.lever == "linear.qkv_proj")) == fused


def test_the_torch_path_without_the_native_kernels(qwen3_dir, adapters, make_engine):
    """--cpu-kernels off (as on a GPU, or a CPU the library does not run on): the deltas run as torch's matmuls,
    recorded so, with the same PEFT parity and mixed-batch equality as the fused operator."""
    engine = _lora_engine(make_engine, qwen3_dir, adapters, cpu_kernels="off", enable_prefix_caching=False)
    assert engine.lora.fused is None
    assert "torch: one small batched matmul pair" in next(c.reason for c in engine.load_plan if c.lever == "lora")
    for name in ("a", "b"):
        assert [engine.generate([p], _params(name))[0].token_ids for p in PROMPTS] == adapters[name], name
    names = ["b", None, "a", "b"]  # two adapters' rows apart: the padded bmm pair
    together = engine.generate(PROMPTS, [_params(n) for n in names])
    assert [r.token_ids for r in together] == [adapters[n or "base"][i] for i, n in enumerate(names)]


def test_prompt_logprobs_under_an_adapter_equal_peft_forward(qwen3_dir, adapters, make_engine):
    """Not only the argmax: every prompt position's log-probability through the adapter's prefill equals PEFT's
    within fp32 tolerance (chunked, so the chunks after the first read the adapter's own cached K/V)."""
    engine = _lora_engine(make_engine, qwen3_dir, adapters, prefill_chunk_size=8)
    for name in ("a", "b"):
        res = engine.generate([PROMPTS[1]], _params(name, prompt_logprobs=0))[0]
        got = torch.tensor([p.logprob for p in res.prompt_logprobs[1:]])
        torch.testing.assert_close(got, adapters[f"{name}-prompt-logprobs"], atol=1e-4, rtol=1e-4)


def test_mixed_batch_gives_each_request_what_it_gets_alone(qwen3_dir, adapters, make_engine):
    engine = _lora_engine(make_engine, qwen3_dir, adapters, enable_prefix_caching=False)
    names = [None, "a", "b", "a"]  # slots 0 and 1, rows apart (torch path: two groups padded to 2 rows)
    together = engine.generate(PROMPTS, [_params(n) for n in names])
    for i, (res, name) in enumerate(zip(together, names, strict=True)):
        assert res.token_ids == (adapters["base"] if name is None else adapters[name])[i]
    # slots 1 and 2 (not 0..G-1: the stacked weights are selected by index): 'c' is 'a' loaded again, in slot 2
    engine.lora.load(load_adapter("c", adapters["dirs"]["a"], engine.model_config, 8))
    names = ["b", "c", None, "c"]
    together = engine.generate(PROMPTS, [_params(n) for n in names])
    want = {"b": adapters["b"], "c": adapters["a"], None: adapters["base"]}
    assert [r.token_ids for r in together] == [want[n][i] for i, n in enumerate(names)]


def test_base_rows_are_bit_identical_to_an_engine_without_lora(qwen3_dir, adapters, make_engine):
    plain = make_engine(qwen3_dir, enable_prefix_caching=False)
    lora = _lora_engine(make_engine, qwen3_dir, adapters, enable_prefix_caching=False)
    want = plain.generate(PROMPTS, [_params(None, logprobs=True)] * 4)
    got = lora.generate(PROMPTS, [_params(n, logprobs=True) for n in (None, "a", None, "b")])
    for i in (0, 2):
        assert got[i].token_ids == want[i].token_ids
        assert got[i].logprobs == want[i].logprobs  # the same bits, not just the same argmax


def test_prefix_cache_never_crosses_adapters(qwen3_dir, adapters, make_engine):
    engine = _lora_engine(make_engine, qwen3_dir, adapters, block_size=16, enable_prefix_caching=True)
    prompt = list(range(7, 7 + 40))  # two full blocks cached after the first run
    base = engine.generate([prompt], _params(None))[0]
    first_a = engine.generate([prompt], _params("a"))[0]
    assert first_a.usage.cached_prompt_tokens == 0  # the base model's blocks are not reused for 'a'
    again_a = engine.generate([prompt], _params("a"))[0]
    assert again_a.usage.cached_prompt_tokens == 32 and again_a.token_ids == first_a.token_ids
    assert engine.generate([prompt], _params("b"))[0].usage.cached_prompt_tokens == 0
    assert engine.generate([prompt], _params(None))[0].usage.cached_prompt_tokens == 32
    # a fresh engine computing 'a' from nothing agrees, so the cached run read 'a's own K/V
    fresh = _lora_engine(make_engine, qwen3_dir, adapters, enable_prefix_caching=False)
    assert fresh.generate([prompt], _params("a"))[0].token_ids == first_a.token_ids != base.token_ids
    # unloaded and loaded again from the same folder: a new namespace, nothing reused
    engine.unload_lora_adapter("a")
    engine.lora.load(load_adapter("a", adapters["dirs"]["a"], engine.model_config, 8))
    assert engine.generate([prompt], _params("a"))[0].usage.cached_prompt_tokens == 0


def test_unknown_adapter_and_unload_rules(qwen3_dir, adapters, make_engine):
    engine = _lora_engine(make_engine, qwen3_dir, adapters, max_loras=2)
    with pytest.raises(ModelNotFoundError, match="'nope' is not loaded"):
        engine.add_request("r0", PROMPTS[0], _params("nope"))
    with pytest.raises(ModelNotFoundError, match="'nope'"):
        engine.unload_lora_adapter("nope")
    engine.add_request("r1", PROMPTS[0], _params("b"))
    with pytest.raises(AdapterInUseError, match="'b' serves 1 unfinished"):
        engine.unload_lora_adapter("b")
    with pytest.raises(AdapterError, match="max_loras: all 2 adapter slots are in use"):
        engine.lora.load(load_adapter("c", adapters["dirs"]["a"], engine.model_config, 8))
    while engine.has_unfinished_requests():
        engine.step()
    engine.unload_lora_adapter("b")
    with pytest.raises(ModelNotFoundError):
        engine.add_request("r2", PROMPTS[0], _params("b"))
    plain = make_engine(qwen3_dir)
    with pytest.raises(ModelNotFoundError, match="serves no adapters"):
        plain.add_request("r3", PROMPTS[0], _params("a"))


def _edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_adapters_are_refused_naming_the_field(qwen3_dir, adapters, tmp_path, make_engine):
    engine = _lora_engine(make_engine, qwen3_dir, adapters)
    config = engine.model_config
    b = adapters["dirs"]["b"]

    def refused(path: Path, max_rank: int = 8) -> AdapterError:
        with pytest.raises(AdapterError) as info:
            load_adapter("x", path, config, max_rank)
        assert "\n" not in str(info.value)
        return info.value

    assert refused(b, max_rank=4).field == "r" and "rank 8, above --max-lora-rank 4" in str(refused(b, 4))
    err = refused(_edited(b, tmp_path / "t", target_modules=["q_proj", "c_attn"]))
    assert err.field == "target_modules" and "c_attn" in str(err)
    assert refused(_edited(b, tmp_path / "d", use_dora=True)).field == "use_dora"
    assert refused(tmp_path / "missing").field == "lora_path"
    # an adapter of another base (a wider MLP): refused by shape, naming the base
    other_dir = tmp_path / "other-base"
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=96)  # fmt: skip
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(other_dir)
    make_adapter(other_dir, tmp_path / "other", seed=1)
    err = refused(tmp_path / "other")
    assert err.field == "base_model" and "trained on another base model" in str(err)
    # the same refusals at start-up: one line naming lora_modules and the field
    with pytest.raises(ModelLoadError, match=r"lora_modules: big=.*r: .*above --max-lora-rank 4"):
        make_engine(qwen3_dir, lora_modules=(f"big={b}",), max_lora_rank=4)


def test_config_refusals():
    with pytest.raises(EngineConfigError, match="compile: 'on' cannot serve LoRA"):
        EngineConfig(lora_modules=("a=/x",), compile="on")
    with pytest.raises(EngineConfigError, match="lora_modules: each must be NAME=DIR"):
        EngineConfig(lora_modules=("just-a-dir",))
    with pytest.raises(EngineConfigError, match="lora_modules: each must be NAME=DIR"):
        EngineConfig(lora_modules=('{"name": "a"}',))
    json_form = EngineConfig(lora_modules=('{"name": "a", "path": "/x", "base_model_name": "m"}', "b=/y"), max_loras=2)
    assert json_form.lora_module_dirs == [("a", "/x"), ("b", "/y")]
    with pytest.raises(EngineConfigError, match="lora_modules: the adapter name 'a' is given twice"):
        EngineConfig(lora_modules=("a=/x", "a=/y"), max_loras=2)
    with pytest.raises(EngineConfigError, match="lora_modules: 2 adapters are more than --max-loras 1"):
        EngineConfig(lora_modules=("a=/x", "b=/y"))


def test_rows_are_grouped_by_adapter_once_per_step():
    from inference_svc.lora.slots import group_rows

    cpu = torch.device("cpu")
    assert group_rows([-1, -1], cpu) is None
    run = group_rows([-1, 2, 2, 0, -1], cpu)  # one run, groups in slot order: sliced in place
    assert run.gather is None and run.span == slice(1, 4) and run.groups == ((2, slice(0, 2)), (0, slice(2, 3)))
    one = group_rows([0, -1, 0], cpu)  # one adapter's rows apart: gathered
    assert one.gather.tolist() == [0, 2] and one.batched is None
    mixed = group_rows([2, -1, 1, 2], cpu)  # two adapters apart: groups by slot, padded to 2 rows each
    b = mixed.batched
    assert b.slots == (1, 2) and b.slot_index.tolist() == [1, 2] and b.rows.tolist() == [2, 2, 0, 3]
    assert b.padding.flatten().tolist() == [False, True, False, False]
    even = group_rows([0, 1, 0, 1], cpu).batched  # slots 0..G-1 and equal groups: no selection, no padding
    assert even.slot_index is None and even.padding is None and even.rows.tolist() == [0, 2, 1, 3]


def test_speculative_verify_rows_carry_the_adapter(qwen3_dir, adapters, make_engine):
    """n-gram drafts are verified by the adapter's model: greedy output unchanged (a verify item's K + 1 rows all
    take the request's adapter)."""
    engine = _lora_engine(make_engine, qwen3_dir, adapters, speculative="ngram", num_speculative_tokens=4)
    got = [engine.generate([p], _params(name))[0] for name in ("a", "b") for p in PROMPTS[:2]]
    assert [r.token_ids for r in got] == [adapters[n][i] for n in ("a", "b") for i in range(2)]
    assert engine.stats().spec_verify_steps_total > 0


def test_quantized_base_takes_adapters_too(qwen3_dir, adapters, make_engine):
    """int8 base weights plus the adapters' deltas (compute dtype): the plan says so, greedy output follows PEFT's
    (the int8 base itself is not batch-invariant in its last bits, so no mixed-batch equality is asked here)."""
    engine = _lora_engine(make_engine, qwen3_dir, adapters, quantization="int8", enable_prefix_caching=False)
    assert "LoRA delta" in next(c.reason for c in engine.load_plan if c.lever == "linear.qkv_proj")
    got = [engine.generate([p], _params("a"))[0].token_ids for p in PROMPTS]
    base = [engine.generate([p], _params(None))[0].token_ids for p in PROMPTS]
    assert [g[0] for g in got] == [w[0] for w in adapters["a"]]
    assert got != base


def test_kv_events_name_the_adapter_of_each_stored_block(qwen3_dir, adapters, make_engine):
    """vLLM's BlockStored carries lora_id / lora_name: nil for the base's blocks, the adapter's for its own (whose
    hashes differ from the base's for the same tokens). Read back through the publisher's replay socket."""
    zmq = pytest.importorskip("zmq")
    import msgpack

    from inference_svc.kv_events import KVEventPublisher, KVEventRecorder, KVEventsConfig
    from tests.conftest import free_port

    engine = _lora_engine(make_engine, qwen3_dir, adapters, block_size=16)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kv")  # fmt: skip
    publisher = KVEventPublisher(config)
    publisher.start()
    engine.block_manager.events = KVEventRecorder(publisher, 16, engine.lora.name_of_salt)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 30_000)
    try:
        prompt = list(range(7, 7 + 40))
        engine.generate([prompt], _params(None))
        engine.generate([prompt], _params("b"))
        assert publisher.flush(30)
        dealer.connect(config.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        stored = []
        while True:
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            stored += [e for e in msgpack.unpackb(payload)[1] if e["type"] == "BlockStored"]
    finally:
        engine.block_manager.events = None
        dealer.close()
        ctx.term()
        publisher.close()
    base = [e for e in stored if e["lora_id"] is None]
    lora = [e for e in stored if e["lora_id"] is not None]
    salt = engine.lora.lookup("b").cache_salt
    assert base and lora and all(e["lora_name"] is None for e in base)
    assert all(e["lora_id"] == salt and e["lora_name"] == "b" for e in lora)
    assert base[0]["token_ids"][:32] == lora[0]["token_ids"][:32] == prompt[:32]
    assert not {h for e in base for h in e["block_hashes"]} & {h for e in lora for h in e["block_hashes"]}


def test_an_adapter_exported_by_tandem_train_loads(tmp_path):
    """The training half's PEFT export (`lt_plugins.export.adapter`: CausalLM module names, `target_modules` the
    exact names wrapped) is what serving reads: every tensor lands under its (layer, projection), scaled by
    alpha / r."""
    from lt_plugins.export.adapter import adapter_state, peft_config, write_adapter
    from lt_plugins.lora import LoraConfig
    from tests.conftest import tiny_config

    config = tiny_config()
    shapes = {"self_attn.q_proj": (config.q_size, config.hidden_size), "mlp.down_proj": (config.hidden_size,
              config.intermediate_size)}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    state = {}
    for layer in range(config.num_layers):
        for mod, (out, inp) in shapes.items():
            state[f"model.layers.{layer}.{mod}.lora_A.weight"] = torch.randn(4, inp, generator=g)
            state[f"model.layers.{layer}.{mod}.lora_B.weight"] = torch.randn(out, 4, generator=g)
    meta = {"config": LoraConfig(enabled=True, rank=4, alpha=12.0).to_dict(), "base": "tiny"}
    names = [k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight")]
    folder = write_adapter(tmp_path / "exported", peft_config(meta, names, []), adapter_state(state, []), False)
    adapter = load_adapter("mine", folder, config, max_rank=4)
    assert adapter.rank == 4 and adapter.scaling == 3.0 and adapter.base_model == "tiny"
    assert set(adapter.weights) == {(n, p) for n in range(config.num_layers) for p in ("q_proj", "down_proj")}
    a, b = adapter.weights[(1, "down_proj")]
    assert torch.equal(a, state["model.layers.1.mlp.down_proj.lora_A.weight"])
    assert torch.equal(b, state["model.layers.1.mlp.down_proj.lora_B.weight"])
