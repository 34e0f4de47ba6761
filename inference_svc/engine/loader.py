"""Loading: the model folders onto a device, the draft model's checks, the KV pool's sizing, the compile warm-up.

Contract:
- `load_bundles(path, config)` loads the target (and the draft model `config` names) on the device `config.device`
  resolves to (`resolve_device`: 'auto' is CUDA when available; 'cuda' without CUDA is a `ModelLoadError`); any
  load failure is a `ModelLoadError` naming the folder. `config.threads`, when set, sizes torch's process-wide
  intra-op thread pool.
- `check_draft` refuses a draft model that does not share the target's vocabulary and token strings.
- `size_kv_pool`: bytes per KV token and block come from `shared_model.ledger` (2 · layers · kv_width · bytes per
  element, plus the fp8/int8 scales per block) for the stored K/V dtype; the pool holds the budget
  (`config.kv_cache_bytes`, else a fraction of free GPU memory, else `DEFAULT_CPU_KV_BYTES`) // bytes per block
  blocks, a draft model's block bytes added (its K/V shares the budget); a budget that holds no block is a
  `ModelLoadError`. The context is the smallest of `max_model_len`, the model's positions and the pool.
- `warm_up` compiles a runner's graphs on throwaway sequences over free blocks and zeroes those blocks; a failed
  compile is a `ModelLoadError` under `compile='on'`, `CompileFailed` under 'auto' (the engine records it and runs
  eagerly). Nothing here is timed to decide anything.
- Pure functions of their arguments: no engine state lives here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from inference_svc.engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from inference_svc.engine.detokenizer import IncrementalDetokenizer
from inference_svc.engine.draft_model import DraftModelProposer
from inference_svc.engine.kv_cache import ledger_dtype_name
from inference_svc.engine.model_runner import QUERY_CHUNK_MAX, ModelRunner
from inference_svc.engine.sampler import Sampler
from inference_svc.engine.sequence import ScheduledSeq, Sequence
from inference_svc.engine.speculative import NgramProposer, Proposer, SpeculationPolicy, Speculator
from inference_svc.engine.types import SamplingParams
from inference_svc.errors import ModelLoadError
from shared_model import ledger
from shared_model.bundle import Bundle, load_bundle, parse_dtype
from shared_model.config import ModelConfig
from shared_model.quantize import QuantizedLinear
from shared_model.serving_model import ROW_KERNEL_MAX_ROWS, ServingLinear
from shared_model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, block_size: int = ledger.KV_BLOCK_SIZE) -> int:
    """Bytes of K and V one token occupies across all layers, stored as `dtype` (`ledger.kv_bytes_per_token`)."""
    return ledger.kv_bytes_per_token(config, ledger_dtype_name(dtype), block_size)


@dataclass(frozen=True)
class KvPool:
    """The KV pool's sizing, fixed at load."""

    bytes_per_token: int
    bytes_per_block: int
    draft_bytes_per_token: int
    """0 without a draft model; with one, its K/V is stored in the same dtype, in blocks beside the target's."""
    draft_bytes_per_block: int
    num_blocks: int
    max_model_len: int


def size_kv_pool(
    config: EngineConfig,
    model_config: ModelConfig,
    kv_dtype: torch.dtype,
    draft_config: ModelConfig | None,
    device: torch.device,
    weight_bytes: int,
) -> KvPool:
    """Size the KV pool for `model_config` (and `draft_config`'s K/V beside it) within the budget left beside
    `weight_bytes` of weights; `ModelLoadError` when the budget holds no block."""
    bs = config.block_size
    kv_name = ledger_dtype_name(kv_dtype)
    bytes_per_token = kv_bytes_per_token(model_config, kv_dtype, bs)
    bytes_per_block = ledger.kv_bytes_per_block(model_config, kv_name, bs)
    draft_bytes_per_token = 0 if draft_config is None else kv_bytes_per_token(draft_config, kv_dtype, bs)
    draft_bytes_per_block = 0 if draft_config is None else ledger.kv_bytes_per_block(draft_config, kv_name, bs)
    budget = kv_budget(config, device, weight_bytes)
    per_token = bytes_per_token + draft_bytes_per_token
    num_blocks = budget // (bytes_per_block + draft_bytes_per_block)
    if num_blocks < 1:
        raise ModelLoadError(
            f"kv_cache_memory: {budget} bytes hold no block of {bs} tokens ({per_token} bytes/token"
            + (f", {draft_bytes_per_token} of them the draft model's)" if draft_config is not None else ")")
        )
    max_model_len = min(
        config.max_model_len or model_config.max_position_embeddings,
        model_config.max_position_embeddings,
        num_blocks * bs,
    )
    return KvPool(bytes_per_token, bytes_per_block, draft_bytes_per_token, draft_bytes_per_block, num_blocks,
                  max_model_len)  # fmt: skip


def load_bundles(path: str | Path, config: EngineConfig) -> tuple[Bundle, torch.device, Bundle | None]:
    """The model at `path` and the draft model `config` names, loaded onto the configured device (`ModelLoadError`
    naming which failed); sets torch's intra-op thread pool when `config.threads` is set."""
    device = resolve_device(config.device)
    dtype: str | torch.dtype = "auto" if config.dtype == "auto" else parse_dtype(config.dtype)
    try:
        bundle = load_bundle(path, dtype=dtype, device=device, verify_checksums=config.verify_checksums)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model from {path}: {exc}") from exc
    draft = None
    if config.draft_model_path is not None:
        try:
            draft = load_bundle(config.draft_model_path, dtype=bundle.dtype, device=device,
                                verify_checksums=config.verify_checksums)  # fmt: skip
        except Exception as exc:
            where = f"speculative: cannot load the draft model from {config.speculative}"
            raise ModelLoadError(f"{where}: {exc}") from exc
    return bundle, device, draft


def build_speculator(
    config: EngineConfig, draft_runner: ModelRunner | None, sampler: Sampler, eos_ids: frozenset[int]
) -> Speculator:
    """Always built: a request may ask for speculation on an engine that does not speculate by default (it
    then drafts by prompt lookup, or with the draft model when the engine has one)."""
    c = config
    proposer: Proposer
    if draft_runner is not None:
        proposer = DraftModelProposer(draft_runner, sampler, eos_ids, c.prefill_chunk_size)
    else:
        proposer = NgramProposer(c.speculative_ngram_min, c.speculative_ngram_max)
    return Speculator(
        proposer,
        SpeculationPolicy(c.speculative_verify_cost),
        default_k=c.num_speculative_tokens if c.speculative != "off" else 0,
        max_batch=c.speculative_max_batch or None,
    )


def warm_up(
    runner: ModelRunner, config: EngineConfig, num_blocks: int, tokenizer: Tokenizer, packages: Path | None = None
) -> float:
    """Compile `runner`'s graphs on throwaway sequences over free blocks, then zero those blocks; seconds.

    The compile runs a prefill chunk longer than the last row count a projection branches at in Python (its
    `row_bounds()`: a quantized layer's kernels; a dense projection whose row table `tandem::table_gemm` runs
    branches nowhere, its kernel chosen inside that operator, so one graph serves every T >= 2) where the pool
    allows, a lone decode, a decode of two sequences and chunks on each side of each such bound and of 5 rows
    (T == 1 and every T >= 2 branch a model takes), and decode-only steps of as
    many rows as each bound, one more and the last bound's next, above `QUERY_CHUNK_MAX` (verify items of several
    sequences: a decode-only step attends through graphs of its own, `shared_model.compiled`), and one more than
    the decode runner takes where it runs (`ModelRunner.native_decode`: its steps need no graph); a 5-row chunk (a
    verify step's shape) must then be covered (were it not, `CompiledDecoder` logs it and runs it eagerly). A
    compile that fails is a `ModelLoadError` under 'on'; under 'auto' it raises `CompileFailed`, and the engine
    records that and runs every step eagerly. `packages`: the compile cache's folder for this runner's saved graphs
    (`CompiledDecoder.warm_up`; None: nothing saved or loaded), in a subfolder named by what else shapes the graphs'
    inputs and not the cache's key (the decode steps' attention in the graph or in Python, the KV cache's dtype and
    shape): so servers of one model with another `--kv-cache-memory` or `--kv-cache-dtype` each find their own. No
    timing decides anything here (`inference_svc.executor.prepare`)."""
    assert runner.compiled is not None
    bs = config.block_size
    bounds = sorted({b for m in runner.model.modules() if isinstance(m, (QuantizedLinear, ServingLinear))
                     for b in m.row_bounds() if b >= 2})  # fmt: skip
    longest = max([ROW_KERNEL_MAX_ROWS, *bounds])
    n = min(max(2 * bs, longest + 1), (num_blocks // 2) * bs - 1)  # 2 x (n + 1) fit
    if n < 6:
        raise CompileFailed(f"the KV pool is too small to warm up on ({num_blocks} blocks)")
    per_seq = -(-(n + 1) // bs)
    seqs = [
        Sequence(f"compile-warm-up-{i}", -1, [0] * n, n, SamplingParams(), 0.0,
                 IncrementalDetokenizer(tokenizer, ()), frozenset(),
                 block_table=list(range(i * per_seq, (i + 1) * per_seq)))
        for i in range(2)
    ]  # fmt: skip
    for s in seqs:
        s.token_ids.append(0)

    def run() -> None:
        runner.run([ScheduledSeq(seqs[0], 0, n)])  # prefill
        runner.run([ScheduledSeq(seqs[0], n, 1)])  # lone decode
        runner.run([ScheduledSeq(s, n, 1) for s in seqs])  # batched decode
        for rows in sorted({5, *bounds, *(b + 1 for b in bounds)}):  # each side of each branch, a verify's 5
            if 2 < rows <= n:
                runner.run([ScheduledSeq(seqs[1], n + 1 - rows, rows)])
        # one row past the decode runner's steps: where it takes every step above, that step traces the graph
        native = [] if runner.native_decode is None else [runner.native_decode.max_rows + 1]
        for rows in sorted({*bounds, *(b + 1 for b in bounds), longest + 1, *native}):  # decode-only steps of that many
            if QUERY_CHUNK_MAX < rows <= 2 * n:  # rows (verify items of several sequences): a graph of their own
                half = -(-rows // 2)  # rows over both sequences: steps longer than one sequence in a small pool
                runner.run([ScheduledSeq(seqs[j % 2], n + 1 - half + j // 2, 1) for j in range(rows)])

    if packages is not None:  # the graphs' inputs differ with the KV pool and the decode steps' attention
        kv = runner.cache.data  # [L, 2, num_blocks, block_size, Hkv, D]
        attends = "graph" if runner.graph_decode else "python"
        packages = packages / f"{attends}-{str(kv.dtype).removeprefix('torch.')}-{'x'.join(map(str, kv.shape))}"
    peak = runner.peak_workspace_bytes  # the warm-up's steps are not the service's
    try:
        seconds = runner.compiled.warm_up(run, packages)
        runner.run([ScheduledSeq(seqs[0], n - 4, 5)])  # a verify-shaped chunk: covered, or logged and counted
    except Exception as exc:
        if config.compile == "on":
            raise ModelLoadError(f"compile: compiling the decode step failed: {exc}") from exc
        log.warning("compile auto: compiling the decode step failed (%s); running eagerly", exc)
        raise CompileFailed(str(exc)) from exc
    finally:
        runner.peak_workspace_bytes = peak
        runner.zero_blocks(sorted(b for s in seqs for b in s.block_table))
    return seconds


def check_draft(target: Bundle, draft: Bundle) -> None:
    """A draft model must speak the target's vocabulary: the same ids for the same tokens."""
    where = f"speculative: the draft model {draft.path}"
    if draft.config.vocab_size != target.config.vocab_size:
        raise ModelLoadError(
            f"{where} has vocab_size {draft.config.vocab_size}, the target {target.config.vocab_size}: "
            "a draft model must share the target's tokenizer"
        )
    if draft.tokenizer is not None and target.tokenizer is not None:
        mine, theirs = draft.tokenizer.token_strings(), target.tokenizer.token_strings()
        if mine != theirs:
            pairs = enumerate(zip(mine, theirs, strict=False))
            first = next((i for i, (a, b) in pairs if a != b), min(len(mine), len(theirs)))
            raise ModelLoadError(
                f"{where} has a different tokenizer (first difference at token id {first}): a draft model must "
                "share the target's tokenizer"
            )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device: CUDA was requested but is not available")
    return device


def kv_budget(config: EngineConfig, device: torch.device, weight_bytes: int) -> int:
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * config.gpu_memory_fraction)
    return DEFAULT_CPU_KV_BYTES


class CompileFailed(Exception):
    """An 'auto' compile that failed at warm-up (the engine records it and runs eagerly)."""
