"""The engine: requests in, token/text increments out. One step = schedule → run the model → postprocess.

Contract:
- Single-threaded: every method must be called from one thread (the gRPC layer runs the engine in its own thread).
- `add_request` validates everything that depends on the engine (vocabulary, context length, KV pool, the
  max_new_tokens ceiling, duplicate ids) and raises `InvalidRequestError` naming the field; an accepted request is
  never refused later and never lost (it may be preempted and recomputed). `check_request` runs the same checks
  of token ids and sampling parameters from any thread (they read only what is fixed at load), so a caller can
  refuse a whole multi-prompt request before any of it reaches the engine, then add its parts with
  `checked=True` (no second scan).
- `abort_request` takes effect at the next `step()`, which returns a final `RequestOutput(finished=True,
  finish_reason=CANCELLED)` for it; its blocks are freed then. Each abort costs O(1) when made (a dict of
  pending aborts), and a step applies all of its pending aborts in one pass over the scheduler's queues.
- `step()` returns one `RequestOutput` per request that produced a token, finished or was cancelled this step.
  A request whose logits are not finite finishes alone with `finish_reason=ERROR` and `error` set (one log line);
  `generate()` raises `RequestFailedError` for it.
- Times come from `time.monotonic()`; `Timing` is in milliseconds from the request's arrival.
- Bytes per KV token and block come from `shared_model.ledger` (2 · layers · kv_width · bytes per element, plus
  the fp8/int8 scales per block) for the stored K/V dtype (`config.kv_cache_dtype`, `engine.kv_cache`); the pool
  holds kv_cache_memory // bytes per block blocks (a draft model's block bytes added: its K/V shares the budget).
- Speculative decoding (`config.speculative`, or per request `SamplingParams.num_speculative_tokens`): the
  scheduler's `Speculator` drafts by prompt lookup or with the draft model; a verify item's K + 1 rows go to
  `rejection.verify`, the others to the sampler, and usage reports drafts, kept drafts and steps.
- Structured outputs (`SamplingParams.structured`): `grammar_compiler` (built on first use, any thread) compiles
  them; a constrained request owns a matcher from `add_request` until it finishes (`engine.grammar`). A step
  computes the bitmasks of its constrained rows in a helper thread while the model's forward runs (they read only
  the matchers, which change after sampling), the sampler and the verifier apply them, and the emitted tokens
  advance the matchers.
- Load-time transforms, in order, each choice recorded in `load_plan` (`inference_svc.executor.prepare`): the CPU
  kernels, merged projections, the quantization (a model that cannot take it is refused, `ModelLoadError` naming
  the weight), each projection's linear method, the attention backend, the sampler, the compiled step.
  First of all, `config.threads` and `config.omp_wait` size torch's intra-op thread pool and record the OpenMP wait
  policy in effect (`inference_svc.executor.threads`).
- Compiled step (`config.compile`, decided by a rule in `executor.choose_compile`): the runners trace the decoder
  with `shared_model.compiled`, and the constructor warms them up before it returns (a prefill chunk, a lone decode
  and a batched decode of throwaway sequences over free blocks, which are zeroed afterwards), so the first request
  never waits on a compile; `info()` reports whether steps run compiled, how long the compile took, and the plan.
  The compile first loads a saved entry of `inference_svc.executor.compile_cache` (the bundle's own, then
  `config.compile_cache`) and saves one after a miss; the plan's `compile_cache` choice says which.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from inference_svc.engine.block_manager import BlockManager
from inference_svc.engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from inference_svc.engine.detokenizer import IncrementalDetokenizer
from inference_svc.engine.draft_model import DraftModelProposer
from inference_svc.engine.grammar import ConstrainedDecoding, GrammarCompiler, MaskItem
from inference_svc.engine.kv_cache import ledger_dtype_name, resolve_kv_dtype
from inference_svc.engine.model_runner import ModelRunner, ScheduledSeq
from inference_svc.engine.pooling import Pooling
from inference_svc.engine.rejection import verify
from inference_svc.engine.sampler import Emitted, Sampler, SampleRequest
from inference_svc.engine.scheduler import Scheduler, StepEvent
from inference_svc.engine.sequence import Sequence
from inference_svc.engine.speculative import NgramProposer, Proposer, SpeculationPolicy, Speculator
from inference_svc.engine.types import (
    Completion,
    EngineInfo,
    FinishReason,
    RequestOutput,
    SamplingParams,
    Timing,
    TokenLogprob,
    Usage,
)
from inference_svc.errors import InvalidRequestError, ModelLoadError, RequestFailedError
from inference_svc.executor import compile_cache
from inference_svc.executor import prepare as executor  # a module: it imports the engine's config in turn
from inference_svc.executor.plan import LoadPlan
from inference_svc.executor.threads import settle as settle_threads
from shared_model import ledger
from shared_model.bundle import Bundle, load_bundle, parse_dtype
from shared_model.config import ModelConfig
from shared_model.quantize import serving_weight_bytes
from shared_model.serving_model import ROW_KERNEL_MAX_ROWS
from shared_model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and counters (for metrics)."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    """Blocks holding a registered prefix (in use or evictable)."""
    prefix_cache_hit_tokens: int
    """Prompt tokens found in the prefix cache, over all lookups (a counter)."""
    prefix_cache_queried_tokens: int
    """Prompt tokens looked up in the prefix cache, over all lookups (a counter)."""
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    cached_prompt_tokens_total: int
    spec_verify_steps_total: int = 0
    """Sequence-steps that verified drafts (speculative decoding)."""
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_emitted_tokens_total: int = 0
    """Tokens the verify steps produced: kept drafts plus the token each added."""

    @property
    def spec_acceptance_rate(self) -> float:
        """Kept drafts / drafts, over all verify steps."""
        return self.spec_accepted_tokens_total / self.spec_draft_tokens_total if self.spec_draft_tokens_total else 0.0

    @property
    def spec_tokens_per_step(self) -> float:
        """Tokens per verify step (1 would mean speculation never kept a draft)."""
        return self.spec_emitted_tokens_total / self.spec_verify_steps_total if self.spec_verify_steps_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up, over all admissions."""
        return (
            self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens if self.prefix_cache_queried_tokens else 0.0
        )


@dataclass(frozen=True)
class GenerationResult:
    """The whole of one request, as returned by `Engine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    timing: Timing
    logprobs: list[float] | None = None
    top_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: str | int | None = None


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, block_size: int = ledger.KV_BLOCK_SIZE) -> int:
    """Bytes of K and V one token occupies across all layers, stored as `dtype` (`ledger.kv_bytes_per_token`)."""
    return ledger.kv_bytes_per_token(config, ledger_dtype_name(dtype), block_size)


class Engine:
    """Paged-KV continuous-batching inference over one model."""

    def __init__(self, bundle: Bundle, config: EngineConfig, device: torch.device, draft: Bundle | None = None) -> None:
        if bundle.tokenizer is None:
            raise ModelLoadError(f"{bundle.path}: the model folder has no tokenizer.json")
        self.config = config
        self.thread_ident = threading.get_ident()
        """The thread that built this engine (and compiled and probed its step): a server steps it on the same one,
        so that torch's OpenMP pool is one (`inference_svc.engine_thread`)."""
        self.model_config: ModelConfig = bundle.config
        self.tokenizer: Tokenizer = bundle.tokenizer
        self.device = device
        self.dtype = bundle.dtype
        self.model_path = bundle.path
        # the load-time transforms, in order, each choice recorded (inference_svc.executor.prepare)
        thread_choices = settle_threads(config.threads, config.omp_wait)
        native, cpu_choice = executor.choose_cpu_kernels(config, device)
        prepared = executor.prepare(bundle, config, native)
        model = prepared.model
        draft_model = None
        if draft is not None:
            _check_draft(bundle, draft)
            draft_model = executor.prepare(draft, config, native).model
        self.attention_backend, backend, attention_choice = executor.choose_attention(config, device, native)
        compile_step, compile_choice = executor.choose_compile(config, device, model)
        self.draft_path = None if draft is None else draft.path
        self.weight_bytes = serving_weight_bytes(model)
        self.draft_weight_bytes = 0 if draft_model is None else serving_weight_bytes(draft_model)
        bs = config.block_size
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        kv_name = ledger_dtype_name(self.kv_dtype)
        self.bytes_per_token = kv_bytes_per_token(self.model_config, self.kv_dtype, bs)
        self.bytes_per_block = ledger.kv_bytes_per_block(self.model_config, kv_name, bs)
        # a draft model stores its K/V in the same dtype, in blocks of its own beside the target's
        self.draft_bytes_per_token = 0 if draft is None else kv_bytes_per_token(draft.config, self.kv_dtype, bs)
        self.draft_bytes_per_block = 0 if draft is None else ledger.kv_bytes_per_block(draft.config, kv_name, bs)
        budget = _kv_budget(config, device, self.weight_bytes + self.draft_weight_bytes)
        per_token = self.bytes_per_token + self.draft_bytes_per_token
        num_blocks = budget // (self.bytes_per_block + self.draft_bytes_per_block)
        if num_blocks < 1:
            raise ModelLoadError(
                f"kv_cache_memory: {budget} bytes hold no block of {bs} tokens ({per_token} bytes/token"
                + (f", {self.draft_bytes_per_token} of them the draft model's)" if draft else ")")
            )
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            num_blocks * bs,
        )
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.runner = ModelRunner(
            model, self.model_config, num_blocks, bs, self.dtype, device, backend, kv_dtype=self.kv_dtype,
            compiled=compile_step, native=native,
        )  # fmt: skip
        self.draft_runner = None
        if draft is not None and draft_model is not None:
            self.draft_runner = ModelRunner(draft_model, draft.config, num_blocks, bs, draft.dtype, device, backend,
                                            prompt_logprobs=False, kv_dtype=self.kv_dtype,
                                            compiled=compile_step, native=native)  # fmt: skip
        self.sampler = Sampler(native=native)
        self._eos_ids = frozenset(self.model_config.eos_token_ids) | (
            {self.tokenizer.eos_id} if self.tokenizer.eos_id is not None else set()
        )
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, self._speculator())
        self._requests: dict[str, Sequence] = {}
        self._pending_aborts: dict[str, None] = {}
        """Request ids to cancel at the next step, in the order asked (a dict: O(1) membership and insertion)."""
        self._next_index = 0
        self._prompt_tokens_total = 0
        self._grammar_lock = threading.Lock()
        self._grammar_compiler: GrammarCompiler | None = None
        self._constrained: ConstrainedDecoding | None = None
        """Matchers of the constrained requests (built with the compiler, on first use)."""
        self._mask_pool: concurrent.futures.ThreadPoolExecutor | None = None
        """One thread that computes a step's grammar bitmasks beside the forward."""
        self.compile_seconds = 0.0
        """Seconds the start-up compile took, target and draft together (0 when nothing was compiled)."""
        cache_choice = compile_cache.unused()
        if compile_step:
            key = compile_cache.cache_key(bundle.path, config, native, self.dtype)
            cache = compile_cache.open_cache(config.compile_cache, bundle.path, key)
            try:
                with cache.compiling():
                    self.compile_seconds = sum(self._warm_up(r) for r in (self.runner, self.draft_runner) if r)
                log.info("compiled the decode step in %.1f s", self.compile_seconds)
            except _CompileFailed as failed:
                compile_choice = executor.compile_failed(failed.__cause__ or failed)
                for r in (self.runner, self.draft_runner):
                    if r is not None:
                        r.drop_compiled()
            cache_choice = cache.finish(self.compiled)
        self.load_plan = LoadPlan((
            *thread_choices, cpu_choice, *prepared.choices, *executor.linear_choices(model), attention_choice,
            executor.sampler_choice(native, device), compile_choice, cache_choice,
        ))  # fmt: skip
        """Every lever's choice and reason, in the order made (`inference_svc.executor`); fixed from here on."""

    @property
    def compiled(self) -> bool:
        """Whether the target model's steps run compiled (the runner owns that state; 'auto' may have dropped it)."""
        return self.runner.compiled is not None

    def _warm_up(self, runner: ModelRunner) -> float:
        """Compile `runner`'s graphs on throwaway sequences over free blocks, then zero those blocks; seconds.

        The compile runs a prefill chunk longer than `ROW_KERNEL_MAX_ROWS` where the pool allows, a lone decode and a
        decode of two sequences (T >= 2, T == 1, and the small T a model branches on); a 5-row chunk (a verify step's
        shape) must then be covered already (were it not, `CompiledDecoder` logs it and runs it eagerly). A compile
        that fails is a `ModelLoadError` under 'on'; under 'auto' it raises `_CompileFailed`, and the engine records
        that and runs every step eagerly. No timing decides anything here (`inference_svc.executor.prepare`)."""
        assert runner.compiled is not None
        bs = self.config.block_size
        n = min(max(2 * bs, ROW_KERNEL_MAX_ROWS + 1), (self.block_manager.num_blocks // 2) * bs - 1)  # 2 x (n + 1) fit
        if n < 6:
            raise _CompileFailed(f"the KV pool is too small to warm up on ({self.block_manager.num_blocks} blocks)")
        per_seq = -(-(n + 1) // bs)
        seqs = [
            Sequence(f"compile-warm-up-{i}", -1, [0] * n, n, SamplingParams(), 0.0,
                     IncrementalDetokenizer(self.tokenizer, ()), frozenset(),
                     block_table=list(range(i * per_seq, (i + 1) * per_seq)))
            for i in range(2)
        ]  # fmt: skip
        for s in seqs:
            s.token_ids.append(0)

        def run() -> None:
            runner.run([ScheduledSeq(seqs[0], 0, n)])  # prefill
            runner.run([ScheduledSeq(seqs[0], n, 1)])  # lone decode
            runner.run([ScheduledSeq(s, n, 1) for s in seqs])  # batched decode

        peak = runner.peak_workspace_bytes  # the warm-up's steps are not the service's
        try:
            seconds = runner.compiled.warm_up(run)
            runner.run([ScheduledSeq(seqs[0], n - 4, 5)])  # a verify-shaped chunk: covered, or logged and counted
        except Exception as exc:
            if self.config.compile == "on":
                raise ModelLoadError(f"compile: compiling the decode step failed: {exc}") from exc
            log.warning("compile auto: compiling the decode step failed (%s); running eagerly", exc)
            raise _CompileFailed(str(exc)) from exc
        finally:
            runner.peak_workspace_bytes = peak
            runner.zero_blocks(sorted(b for s in seqs for b in s.block_table))
        return seconds

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """This engine's grammar compiler (built on first use, from any thread: compile off the engine thread)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                tk = self.tokenizer
                self._grammar_compiler = GrammarCompiler(
                    tk.token_strings(), self.model_config.vocab_size, self._eos_ids, tk.control_ids()
                )
            return self._grammar_compiler

    def _constrained_decoding(self) -> ConstrainedDecoding:
        if self._constrained is None:
            self._constrained = ConstrainedDecoding(self.grammar_compiler)
            self._mask_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._constrained

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_bundle(cls, path: str | Path, config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        device = _resolve_device(config.device)
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
        return cls(bundle, config, device, draft)

    def _speculator(self) -> Speculator:
        """Always built: a request may ask for speculation on an engine that does not speculate by default (it
        then drafts by prompt lookup, or with the draft model when the engine has one)."""
        c = self.config
        proposer: Proposer
        if self.draft_runner is not None:
            proposer = DraftModelProposer(self.draft_runner, self.sampler, self._eos_ids, c.prefill_chunk_size)
        else:
            proposer = NgramProposer(c.speculative_ngram_min, c.speculative_ngram_max)
        return Speculator(
            proposer,
            SpeculationPolicy(c.speculative_verify_cost),
            default_k=c.num_speculative_tokens if c.speculative != "off" else 0,
            max_batch=c.speculative_max_batch or None,
        )

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling: SamplingParams,
        arrival_time: float | None = None,
        checked: bool = False,
    ) -> None:
        """Queue one request. `checked`: `prompt` is a token-id list that passed `check_request` with `sampling`
        (it is not scanned again)."""
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"a request with id {request_id!r} is already in the engine")
        if checked and not isinstance(prompt, str):
            token_ids = list(prompt)
        else:
            token_ids = self._prompt_ids(prompt)
            self._check_sampling(sampling)
        seq = Sequence(
            request_id=request_id,
            seq_index=self._next_index,
            token_ids=token_ids,
            num_prompt_tokens=len(token_ids),
            sampling=sampling,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            detokenizer=IncrementalDetokenizer(self.tokenizer, sampling.stop),
            eos_ids=self._eos_ids,
            generator=None if sampling.seed is None else torch.Generator().manual_seed(sampling.seed),
        )
        if sampling.structured is not None:  # compiled here unless the caller did (refused before it is queued)
            self._constrained_decoding().add(request_id, sampling.structured)
        self._next_index += 1
        self._prompt_tokens_total += len(token_ids)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def check_request(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """`InvalidRequestError` naming the field when `add_request` would refuse these token ids or these
        sampling parameters (everything but the request id). Reads only what is fixed at load: any thread may
        call it."""
        self._prompt_ids(prompt_ids)
        self._check_sampling(sampling)

    def _check_sampling(self, sampling: SamplingParams) -> None:
        if sampling.max_new_tokens > self.config.max_new_tokens_limit:
            raise InvalidRequestError(
                "max_new_tokens",
                f"{sampling.max_new_tokens} is above this engine's limit of {self.config.max_new_tokens_limit}",
            )
        vocab = self.model_config.vocab_size
        bad_stop = [t for t in sampling.stop_token_ids if t >= vocab]
        if bad_stop:
            raise InvalidRequestError("stop_token_ids", f"ids {bad_stop} are outside the vocabulary")
        bad_bias = [t for t, _ in sampling.logit_bias if t >= vocab]
        if bad_bias:
            raise InvalidRequestError("logit_bias", f"token ids {bad_bias[:5]} are outside the vocabulary [0, {vocab})")
        check_min_tokens(sampling, vocab, self._eos_ids)

    def check_prompt_length(self, num_tokens: int) -> None:
        """InvalidRequestError when a prompt of `num_tokens` tokens cannot fit the context (prompt + at least one
        generated token). Reads only what is fixed at load, so any thread may call it (the async engine does,
        before a long prompt's ids become a list)."""
        if num_tokens >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {num_tokens} tokens; this engine's context holds {self.max_model_len} "
                f"(prompt + at least one generated token), limited by {self._context_limit()}",
            )

    def _context_limit(self) -> str:
        """What sets `max_model_len`, in the words of the setting a user would change."""
        if self.max_model_len == self.model_config.max_position_embeddings:
            return f"the model's max_position_embeddings ({self.model_config.max_position_embeddings}, config.json)"
        if self.max_model_len == self.config.max_model_len:
            return f"max_model_len ({self.config.max_model_len}, --max-model-len)"
        return f"the KV-cache pool ({self.block_manager.num_blocks} blocks of {self.config.block_size} tokens)"

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            check_text_prompt(prompt)
            ids = check_encoded(self.tokenizer.encode(prompt))
            self.check_prompt_length(len(ids))
            return ids
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt_token_ids", "the prompt has no tokens")
        self.check_prompt_length(len(ids))  # before the scan below, which is as long as the prompt
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError("prompt_token_ids", f"ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def embed(self, prompts: list[list[int]], pooling: Pooling) -> torch.Tensor:
        """[N, H] float32 pooled final-norm hidden states of these token-id prompts (`ModelRunner.embed`: prompt-only
        forwards, batched within `max_num_batched_tokens`). Every prompt is checked first (`InvalidRequestError`
        naming `prompt_token_ids`); no KV block or scheduler state is touched, so it may run between steps."""
        checked = [self._prompt_ids(p) for p in prompts]
        return self.runner.embed(checked, pooling, self.config.max_num_batched_tokens)

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request at the next step. False if it is unknown or already finished."""
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished or request_id in self._pending_aborts:
            return False
        self._pending_aborts[request_id] = None
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        events: list[StepEvent] = []
        if self._pending_aborts:
            events = self.scheduler.abort_all([self._requests[r] for r in self._pending_aborts], now)
            self._pending_aborts.clear()
        batch = self.scheduler.schedule(now)
        if batch:
            items = [b for b in batch if b.samples]
            masks = self._masks_beside_forward(items)
            logits = self.runner.run(batch)
            emitted = self._sample(items, logits.sample, None if masks is None else masks.result())
            events += self.scheduler.postprocess(batch, emitted, time.monotonic(), logits.prompt)
            scrub = [b for e in events for b in e.scrub_blocks]
            if scrub:
                self.runner.zero_blocks(scrub)
                if self.draft_runner is not None:
                    self.draft_runner.zero_blocks(scrub)
        outputs = [self._to_output(e) for e in events]
        for e in events:
            if e.finished:
                self._requests.pop(e.seq.request_id, None)
                if self._constrained is not None:
                    self._constrained.forget(e.seq.request_id)
        if self.block_manager.events is not None:  # KV-cache events: one batch per step (inference_svc.kv_events)
            self.block_manager.events.end_step()  # type: ignore[attr-defined]
        return outputs

    def _masks_beside_forward(
        self, items: list[ScheduledSeq]
    ) -> concurrent.futures.Future[list[torch.Tensor | None]] | None:
        """The grammar bitmasks of this step's sampling items, computed in the mask thread (None: none is
        constrained)."""
        c = self._constrained
        if c is None or not len(c) or not any(b.seq.request_id in c for b in items):
            return None
        assert self._mask_pool is not None
        asks = [MaskItem(b.seq.request_id, tuple(b.draft)) for b in items]
        return self._mask_pool.submit(c.masks, asks)

    def _sample(
        self, items: list[ScheduledSeq], rows: torch.Tensor, masks: list[torch.Tensor | None] | None = None
    ) -> list[Emitted]:
        """One `Emitted` per sampling item: plain rows sampled together, each verify item's K + 1 rows verified.
        rows: [R, V] fp32, `num_sample_rows` per item in order; masks: per item, its rows' grammar bitmask
        [rows, W] int32 or None."""
        out: list[Emitted | None] = [None] * len(items)
        plain: list[int] = []
        plain_rows: list[int] = []
        r = 0
        for j, b in enumerate(items):
            seq = b.seq
            if b.draft:
                history = [*seq.token_ids, *b.draft]
                requests = [
                    SampleRequest(seq.sampling, history[: seq.num_tokens + i], seq.generator, seq.num_prompt_tokens,
                                  self._eos_ids)
                    for i in range(b.num_sample_rows)
                ]  # fmt: skip
                mask = None if masks is None else masks[j]
                out[j] = verify(self.sampler, rows[r : r + b.num_sample_rows], requests, b.draft, b.draft_probs, mask)
            else:
                plain.append(j)
                plain_rows.append(r)
            r += b.num_sample_rows
        if plain:
            requests = [
                SampleRequest(items[j].seq.sampling, items[j].seq.token_ids, items[j].seq.generator,
                              items[j].seq.num_prompt_tokens, self._eos_ids)
                for j in plain
            ]  # fmt: skip
            bitmask = None
            if masks is not None and any(masks[j] is not None for j in plain):
                width = next(masks[j] for j in plain if masks[j] is not None).shape[1]  # type: ignore[union-attr]
                bitmask = torch.cat(
                    [m if (m := masks[j]) is not None else torch.full((1, width), -1, dtype=torch.int32) for j in plain]
                )  # [P, W]
            plain_logits = rows if len(plain_rows) == rows.shape[0] else rows[plain_rows]
            samples = self.sampler.sample(plain_logits, requests, bitmask)
            for k, j in enumerate(plain):
                out[j] = samples.emitted(k)
        if masks is not None and self._constrained is not None:
            for j, e in enumerate(out):
                if e is not None and not e.failed and masks[j] is not None:
                    self._constrained.advance(items[j].seq.request_id, e.tokens)
        for j, e in enumerate(out):
            if e is not None and e.failed:
                log.error("request %s: the model's logits are not finite; failing it alone", items[j].seq.request_id)
        return [e for e in out if e is not None]

    def _to_output(self, e: StepEvent) -> RequestOutput:
        seq = e.seq
        usage = Usage(
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            seq.num_cached_prompt_tokens,
            draft_tokens=seq.num_draft_tokens,
            accepted_draft_tokens=seq.num_accepted_tokens,
            decode_steps=seq.num_token_steps,
        )
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=e.new_token_ids,
            text_delta=e.text_delta,
            logprobs=e.logprobs if seq.sampling.wants_logprobs else None,
            top_logprobs=e.top_logprobs,
            prompt_logprobs=e.prompt_logprobs,
            finished=e.finished,
            stop_reason=seq.stop_reason if e.finished else None,
            finish_reason=seq.finish_reason if e.finished else None,
            usage=usage,
            timing=_timing(seq) if e.finished else None,
            error=e.error,
        )

    # ------------------------------------------------------------------ reporting
    def stats(self) -> EngineStats:
        bm = self.block_manager
        c = self.scheduler.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used,
            kv_blocks_free=bm.num_free,
            kv_blocks_cached=bm.num_cached,
            prefix_cache_hit_tokens=bm.hit_tokens,
            prefix_cache_queried_tokens=bm.queried_tokens,
            num_preemptions=c.num_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=c.generation_tokens_total,
            cached_prompt_tokens_total=c.cached_prompt_tokens_total,
            spec_verify_steps_total=c.spec_verify_steps_total,
            spec_draft_tokens_total=c.spec_draft_tokens_total,
            spec_accepted_tokens_total=c.spec_accepted_tokens_total,
            spec_emitted_tokens_total=c.spec_emitted_tokens_total,
        )

    def info(self) -> EngineInfo:
        """What this engine serves and how it chose to (a snapshot: `peak_workspace_bytes` grows with use)."""
        return EngineInfo(
            model_path=self.model_path,
            model_config=self.model_config,
            max_model_len=self.max_model_len,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            attention_backend=self.attention_backend,
            kv_blocks_total=self.block_manager.num_blocks,
            kv_bytes_per_token=self.bytes_per_token,
            kv_cache_bytes=self.runner.cache.nbytes,
            weight_bytes=self.weight_bytes,
            peak_workspace_bytes=self.runner.peak_workspace_bytes,
            config=self.config,
            kv_cache_dtype=ledger_dtype_name(self.kv_dtype),
            kv_bytes_per_block=self.bytes_per_block,
            draft_model_path=self.draft_path,
            draft_kv_bytes_per_token=self.draft_bytes_per_token,
            draft_kv_bytes_per_block=self.draft_bytes_per_block,
            draft_kv_cache_bytes=self.draft_runner.cache.nbytes if self.draft_runner is not None else 0,
            draft_weight_bytes=self.draft_weight_bytes,
            compiled=self.compiled,
            compile_seconds=self.compile_seconds,
            load_plan=self.load_plan,
        )

    # ------------------------------------------------------------------ offline use
    def generate(
        self, prompts: Seq[str | list[int]], sampling: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Run the prompts to completion; results in prompt order."""
        params = sampling or SamplingParams()
        per = list(params) if not isinstance(params, SamplingParams) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise InvalidRequestError("sampling", f"{len(per)} sampling params for {len(prompts)} prompts")
        ids = [f"generate-{self._next_index + i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, per, strict=True):
            self.add_request(rid, prompt, p)
        prompt_ids = {rid: list(self._requests[rid].token_ids) for rid in ids}
        done = {rid: Completion(rid) for rid in ids}
        while not all(c.finished for c in done.values()):
            for out in self.step():
                if out.request_id in done:
                    done[out.request_id].add(out)
        failed = [c.error for c in done.values() if c.finish_reason is FinishReason.ERROR]
        if failed:
            raise RequestFailedError(f"{len(failed)} of {len(ids)} requests failed: {failed[0]}")
        return [
            GenerationResult(
                request_id=rid,
                prompt_token_ids=prompt_ids[rid],
                token_ids=done[rid].token_ids,
                text=done[rid].text,
                finish_reason=done[rid].finish_reason or FinishReason.STOP,
                usage=done[rid].usage,
                timing=done[rid].timing or Timing(),
                logprobs=done[rid].logprobs,
                top_logprobs=done[rid].top_logprobs,
                prompt_logprobs=done[rid].prompt_logprobs,
                stop_reason=done[rid].stop_reason,
            )
            for rid in ids
        ]


def check_text_prompt(text: str) -> None:
    """The checks a text prompt gets before it is tokenized (the engine's and the async engine's, one place)."""
    if not text:
        raise InvalidRequestError("prompt", "the prompt is empty")


def check_min_tokens(sampling: SamplingParams, vocab: int, eos_ids: frozenset[int]) -> None:
    """Refuse `min_tokens` > 0 when the tokens it keeps out until then (the stop token ids, and EOS unless
    `ignore_eos`) are the whole vocabulary: nothing could be sampled before `min_tokens`."""
    if sampling.min_tokens <= 0:
        return
    banned = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_ids))
    if len({t for t in banned if 0 <= t < vocab}) >= vocab:
        raise InvalidRequestError(
            "min_tokens",
            f"every token id of the vocabulary ({vocab}) is a stop token (stop_token_ids, and EOS unless ignore_eos), "
            "so no token could be sampled before min_tokens; lower min_tokens to 0 or stop on fewer ids",
        )


def check_encoded(ids: list[int]) -> list[int]:
    """The check a text prompt gets once tokenized."""
    if not ids:
        raise InvalidRequestError("prompt", "the prompt encodes to no tokens")
    return ids


def _timing(seq: Sequence) -> Timing:
    def ms(t: float | None) -> float:
        return 0.0 if t is None else (t - seq.arrival_time) * 1000.0

    n = seq.num_output_tokens
    tpot = 0.0
    if n > 1 and seq.first_token_time is not None and seq.finish_time is not None:
        tpot = (seq.finish_time - seq.first_token_time) * 1000.0 / (n - 1)
    return Timing(queue_ms=ms(seq.first_scheduled_time), ttft_ms=ms(seq.first_token_time), tpot_ms=tpot,
                  total_ms=ms(seq.finish_time))  # fmt: skip


def _check_draft(target: Bundle, draft: Bundle) -> None:
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


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device: CUDA was requested but is not available")
    return device


def _kv_budget(config: EngineConfig, device: torch.device, weight_bytes: int) -> int:
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * config.gpu_memory_fraction)
    return DEFAULT_CPU_KV_BYTES


class _CompileFailed(Exception):
    """An 'auto' compile that failed at warm-up (the engine records it and runs eagerly)."""
