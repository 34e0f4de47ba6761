"""`EngineConfig.kv_cache_dtype` end to end on the torch (CPU) path: attention over fp8/int8/fp16/bf16 caches
against an fp32 cache, the engine's greedy tokens against the fp32 reference model (under chunked prefill, prefix
caching and preemption), the pool's capacity and its bytes as the engine, the ledger and the cache count them,
and a bad value refused naming the field.

Tolerances:
- attention outputs (q, k, v ~ N(0, 1), D = 16): the output is a softmax-weighted mean of V rows, so V's error
  moves it by at most u · max|V|, u the format's unit (int8: s/2 ≤ max|V| / 127 with a power-of-two scale; fp8
  2^-4, fp16 2^-11, bf16 2^-8 relative), and K's error tilts the weights by a term of the same order; the bound is
  2 u · max|V|. Measured over 5 seeds, as a fraction of that bound: int8 0.46, fp8 0.14, fp16 0.07, bf16 0.15.
- engine tokens: teacher-forced through the fp32 reference, each generated token's logit must be within
  NEAR_TIE of the reference's best at its position, and most tokens must be the reference's argmax exactly.
"""

from __future__ import annotations

import random

import pytest
import torch

from inference_svc.attention.torch_ops import torch_ops
from inference_svc.cli import _serve_parser
from inference_svc.engine import EngineConfig, SamplingParams
from inference_svc.engine.config import EngineConfigError
from inference_svc.engine.kv_cache import KVCache, ledger_dtype_name, resolve_kv_dtype
from shared_model import ledger
from shared_model.bundle import load_bundle

UNIT = {"int8": 1 / 127, "fp8": 2.0**-4, "fp16": 2.0**-11, "bf16": 2.0**-8}
NEW_TOKENS = 16
NEAR_TIE = {"auto": 1e-3, "fp32": 1e-3, "fp16": 0.05, "bf16": 0.3, "fp8": 0.6, "int8": 0.3}  # logit units
EXACT = {"fp8": 0.7}  # least fraction of tokens that are the reference's argmax; 0.85 for the others (fp8: 89/112)


def _caches(name: str, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, num_blocks: int, bs: int):
    cache = KVCache.allocate(1, num_blocks, bs, k.shape[1], k.shape[2], resolve_kv_dtype(name, torch.float32), "cpu")
    kc, vc = cache.layer(0)
    ks, vs = cache.layer_scales(0)
    torch_ops().store_kv(k, v, kc, vc, slots, k_scales=ks, v_scales=vs)
    return kc, vc, {"k_scales": ks, "v_scales": vs}


@pytest.mark.parametrize("name", ["int8", "fp8", "fp16", "bf16"])
def test_attention_over_a_stored_cache_is_close_to_the_fp32_cache(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    bs, hq, hkv, d = 4, 4, 2, 16
    lens = [13, 6]  # two sequences over scattered blocks
    tables = torch.tensor([[5, 2, 7, 1], [3, 6, 0, 0]], dtype=torch.int32)
    slots = torch.tensor([int(tables[s, p // bs]) * bs + p % bs for s, n in enumerate(lens) for p in range(n)])
    k, v = torch.randn(len(slots), hkv, d, generator=g), torch.randn(len(slots), hkv, d, generator=g)
    ref_k, ref_v, none = _caches("fp32", k, v, slots, 8, bs)
    kc, vc, scales = _caches(name, k, v, slots, 8, bs)
    ops, ref_ops = torch_ops(), torch_ops()
    q = torch.randn(2, hq, d, generator=g)
    ctx = torch.tensor(lens, dtype=torch.int32)
    out = ops.decode_attention(q, kc, vc, ctx, tables, d**-0.5, **scales)
    ref = ref_ops.decode_attention(q, ref_k, ref_v, ctx, tables, d**-0.5, **none)
    assert out.dtype == torch.float32
    bound = 2 * UNIT[name] * v.abs().max().item()
    err = (out - ref).abs().max().item()
    assert 0 < err <= bound, f"decode {name}: {err:.3g} > {bound:.3g}"
    qp = torch.randn(sum(lens), hq, d, generator=g)  # prefill of both whole sequences
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    out = ops.prefill_attention(qp, kc, vc, cu, ctx, tables, d**-0.5, **scales)
    ref = ref_ops.prefill_attention(qp, ref_k, ref_v, cu, ctx, tables, d**-0.5, **none)
    err = (out - ref).abs().max().item()
    assert 0 < err <= bound, f"prefill {name}: {err:.3g} > {bound:.3g}"


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 33, 90)]
    return prompts + [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (3, 20)]


@pytest.mark.parametrize("name", ["auto", "fp32", "fp16", "bf16", "fp8", "int8"])
def test_engine_greedy_tokens_follow_the_reference_under_pressure(llama_dir, make_engine, name: str) -> None:
    """Chunked prefill (chunks of 24), prefix caching (two prompts share 40 tokens) and preemption (14 blocks)."""
    reference = load_bundle(llama_dir, dtype=torch.float32).model.eval()
    stored = resolve_kv_dtype(name, torch.float32)
    block = ledger.kv_bytes_per_block(reference.config, ledger_dtype_name(stored))
    engine = make_engine(
        llama_dir,
        kv_cache_dtype=name,
        kv_cache_memory=14 * block,  # 14 blocks of 16 tokens in every dtype: preemption under ~400 tokens of demand
        max_num_batched_tokens=64,
        prefill_chunk_size=24,
        max_num_seqs=8,
    )
    assert engine.info().kv_blocks_total == 14 and engine.runner.cache.dtype == stored
    prompts = _prompts(3, engine.model_config.vocab_size)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    exact = total = 0
    for i, (prompt, r) in enumerate(zip(prompts, results, strict=True)):
        assert len(r.token_ids) == NEW_TOKENS
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + r.token_ids[:-1]]))[0, len(prompt) - 1 :].float()
        chosen = logits.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        gaps = (logits.max(dim=1).values - chosen).tolist()
        assert max(gaps) < NEAR_TIE[name], f"prompt {i}: a token {max(gaps):.3f} below the reference's best"
        exact += sum(g == 0 for g in gaps)
        total += len(gaps)
    assert exact >= EXACT.get(name, 0.85) * total, f"{name}: {exact} of {total} tokens are the reference's argmax"
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    engine.block_manager.check_invariants()


def test_quantized_capacity_is_at_least_1_9x_bf16_and_every_count_agrees(model_dir, make_engine) -> None:
    engines = {n: make_engine(model_dir, kv_cache_dtype=n, kv_cache_memory="1MiB") for n in ("bf16", "fp8", "int8")}
    bf16 = engines["bf16"].info()
    for name, engine in engines.items():
        info = engine.info()
        config, bs = info.model_config, info.config.block_size
        assert info.kv_cache_dtype == name
        assert info.kv_bytes_per_block == ledger.kv_bytes_per_block(config, name, bs)
        assert info.kv_bytes_per_token == ledger.kv_bytes_per_token(config, name, bs)
        assert info.kv_cache_bytes == engine.runner.cache.nbytes == info.kv_blocks_total * info.kv_bytes_per_block
        assert info.kv_blocks_total == 2**20 // info.kv_bytes_per_block
        if name != "bf16":
            assert info.kv_blocks_total >= 1.9 * bf16.kv_blocks_total, (name, info.kv_blocks_total)
            scales = engine.runner.cache.scales
            assert scales is not None and scales.numel() * 4 == info.kv_blocks_total * (
                ledger.kv_scale_bytes_per_block(config, name)
            )


def test_zero_blocks_clears_a_quantized_cache_and_its_scales(llama_dir, make_engine) -> None:
    engine = make_engine(llama_dir, kv_cache_dtype="int8")
    engine.generate([[5, 6, 7] * 10], SamplingParams(max_new_tokens=4))
    cache = engine.runner.cache
    used = [b for b in range(engine.block_manager.num_blocks) if bool((cache.scales[:, :, b] > 0).any())]
    assert used
    engine.runner.zero_blocks(used)
    assert bool((cache.scales == 0).all()) and bool((cache.data == 0).all())


def test_a_bad_kv_cache_dtype_is_refused_naming_the_field_and_the_values(capsys) -> None:
    with pytest.raises(EngineConfigError, match=r"kv_cache_dtype: must be one of auto, fp32, bf16, fp16, fp8, int8"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(SystemExit) as exit_info:
        _serve_parser().parse_args(["--model", "m", "--kv-cache-dtype", "fp4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "'fp4'" in err and "int8" in err and "fp8" in err
    args = _serve_parser().parse_args(["--model", "m", "--kv-cache-dtype", "int8"])
    assert args.kv_cache_dtype == "int8"
