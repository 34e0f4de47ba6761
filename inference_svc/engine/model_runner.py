"""The model runner: turns one scheduled batch into one forward pass over the paged KV cache.

Contract:
- Owns the model, the KV cache (`kv_cache.KVCache`, stored in `kv_dtype`) and the attention backend choice. Reads
  Sequences (never writes them).
- `run(batch)` flattens the batch into one `[T]` token row (decode queries first, then prefill chunks), builds the
  `AttentionMetadata` (slots, block tables, context lengths) once (a chunk of at most `QUERY_CHUNK_MAX` tokens,
  such as a verify item of speculative decoding, its last token and drafts, runs as one decode query per token
  over its context so far), runs shared_model's decoder
  with a per-step backend (its serving form, `shared_model.serving_model.ServingDecoder`, prepared by the engine:
  projections merged, bit-equal to the plain decoder, and weights quantized by `shared_model.quantize` when asked;
  traced by `shared_model.compiled` when `compiled` is set), and returns fp32 logits only for the rows
  that sample: the last row of a sequence whose chunk reaches its last token, and every row of a verify item;
  the LM head runs on those rows only.
- Prompt logprobs: for a sequence whose request asks for them, the positions of this step's chunk whose next
  token is a prompt token, and that `Sequence.prompt_logprobs` does not hold yet, also go through the LM head
  (in pieces of `logprobs.ROWS_PER_PIECE` rows) and come back reduced to `TokenLogprob`s in `StepLogits.prompt`:
  never a [prompt, vocab] tensor.
- A compiled runner over the default (torch) ops runs a decode-only step's attention in C++ from inside the graph
  where the kernel reads its cache (`inference_svc.attention.native_cpu.GraphDecode`, given the cache and the
  step's metadata as tensors), with the same kernel and results as the Python backend, which serves the rest.
- A compiled runner given `decode_rows` (the load plan's `decode_runner` choice) runs a decode-only step of at
  most that many rows through the whole decoder as one C++ call (`shared_model.native_decode.NativeDecode`, over
  the same cache and metadata as `GraphDecode`) instead of the graph; longer steps and prefills take the graph.
  Where the runner holds the LM head (`NativeDecode.has_lm_head`) and every row of the step samples, the logits
  come from that same call (the head's kernel for those rows, as `model.logits` runs it).
- LoRA (`lora`, the engine's `inference_svc.lora.slots.LoraSlots`): a step holding a request with an adapter
  (`Sequence.lora_slot`) runs its forward inside `lora.rows(...)` with every row's slot in the flat layout, so each
  row gets its own adapter's delta and base rows their plain output; a step of base requests only runs as without.
- Runs under `torch.inference_mode()`; no autograd state and no global state.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

import torch

from inference_svc.attention.native_cpu import GraphDecode
from inference_svc.attention.paged import AttentionMetadata, PagedAttentionFactory, paged_attention_factory
from inference_svc.attention.torch_ops import is_torch_ops, torch_ops
from inference_svc.engine.kv_cache import KVCache
from inference_svc.engine.logprobs import ROWS_PER_PIECE, token_logprobs
from inference_svc.engine.pooling import Pooling
from inference_svc.engine.sequence import ScheduledSeq
from inference_svc.engine.types import MAX_SPECULATIVE_TOKENS, TokenLogprob
from inference_svc.lora.slots import LoraSlots
from shared_model.compiled import CompiledDecoder
from shared_model.config import ModelConfig
from shared_model.native_decode import NativeDecode
from shared_model.serving_model import RowTable, ServingDecoder

BackendFactory = Callable[[KVCache, AttentionMetadata], Callable]

QUERY_CHUNK_MAX = MAX_SPECULATIVE_TOKENS + 1
"""A chunk of at most this many tokens (a verify item: the last token and up to K drafts) runs as that many decode
queries, token i over the context up to and including itself, instead of as a prefill chunk. It computes the same
attention through the decode kernels, which read the cache in place; the prefill path would gather the context
and build a mask, a cost that a chunk of a few tokens does not pay back."""


class StepLogits(NamedTuple):
    sample: torch.Tensor
    """[R, vocab] fp32: the sampling items' rows in batch order (`ScheduledSeq.num_sample_rows` each: one, or
    K + 1 for a verify item)."""
    prompt: dict[int, list[TokenLogprob]]
    """Batch index → the logprobs of the prompt tokens this step's chunk predicts, in order, continuing
    `seq.prompt_logprobs` (one per prompt token after the first)."""


@dataclass(frozen=True)
class _PromptRows:
    item: int
    """Batch index."""
    rows: list[int]
    """Rows of the flat [T] layout whose logits predict `targets`."""
    targets: list[int]
    k: int


class ModelRunner:
    """Forward passes over a paged KV cache."""

    def __init__(
        self,
        model: ServingDecoder,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend_factory: BackendFactory | None = None,
        prompt_logprobs: bool = True,
        kv_dtype: torch.dtype | None = None,
        compiled: bool = False,
        native: bool = True,
        row_table: RowTable | None = None,
        lora: LoraSlots | None = None,
        dynamic_threads: bool = False,
        decode_rows: int = 0,
    ) -> None:
        """`native`: the load plan's `cpu_kernels` choice (Tandem's C++ kernels: the compiled step's in-graph decode
        attention); False keeps torch's. `row_table`: the compiled step's projections' kernels by row count (the
        load plan's `linear` choice, `inference_svc.executor.choose_row_table`); None keeps torch's.
        `dynamic_threads`: the compiled step follows the intra-op thread count of each call (the thread governor's:
        `shared_model.compiled`). `decode_rows`: decode-only steps of up to this many rows run through
        `NativeDecode` (`inference_svc.executor.prepare.choose_decode_runner`; 0: none), which needs the step's
        attention in C++ (`GraphDecode`) and no LoRA."""
        self.model = model
        self.lora = lora
        """The adapter slots of `model`'s projections (None: no LoRA)."""
        self.computes_prompt_logprobs = prompt_logprobs
        """False for a draft model's runner: the target's logits are the ones reported."""
        self.config = model_config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.backend_factory = backend_factory or paged_attention_factory(torch_ops())
        # the stored K/V dtype (`kv_cache.resolve_kv_dtype`); the compute dtype by default
        self.cache = KVCache.allocate(
            model_config.num_layers, num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim,
            kv_dtype or dtype, device,
        )  # fmt: skip
        # the torch ops' compiled decode steps attend in C++ from inside the graph, where they can
        factory = self.backend_factory
        torch_backend = isinstance(factory, PagedAttentionFactory) and is_torch_ops(factory.ops)
        self.compiled = CompiledDecoder(model, row_table, dynamic_threads) if compiled else None
        """The compiled forward (None: eager); the engine warms it up before serving."""
        self._hidden_states = model.hidden_states if self.compiled is None else self.compiled.hidden_states
        self.graph_decode = compiled and torch_backend and native and GraphDecode.serves(self.cache)
        """Whether a compiled decode-only step attends in C++ from inside the graph (`GraphDecode`); else every
        step's layers call the Python backend."""
        if decode_rows and (not self.graph_decode or lora is not None):
            raise ValueError("decode_rows needs a compiled step whose decode attention runs in C++, without LoRA")
        self.native_decode = NativeDecode(model, decode_rows) if decode_rows else None
        """The decode runner of the decode-only steps it takes (None: the graph runs every step)."""
        self.peak_workspace_bytes = 0
        # the prefill fields of a decode-only step (read-only constants, as `_prepare` would build them)
        self._no_prefill_cu = torch.zeros(1, dtype=torch.int32, device=device)
        self._no_prefill_lens = torch.zeros(0, dtype=torch.int32, device=device)
        self._no_prefill_tables = _pad_tables([], device)
        c = model_config
        elem = torch.empty((), dtype=dtype).element_size()
        # live activations per token at the widest point: MLP gate+up, q/k/v, residual + normed hidden
        self._workspace_per_token = (2 * c.intermediate_size + c.q_size + 2 * c.kv_size + 2 * c.hidden_size) * elem

    @torch.inference_mode()
    def run(self, batch: Seq[ScheduledSeq]) -> StepLogits:
        """The sampling rows' logits, and the prompt logprobs this step computed (see `StepLogits`)."""
        if all(b.is_decode for b in batch):
            input_ids, positions, meta, sample_rows = self._prepare_decode(batch)
            prompt_rows: list[_PromptRows] = []
        else:
            input_ids, positions, meta, sample_rows, prompt_rows = self._prepare(batch)
        decode_only = self.graph_decode and GraphDecode.covers(meta)
        native = self.native_decode
        rows_in = int(input_ids.shape[0])
        if decode_only and native is not None and rows_in <= native.max_rows:
            every_row_samples = not prompt_rows and sample_rows == list(range(rows_in))
            if native.has_lm_head and every_row_samples:  # the logits from the same C++ call
                logits = native.logits(input_ids, positions, self.cache.data, meta.slot_mapping,
                                       meta.decode_context_lens, meta.decode_block_tables).float()  # fmt: skip
                self._track_workspace(rows_in, rows_in)
                return StepLogits(logits, {})  # [T, vocab]
            hidden = native.hidden_states(input_ids, positions, self.cache.data, meta.slot_mapping,
                                          meta.decode_context_lens, meta.decode_block_tables)  # fmt: skip
        elif self.lora is not None and any(b.seq.lora_slot >= 0 for b in batch):
            backend = self._backend(meta, decode_only)
            with self.lora.rows(_row_slots(batch), self.device):
                hidden = self._hidden_states(input_ids[None], positions[None], backend)[0]  # [T, H]
        else:
            backend = self._backend(meta, decode_only)
            hidden = self._hidden_states(input_ids[None], positions[None], backend)[0]  # [T, H]
        in_order = len(sample_rows) == hidden.shape[0] and sample_rows == list(range(hidden.shape[0]))
        rows = hidden if in_order else hidden[sample_rows]  # [R, H], the sampling items' rows in batch order
        logits = self.model.logits(rows).float()  # [S_sample, vocab]
        self._track_workspace(hidden.shape[0], logits.shape[0])
        prompt = {p.item: self._prompt_logprobs(hidden, p) for p in prompt_rows}
        return StepLogits(logits, prompt)

    def _backend(self, meta: AttentionMetadata, decode_only: bool) -> Callable:
        """A decode-only step's layers attend in C++ from the graph (`GraphDecode`); others the Python backend."""
        return GraphDecode(self.cache, meta) if decode_only else self.backend_factory(self.cache, meta)

    @torch.inference_mode()
    def embed(self, prompts: Seq[list[int]], pooling: Pooling, max_tokens: int) -> torch.Tensor:
        """[N, H] float32: each prompt's final-norm hidden states pooled by `pooling`. Prompt-only forwards: no KV
        cache is read or written and nothing is sampled. Prompts run in right-padded batches of similar lengths,
        at most `max_tokens` padded positions each (a longer prompt runs alone); causal attention keeps every
        row's real positions independent of the padding after them."""
        out = torch.empty(len(prompts), self.config.hidden_size, dtype=torch.float32)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end - start + 1) * len(prompts[order[end]]) <= max_tokens:
                end += 1
            rows = order[start:end]
            width = len(prompts[rows[-1]])
            ids = torch.zeros(len(rows), width, dtype=torch.int64)  # [B, T], right-padded with id 0
            for b, i in enumerate(rows):
                ids[b, : len(prompts[i])] = torch.tensor(prompts[i], dtype=torch.int64)
            lengths = torch.tensor([len(prompts[i]) for i in rows], device=self.device)  # [B]
            positions = torch.arange(width, device=self.device).expand(len(rows), width)  # [B, T]
            hidden = self.model.hidden_states(ids.to(self.device), positions)  # [B, T, H]
            out[rows] = pooling.pool(hidden, lengths).cpu()
            start = end
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, p: _PromptRows) -> list[TokenLogprob]:
        out: list[TokenLogprob] = []
        for lo in range(0, len(p.rows), ROWS_PER_PIECE):
            rows = torch.tensor(p.rows[lo : lo + ROWS_PER_PIECE], dtype=torch.int64, device=hidden.device)
            logits = self.model.logits(hidden[rows]).float()  # [r, vocab]
            targets = torch.tensor(p.targets[lo : lo + ROWS_PER_PIECE], dtype=torch.int64)
            out += token_logprobs(logits, targets, p.k)
        return out

    def _prepare(
        self, batch: Seq[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[_PromptRows]]:
        bs = self.block_size
        # decode queries: every token of a decode (one) or of a short chunk such as a verify item, each a query of
        # its own over the context up to it; longer chunks run as prefill chunks
        decodes = [b for b in batch if b.num_tokens <= QUERY_CHUNK_MAX]
        prefills = [b for b in batch if b.num_tokens > QUERY_CHUNK_MAX]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}  # id(item) -> row of its last token in the flat [T] layout
        first_row: dict[int, int] = {}
        for b in (*decodes, *prefills):
            table = b.seq.block_table
            rng = range(b.start, b.start + b.num_tokens)
            first_row[id(b)] = len(ids)
            ids.extend(b.token_ids)
            pos.extend(rng)
            slots.extend(table[p // bs] * bs + p % bs for p in rng)
            last_row[id(b)] = len(ids) - 1
        prompt_rows = [
            _prompt_rows(i, b, first_row[id(b)])
            for i, b in enumerate(batch)
            if b.seq.sampling.prompt_logprobs is not None and self.computes_prompt_logprobs
        ]
        # Logits rows follow the caller's batch order, not the flat layout (decodes first): a cache-hit admission
        # whose remaining prompt is one token runs as a decode yet sits after prefill chunks in the batch.
        sample_rows = [r for b in batch for r in range(last_row[id(b)] - b.num_sample_rows + 1, last_row[id(b)] + 1)]
        dev = self.device
        decode_lens = [p + 1 for b in decodes for p in range(b.start, b.start + b.num_tokens)]
        decode_tables = [b.seq.block_table for b in decodes for _ in range(b.num_tokens)]
        q_lens = [b.num_tokens for b in prefills]
        ctx_lens = [b.start + b.num_tokens for b in prefills]
        prefill_tables = [b.seq.block_table for b in prefills]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=len(decode_lens),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32, device=dev),
            decode_block_tables=_pad_tables(decode_tables, dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            prefill_block_tables=_pad_tables(prefill_tables, dev),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        return input_ids, positions, meta, sample_rows, [p for p in prompt_rows if p.rows]

    def _prepare_decode(
        self, batch: Seq[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """`_prepare` for a decode-only step (the common one): the same tensors from three host-to-tensor copies.

        Every item is one token at the end of its sequence, so the flat layout is the batch order and every row
        samples; the prefill fields are the empty constants built once.
        """
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        for b in batch:
            p, table = b.start, b.seq.block_table
            ids.append(b.seq.token_ids[p])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            tables.append(table)
        lens = [p + 1 for p in pos]
        width = max(len(t) for t in tables)
        input_ids, positions, slot_mapping = torch.tensor([ids, pos, slots], dtype=torch.int64, device=dev).unbind(0)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=len(batch),
            decode_context_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            decode_block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev
            ),
            cu_seqlens_q=self._no_prefill_cu,
            prefill_context_lens=self._no_prefill_lens,
            prefill_block_tables=self._no_prefill_tables,
        )
        return input_ids, positions, meta, list(range(len(batch)))

    def drop_compiled(self) -> None:
        """Run every step eagerly from now on."""
        if self.compiled is not None:
            self.compiled.release_row_kernels()
        self.compiled = None
        self.graph_decode = False
        self.native_decode = None
        self._hidden_states = self.model.hidden_states

    @torch.inference_mode()
    def zero_blocks(self, blocks: Seq[int]) -> None:
        """Zero the K and V (and fp8/int8 scales) of `blocks` in every layer (a failed sequence's, before reuse)."""
        self.cache.zero_blocks(torch.tensor(blocks, dtype=torch.int64, device=self.device))

    def _track_workspace(self, num_tokens: int, num_logit_rows: int) -> None:
        """Estimate of the step's largest live activations (bytes) plus its fp32 logits rows."""
        step = num_tokens * self._workspace_per_token + num_logit_rows * self.config.vocab_size * 4
        self.peak_workspace_bytes = max(self.peak_workspace_bytes, step)


def _prompt_rows(item: int, b: ScheduledSeq, first_row: int) -> _PromptRows:
    """The rows of item `b` (starting at `first_row` of the flat layout) whose next token is a prompt token not yet
    in `seq.prompt_logprobs` (which holds one entry per prompt token, the first being None)."""
    seq = b.seq
    done = len(seq.prompt_logprobs) if seq.prompt_logprobs is not None else 1
    lo = max(b.start, done - 1)
    hi = min(b.start + b.num_tokens, seq.num_prompt_tokens - 1)
    positions = range(lo, hi)
    k = seq.sampling.prompt_logprobs or 0
    return _PromptRows(item, [first_row + p - b.start for p in positions], [seq.token_ids[p + 1] for p in positions], k)


def _row_slots(batch: Seq[ScheduledSeq]) -> list[int]:
    """Each row's adapter slot (-1: base) in the flat [T] layout of `_prepare` / `_prepare_decode`: the short
    chunks (decodes, verify items) first, then the prefill chunks, each in batch order."""
    short = [b for b in batch if b.num_tokens <= QUERY_CHUNK_MAX]
    long = [b for b in batch if b.num_tokens > QUERY_CHUNK_MAX]
    return [b.seq.lora_slot for b in (*short, *long) for _ in range(b.num_tokens)]


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables padded with 0 to the longest: int32 [S, max_blocks]."""
    width = max((len(t) for t in tables), default=0)
    out = torch.zeros(len(tables), max(width, 1), dtype=torch.int32)
    for i, t in enumerate(tables):
        if t:
            out[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return out.to(device)
