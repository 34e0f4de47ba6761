"""The step budget: the most tokens (decode rows and prefill chunk tokens) one engine step computes.

Contract:
- `choose_step_budget(setting, device, chunk, max_num_seqs)` resolves `EngineConfig.max_num_batched_tokens` at
  load and returns the count with its `step_budget` choice for the load plan. A number is used as given. 'auto' is
  a rule, never a timing:
  - on a CPU, one whole prefill chunk beside every running decode: `prefill_chunk_size + max_num_seqs` (576 by
    default). Every prompt in a step gets its first token when the step ends, and a CPU step's time grows with its
    tokens, so a burst of prompts is answered over a few short steps instead of all at the end of one long one;
    and no prompt of a chunk's length is cut in two by the decode rows beside it. The price is more steps, each
    paying its own fixed costs (the weights read again, scheduling): lower TTFT at every load measured, slightly
    lower tokens/s for a load of long prompts, which sets the flag higher (docs/benchmarks.md §34);
  - on a GPU, `GPU_DEFAULT` (its steps are short at any of these sizes), never below `max_num_seqs`.
- `choose_prefill_group(setting, device, budget, dequantizes)` resolves `EngineConfig.prefill_group_tokens`: the
  most prefill tokens a step holds before it admits no further waiting prompt (its first chunk always fits). A
  number is used as given; 'auto' on a CPU is `CPU_PREFILL_GROUP` (128) tokens, or the budget where that is smaller:
  a CPU prefill step's time grows with its tokens and every prompt in it waits for the whole step, so a burst of
  short prompts is answered over several steps, the first group's first tokens after about a quarter of the time of
  one big step (docs/benchmarks.md §44, §46). Where the model's products of that many rows dequantize their weights
  at every call (`dequantizes(rows)`: `shared_model.quantize.dequantizes_at`; int8 and int4 past their row kernels'
  rows on a CPU without AMX tiles), each step pays that whole-weight pass once whatever its tokens, so 'auto' is
  `CPU_DEQUANTIZING_GROUP` (256): four steps of 128 cost a quantized burst more throughput than two of 256 and
  answered its median prompt no sooner (§47). A single prompt's chunk is never cut by it. On a GPU 'auto' is the
  budget: no limit.
- The engine builds its scheduler (and the embeddings' batches) from the resolved counts; each choice says which
  rule gave it.
"""

from __future__ import annotations

from collections.abc import Callable

from inference_svc.executor.plan import Choice

GPU_DEFAULT = 2048
CPU_PREFILL_GROUP = 128
"""'auto' prefill group on a CPU, in tokens: a quarter of a default chunk (docs/benchmarks.md §44: 256 against the
whole budget; §46: 128 against 256, a 16-prompt burst's median prompt answered sooner at 16 and 64 streams)."""
CPU_DEQUANTIZING_GROUP = 256
"""'auto' prefill group on a CPU where products of `CPU_PREFILL_GROUP` rows dequantize their weights at each call
(docs/benchmarks.md §47)."""


def choose_step_budget(setting: int | str, device: str, chunk: int, max_num_seqs: int) -> tuple[int, Choice]:
    """The step's token budget and its `step_budget` choice (see the module docstring)."""
    if setting != "auto":
        assert isinstance(setting, int)
        return setting, Choice("step_budget", str(setting), "--max-batched-tokens as given")
    if device == "cpu":
        why = f"auto on a CPU: a whole prefill chunk ({chunk}) beside every running decode ({max_num_seqs})"
        return chunk + max_num_seqs, Choice("step_budget", str(chunk + max_num_seqs), why)
    budget = max(GPU_DEFAULT, max_num_seqs)
    return budget, Choice("step_budget", str(budget), f"auto on a GPU: {GPU_DEFAULT}, at least --max-running")


def choose_prefill_group(
    setting: int | str, device: str, budget: int, dequantizes: Callable[[int], bool] | None = None
) -> tuple[int, Choice]:
    """The most prefill tokens a step holds before it admits no more prompts, and its `prefill_group` choice
    (`dequantizes(rows)`: whether the model's products of that many rows dequantize their weights; None: never)."""
    if setting != "auto":
        assert isinstance(setting, int)
        return setting, Choice("prefill_group", str(setting), "--prefill-group-tokens as given")
    if device == "cpu":
        if dequantizes is not None and dequantizes(CPU_PREFILL_GROUP):
            group = min(CPU_DEQUANTIZING_GROUP, budget)
            why = (
                f"auto on a CPU: {CPU_DEQUANTIZING_GROUP} tokens or the step budget, as the quantized products of "
                f"{CPU_PREFILL_GROUP} rows dequantize their weights at each step; a step's first chunk always fits"
            )
        else:
            group = min(CPU_PREFILL_GROUP, budget)
            why = f"auto on a CPU: {CPU_PREFILL_GROUP} tokens or the step budget; a step's first chunk always fits"
        return group, Choice("prefill_group", str(group), why)
    return budget, Choice("prefill_group", str(budget), "auto on a GPU: the step budget (no limit)")
