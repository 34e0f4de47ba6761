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
- Files by job: loading, the draft model's checks, the KV pool's sizing and the compile warm-up are
  `engine.loader`; the request checks are `engine.validation.RequestValidator` (`check_request` and
  `check_prompt_length` delegate to it); `RequestOutput`/`GenerationResult`/`Timing` assembly is `engine.outputs`.
  This module keeps the Engine's state, the step and the public methods.
- Times come from `time.monotonic()`; `Timing` is in milliseconds from the request's arrival (`engine.outputs`).
- The KV pool is sized by `engine.loader.size_kv_pool` for the stored K/V dtype (`config.kv_cache_dtype`,
  `engine.kv_cache`), a draft model's blocks beside the target's (its K/V shares the budget).
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
  the weight), each projection's linear method, the attention backend, the sampler, the compiled step and its
  decode runner.
  First of all, `config.threads` and `config.omp_wait` size torch's intra-op thread pool and record the OpenMP wait
  policy in effect (`inference_svc.executor.threads`), and `config.thread_governor` decides whether
  `thread_governor` (`inference_svc.executor.governor`) moves the count under that ceiling with other processes'
  load: `step()` polls it when due (one float compared per step; `poll_threads()` between steps while idle), on
  the engine's thread, and a compiled step then follows the count (`shared_model.compiled`, dynamic threads).
- LoRA (`config.lora_enabled`): `lora` holds the adapter slots (`inference_svc.lora`); a request's
  `SamplingParams.lora_name` picks its slot when it is queued (NOT_FOUND for one not loaded), its prefix-cache
  blocks are keyed by that adapter's loading, and `unload_lora_adapter` refuses (409) while a request uses it.
- Compiled step (`config.compile`, decided by a rule in `executor.choose_compile`): the runners trace the decoder
  with `shared_model.compiled`, and the constructor warms them up before it returns (a prefill chunk, a lone decode
  and a batched decode of throwaway sequences over free blocks, which are zeroed afterwards), so the first request
  never waits on a compile; `info()` reports whether steps run compiled, how long the compile took, and the plan.
  The compile first loads a saved entry of `inference_svc.executor.compile_cache` (the bundle's own, then
  `config.compile_cache`) and saves one after a miss; the plan's `compile_cache` choice says which.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from inference_svc.engine import loader
from inference_svc.engine.block_manager import BlockManager
from inference_svc.engine.config import EngineConfig
from inference_svc.engine.detokenizer import IncrementalDetokenizer
from inference_svc.engine.grammar import ConstrainedDecoding, GrammarCompiler, MaskItem
from inference_svc.engine.kv_cache import ledger_dtype_name, resolve_kv_dtype
from inference_svc.engine.model_runner import ModelRunner
from inference_svc.engine.outputs import GenerationResult, generation_result, to_output
from inference_svc.engine.pooling import Pooling
from inference_svc.engine.rejection import verify
from inference_svc.engine.sampler import Emitted, Sampler, SampleRequest
from inference_svc.engine.scheduler import Scheduler, StepEvent
from inference_svc.engine.sequence import ScheduledSeq, Sequence
from inference_svc.engine.types import Completion, EngineInfo, EngineStats, FinishReason, RequestOutput, SamplingParams
from inference_svc.engine.validation import RequestValidator
from inference_svc.errors import InvalidRequestError, ModelLoadError, RequestFailedError
from inference_svc.executor import compile_cache, governor
from inference_svc.executor import prepare as executor  # a module: it imports the engine's config in turn
from inference_svc.executor.governor import ThreadGovernor
from inference_svc.executor.plan import LoadPlan
from inference_svc.executor.step_budget import choose_prefill_group, choose_step_budget
from inference_svc.executor.threads import settle as settle_threads
from inference_svc.lora import requests as lora_requests
from shared_model.bundle import Bundle
from shared_model.config import ModelConfig
from shared_model.quantize import dequantizes_at, serving_weight_bytes
from shared_model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


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
        settled = settle_threads(config.threads, config.omp_wait)
        governed, governor_choice = governor.resolve(config.thread_governor, settled.threads, device.type == "cpu")
        budget, budget_choice = choose_step_budget(config.max_num_batched_tokens, device.type,
                                                   config.prefill_chunk_size, config.max_num_seqs)  # fmt: skip
        self.thread_governor = ThreadGovernor(settled.threads, settled.cpus, governed)
        """The intra-op thread count of the steps, polled between them (`inference_svc.executor.governor`)."""
        native, cpu_choice = executor.choose_cpu_kernels(config, device)
        prepared = executor.prepare(bundle, config, native)
        model = prepared.model
        group, group_choice = choose_prefill_group(config.prefill_group_tokens, device.type, budget,
                                                   lambda rows: dequantizes_at(model, rows))  # fmt: skip
        self.config = config = dataclasses.replace(config, max_num_batched_tokens=budget,
                                                   prefill_group_tokens=group)  # the scheduler's counts  # fmt: skip
        draft_model = None
        if draft is not None:
            loader.check_draft(bundle, draft)
            draft_model = executor.prepare(draft, config, native).model
        self.attention_backend, backend, attention_choice = executor.choose_attention(config, device, native)
        compile_step, compile_choice = executor.choose_compile(config, device, model)
        row_table = executor.choose_row_table(config, native, self.dtype) if compile_step else None
        self.draft_path = None if draft is None else draft.path
        self.weight_bytes = serving_weight_bytes(model)
        self.draft_weight_bytes = 0 if draft_model is None else serving_weight_bytes(draft_model)
        bs = config.block_size
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        decode_rows, runner_choice = executor.choose_decode_runner(
            config, compile_step, native, self.attention_backend, row_table, model, self.kv_dtype
        )
        pool = loader.size_kv_pool(config, self.model_config, self.kv_dtype, None if draft is None else draft.config,
                                   device, self.weight_bytes + self.draft_weight_bytes)  # fmt: skip
        self.bytes_per_token = pool.bytes_per_token
        self.bytes_per_block = pool.bytes_per_block
        self.draft_bytes_per_token = pool.draft_bytes_per_token
        self.draft_bytes_per_block = pool.draft_bytes_per_block
        self.max_model_len = pool.max_model_len
        num_blocks = pool.num_blocks
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.lora = prepared.lora
        """The LoRA adapter slots (None: LoRA off); loaded and unloaded on this engine's thread only."""
        self.runner = ModelRunner(
            model, self.model_config, num_blocks, bs, self.dtype, device, backend, kv_dtype=self.kv_dtype,
            compiled=compile_step, native=native, row_table=row_table,
            lora=self.lora, dynamic_threads=governed, decode_rows=decode_rows,
        )  # fmt: skip
        self.draft_runner = None
        if draft is not None and draft_model is not None:
            draft_table = executor.choose_row_table(config, native, draft.dtype) if compile_step else None
            draft_rows, draft_choice = executor.choose_decode_runner(config, compile_step, native,
                                                                     self.attention_backend, draft_table,
                                                                     draft_model, self.kv_dtype)  # fmt: skip
            runner_choice = executor.with_draft(runner_choice, draft_choice)
            self.draft_runner = ModelRunner(draft_model, draft.config, num_blocks, bs, draft.dtype, device, backend,
                                            prompt_logprobs=False, kv_dtype=self.kv_dtype,
                                            compiled=compile_step, native=native, row_table=draft_table,
                                            dynamic_threads=governed, decode_rows=draft_rows)  # fmt: skip
        self.sampler = Sampler(native=native)
        self._eos_ids = frozenset(self.model_config.eos_token_ids) | (
            {self.tokenizer.eos_id} if self.tokenizer.eos_id is not None else set()
        )
        self.validator = RequestValidator(
            config, self.model_config, self.tokenizer, self._eos_ids, self.max_model_len, num_blocks
        )
        """The request checks, over what is fixed at load (any thread may call it)."""
        # always built: a request may ask for speculation on an engine that does not speculate by default
        speculator = loader.build_speculator(config, self.draft_runner, self.sampler, self._eos_ids)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, speculator)
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
            key = compile_cache.cache_key(bundle.path, config, native, self.dtype, dynamic_threads=governed)
            cache = compile_cache.open_cache(config.compile_cache, bundle.path, key, config.compile_cache_max_mb)
            try:
                with cache.compiling():
                    self.compile_seconds = sum(
                        loader.warm_up(r, config, num_blocks, self.tokenizer, cache.packages(name))
                        for name, r in (("target", self.runner), ("draft", self.draft_runner))
                        if r is not None
                    )
                log.info("compiled the decode step in %.1f s", self.compile_seconds)
            except loader.CompileFailed as failed:
                compile_choice = executor.compile_failed(failed.__cause__ or failed)
                runner_choice = executor.decode_runner_dropped()
                for r in (self.runner, self.draft_runner):
                    if r is not None:
                        r.drop_compiled()
            cache_choice = cache.finish(self.compiled)
        self.load_plan = LoadPlan((
            *settled.choices, governor_choice, budget_choice, group_choice, cpu_choice, *prepared.choices,
            *executor.linear_choices(model), attention_choice, executor.sampler_choice(native, device), compile_choice,
            runner_choice, cache_choice,
        ))  # fmt: skip
        """Every lever's choice and reason, in the order made (`inference_svc.executor`); fixed from here on."""

    @property
    def compiled(self) -> bool:
        """Whether the target model's steps run compiled (the runner owns that state; 'auto' may have dropped it)."""
        return self.runner.compiled is not None

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
        bundle, device, draft = loader.load_bundles(path, config)
        return cls(bundle, config, device, draft)

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
            token_ids = self.validator.prompt_ids(prompt)
            self.validator.check_sampling(sampling)
        lora_slot, cache_salt = lora_requests.resolve(self.lora, sampling.lora_name)  # may have been unloaded since
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
            lora_slot=lora_slot,
            cache_salt=cache_salt,
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
        self.validator.check_request(prompt_ids, sampling)
        lora_requests.resolve(self.lora, sampling.lora_name)  # NOT_FOUND for an adapter not loaded

    def check_prompt_length(self, num_tokens: int) -> None:
        """InvalidRequestError when a prompt of `num_tokens` tokens cannot fit the context (prompt + at least one
        generated token). Reads only what is fixed at load, so any thread may call it (the async engine does,
        before a long prompt's ids become a list)."""
        self.validator.check_prompt_length(num_tokens)

    def embed(self, prompts: list[list[int]], pooling: Pooling) -> torch.Tensor:
        """[N, H] float32 pooled final-norm hidden states of these token-id prompts (`ModelRunner.embed`: prompt-only
        forwards, batched within `max_num_batched_tokens`). Every prompt is checked first (`InvalidRequestError`
        naming `prompt_token_ids`); no KV block or scheduler state is touched, so it may run between steps."""
        checked = [self.validator.prompt_ids(p) for p in prompts]
        return self.runner.embed(checked, pooling, self.config.max_num_batched_tokens)

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request at the next step. False if it is unknown or already finished."""
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished or request_id in self._pending_aborts:
            return False
        self._pending_aborts[request_id] = None
        return True

    def poll_threads(self) -> None:
        """Between steps while idle (the server's engine loop): the thread governor's poll, when due."""
        now = time.monotonic()
        if now >= self.thread_governor.due:
            self.thread_governor.poll(now)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        if now >= self.thread_governor.due:  # the governor's reading when due: this step's threads
            self.thread_governor.poll(now)
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
        outputs = [to_output(e) for e in events]
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
            running_lora_adapters=lora_requests.adapter_names(self.lora, self.scheduler.running),
            waiting_lora_adapters=lora_requests.adapter_names(self.lora, self.scheduler.waiting),
            max_lora=0 if self.lora is None else self.lora.max_loras,
            threads_active=self.thread_governor.active,
            others_cpu_busy=self.thread_governor.others,
        )

    def unload_lora_adapter(self, name: str) -> None:
        """Free adapter `name`'s slot (engine thread); refused while a request uses it (`lora.requests.unload`)."""
        lora_requests.unload(self.lora, name, self._requests.values())

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
        return [generation_result(rid, prompt_ids[rid], done[rid]) for rid in ids]
