"""Preparing a decoder for serving: the ordered load-time transforms, each choice recorded with its reason.

Contract:
- The transforms run once, when the engine is built, in this order (`TRANSFORMS`), and never again while it serves:
  0. `threads` and `omp_wait`: torch's intra-op threads and OpenMP's wait policy, from the CPUs and cgroup quota
     this process finds (`inference_svc.executor.threads`); `thread_governor`: whether the steps give threads up
     to other processes' load between steps, that count being the most (`inference_svc.executor.governor`);
     `step_budget`: the most tokens a step computes, and `prefill_group`: the most prefill tokens a step holds
     before it admits no further prompt (both `inference_svc.executor.step_budget`).
  1. `cpu_kernels`: whether Tandem's C++ kernels (row GEMM, int8/int4 GEMV, decode attention, sampling) run,
     from `EngineConfig.cpu_kernels` and what this machine allows (`tandem_native`: x86-64 Linux,
     AVX-512 BW/VL/VNNI, a C++ compiler and ninja). Everything below that could use them is told this one answer;
     nothing reads an environment variable.
  2. `merge_projections`: q/k/v and gate/up merged into one matrix each (`shared_model.serving_model`).
  3. `quantization` (`EngineConfig.quantization`, `int4_kernel`): the weight format (`shared_model.quantize`).
  3b. `lora`: with `--enable-lora` or `--lora-modules`, each layer's projections get `max_loras` adapter slots
     (`inference_svc.lora.slots.LoraSlots`) and the `--lora-modules` adapters are checked and loaded into them (one
     that cannot be served is a `ModelLoadError` naming `lora_modules` and the adapter's field). With the C++
     kernels of transform 1 the adapters' deltas run as one fused call per projection (`tandem::lora_delta_`),
     else as torch's small matmuls; the choice's reason says which.
  4. `linear.<projection>`: the method each projection runs, with its row-count table (the module's own
     `method()`): recorded from the modules themselves, so the record cannot drift from what runs. A compiled
     step's dense projections take the table `choose_row_table` picks by a rule (`serving_model.compiled_row_table`:
     the weights' dtype, whether this CPU has AMX tiles, whether speculative decoding is on by default; an fp32
     table's many-row kernel by `serving_model.fp32_onednn`: the CPU's vendor).
  5. `attention`: the attention backend (`EngineConfig.attention_backend`) and its CPU decode kernels.
  6. `sampler`: the CPU sampler's C++ thresholds and one-call sampling, or torch's sort.
  7. `compile`: whether the step runs compiled (`EngineConfig.compile`). 'auto' is a rule, never a timing: compiled
     on a CPU for a model of at least `COMPILE_AUTO_MIN_PARAMS` parameters when inductor can build kernels here,
     and never with LoRA slots (the traced step takes no per-row adapter indices; 'on' with LoRA is refused).
     A compile that then fails under 'auto' leaves the step eager, and the engine records that (`compile_failed`).
  7b. `decode_runner` (`EngineConfig.decode_runner`): whether a compiled engine's decode-only steps run
     through the whole decoder as one C++ call (`shared_model.native_decode.NativeDecode`) instead of the graph,
     and up to how many rows: those the dense row table runs Tandem's kernels for (`tandem::row_gemm`, then AMX
     `tandem::tile_gemm` where the table has tiles: `RowTable.gemm_bounds`), or fewer where a quantized
     projection's row kernel takes fewer (`NativeDecode.most_rows`), so every projection keeps the kernel its row
     count picks. Only with the step compiled (an eager engine keeps the training decoder's bits), Tandem's
     kernels, the torch attention ops, a KV cache in the weights' dtype, and an fp32 or bf16 model whose
     projections have row kernels (`NativeDecode.unsupported`: dense ones `row_gemm`, int8's `int8_gemv`, int4's
     `int4_gemv`). The reason says whether the LM head runs in the same call (`NativeDecode.head_unsupported`).
  8. `compile_cache`: whether the compile loaded a saved entry (`inference_svc.executor.compile_cache`).
- `prepare(bundle, config, device)` runs 1-4 and returns the model and its choices; `choose_attention`,
  `choose_compile` and `sampler_choice` make 5-7. The engine assembles them into its `LoadPlan`
  (`inference_svc.executor.plan`), which every report reads.
- Deterministic: the same machine, model and flags give the same choices (and so the same kernels and bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import tandem_native
from inference_svc.engine.config import EngineConfig
from inference_svc.engine.model_runner import BackendFactory
from inference_svc.errors import ModelLoadError
from inference_svc.executor.plan import Choice
from inference_svc.lora.adapter import AdapterError, load_adapter
from inference_svc.lora.slots import LoraProjection, LoraSlots
from shared_model.bundle import Bundle
from shared_model.compiled import compiler_available
from shared_model.native_decode import NativeDecode
from shared_model.quantize import QuantizationError, QuantizedLinear, quantize_weights
from shared_model.serving_model import RowTable, ServingDecoder, ServingLinear, compiled_row_table, fp32_onednn

COMPILE_AUTO_MIN_PARAMS = 2_000_000
"""`compile='auto'` compiles on CPU from this many parameters up: below it a step costs well under a millisecond
and the warm-up compile (tens of seconds) is not paid back by a short-lived server (a test's)."""
TRANSFORMS = (
    "threads",
    "omp_wait",
    "thread_governor",
    "step_budget",
    "prefill_group",
    "cpu_kernels",
    "merge_projections",
    "quantization",
    "lora",
    "linear",
    "attention",
    "sampler",
    "compile",
    "decode_runner",
    "compile_cache",
)
"""The order of the load-time transforms (`linear` stands for one `linear.<projection>` choice per projection)."""


@dataclass(frozen=True)
class Prepared:
    """A decoder prepared for serving and the choices that made it (transforms 2 and 3)."""

    model: ServingDecoder
    choices: tuple[Choice, ...]
    lora: LoraSlots | None = None
    """The adapter slots (None: LoRA is off)."""


def choose_cpu_kernels(config: EngineConfig, device: torch.device) -> tuple[bool, Choice]:
    """Transform 1: (whether Tandem's C++ kernels run, the choice)."""
    if config.cpu_kernels == "off":
        return False, Choice("cpu_kernels", "off", "--cpu-kernels off: torch's kernels everywhere")
    if device.type != "cpu":
        return False, Choice("cpu_kernels", "off", f"the model runs on {device.type}; they are CPU kernels")
    ok, why = tandem_native.status()
    return ok, Choice("cpu_kernels", "tandem" if ok else "off", why)


def prepare(bundle: Bundle, config: EngineConfig, native: bool) -> Prepared:
    """Transforms 2 and 3: the serving decoder of `bundle.model` (`shared_model.serving_model`, its parameters
    shared), quantized as configured, with `native` from `choose_cpu_kernels`. Transform 4's record
    (`linear_choices`) is read once the step is built: a dense projection's row kernel serves compiled steps only."""
    choices = [Choice("merge_projections", "qkv+gate_up", "one matmul for q/k/v and one for gate/up (bit-equal)")]
    kind = config.quantization
    try:
        model = quantize_weights(
            bundle.model, kind, config.quantization_group_size, native, config.int4_kernel == "auto"
        )
    except QuantizationError as exc:
        raise ModelLoadError(f"{bundle.path}: quantization {kind}: {exc}") from exc
    choices.append(_quantization_choice(config))
    lora, lora_choice = apply_lora(model, config, bundle.dtype, native)
    choices.append(lora_choice)
    return Prepared(model, tuple(choices), lora)


def apply_lora(
    model: ServingDecoder, config: EngineConfig, dtype: torch.dtype, native: bool
) -> tuple[LoraSlots | None, Choice]:
    """Transform 3b: the adapter slots with the `--lora-modules` adapters loaded, and the choice (`native`:
    transform 1's; the deltas then run in one fused C++ call per projection where the slots' dtype allows)."""
    if not config.lora_enabled:
        return None, Choice("lora", "off", "no --enable-lora and no --lora-modules")
    slots = LoraSlots(model, config.max_loras, config.max_lora_rank, dtype, native)
    for name, folder in config.lora_module_dirs:
        try:
            slots.load(load_adapter(name, folder, model.config, config.max_lora_rank))
        except AdapterError as exc:
            raise ModelLoadError(f"lora_modules: {name}={folder}: {exc}") from exc
    loaded = ", ".join(f"{n} (rank {a.rank})" for n, a in slots.loaded.items()) or "none yet"
    reason = f"{config.max_loras} slot(s) of rank <= {config.max_lora_rank}, loaded: {loaded}; each row adds its " + (
        "adapter's delta (fused: one tandem::lora_delta_ call per projection)"
        if slots.fused is not None
        else "adapter's delta (torch: one small batched matmul pair per projection)"
    )
    return slots, Choice("lora", f"{len(slots.loaded)}/{config.max_loras}", reason)


def _quantization_choice(config: EngineConfig) -> Choice:
    kind = config.quantization
    if kind == "none":
        return Choice("quantization", "none", "--quantization none: weights in the model's dtype")
    group = f", groups of {config.quantization_group_size}" if kind == "int4" else ""
    return Choice("quantization", kind, f"--quantization {kind}{group}; the LM head int8 per channel")


def linear_choices(model: ServingDecoder) -> list[Choice]:
    """Transform 4's record: each projection's method, read from the first layer's modules (every layer's are the
    same kind) and the LM head."""
    layer = model.layers[0]
    modules = {
        "qkv_proj": layer.qkv,
        "o_proj": layer.o_proj,
        "gate_up_proj": layer.gate_up,
        "down_proj": layer.down_proj,
        "lm_head": model.lm_head,
    }
    return [Choice(f"linear.{name}", *_method(m)) for name, m in modules.items()]


def choose_row_table(config: EngineConfig, native: bool, dtype: torch.dtype) -> RowTable | None:
    """Transform 4's rule for a compiled step's dense projections (None: torch's kernels, without Tandem's)."""
    if not native or dtype not in (torch.float32, torch.bfloat16):
        return None
    tiles = tandem_native.tiles()
    dot = not tiles and tandem_native.dot_bf16()
    onednn = fp32_onednn(tandem_native.cpu_vendor())
    return compiled_row_table(dtype, tiles=tiles, exact_verify=config.speculative != "off", dot=dot, onednn=onednn)


def _method(module: torch.nn.Module) -> tuple[str, str]:
    if isinstance(module, (QuantizedLinear, ServingLinear, LoraProjection)):
        return module.method()
    return "F.linear", f"a plain {type(module).__name__}"


def choose_attention(config: EngineConfig, device: torch.device, native: bool) -> tuple[str, BackendFactory, Choice]:
    """Transform 5: the backend's name, its factory, and the choice."""
    from inference_svc.attention.paged import paged_attention_factory
    from inference_svc.attention.torch_ops import torch_ops

    name = config.attention_backend
    asked = f"--attention-backend {name}"
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        kernels = "C++ decode kernels" if native else "torch ops only"
        why = asked if name == "torch" else f"{asked} on {device.type}"
        choice = Choice("attention", "torch", f"{why}; {kernels}")
        return "torch", paged_attention_factory(torch_ops(native=native)), choice
    try:
        from inference_svc.attention.triton_ops import triton_backend_factory
    except ImportError as exc:
        if name == "triton":
            raise ModelLoadError(f"attention_backend: triton is not available ({exc})") from exc
        reason = f"{asked}: triton is not importable ({exc})"
        return "torch", paged_attention_factory(torch_ops(native=native)), Choice("attention", "torch", reason)
    factory, why = triton_backend_factory(device, config.triton_autotune)
    if factory is None:
        if name == "triton":
            raise ModelLoadError(f"attention_backend: triton is not available ({why})")
        reason = f"{asked}: triton cannot run here ({why})"
        return "torch", paged_attention_factory(torch_ops(native=native)), Choice("attention", "torch", reason)
    tiles = "autotuned tiles" if config.triton_autotune else "heuristic tiles (--no-triton-autotune)"
    return "triton", factory, Choice("attention", "triton", f"{asked} on {device}; {tiles}")


def sampler_choice(native: bool, device: torch.device) -> Choice:
    """Transform 6's record (the sampler takes `native` itself)."""
    if native and device.type == "cpu":
        return Choice("sampler", "tandem", "C++ thresholds (radix select) and one-call sampling of CPU fp32 rows")
    return Choice("sampler", "torch", "thresholds by a sort" + ("" if native else " (--cpu-kernels off)"))


def choose_compile(config: EngineConfig, device: torch.device, model: ServingDecoder) -> tuple[bool, Choice]:
    """Transform 7: (whether to compile, the choice), by the rule of the module docstring."""
    mode = config.compile
    if mode == "off":
        return False, Choice("compile", "off", "--compile off")
    if config.lora_enabled:  # EngineConfig refuses 'on' with LoRA
        return False, Choice("compile", "off", "LoRA slots are on: the compiled step takes no per-row adapter")
    ok, why = compiler_available(device)
    if mode == "on":
        if not ok:
            raise ModelLoadError(f"compile: cannot compile the decode step here: {why}")
        return True, Choice("compile", "on", f"--compile on; {why}")
    params = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())  # quantized too
    if device.type != "cpu":
        return False, Choice("compile", "off", f"--compile auto compiles CPU steps only (this is {device.type})")
    if params < COMPILE_AUTO_MIN_PARAMS:
        size = f"{params / 1e6:.2f}M parameters < {COMPILE_AUTO_MIN_PARAMS / 1e6:g}M"
        return False, Choice("compile", "off", f"--compile auto: {size} (a compile would not pay back)")
    if not ok:
        return False, Choice("compile", "off", f"--compile auto: {why}")
    return True, Choice("compile", "on", f"--compile auto: {params / 1e6:.1f}M parameters on CPU; {why}")


def choose_decode_runner(
    config: EngineConfig, compile_step: bool, native: bool, attention: str, row_table: RowTable | None,
    model: ServingDecoder, kv_dtype: torch.dtype,
) -> tuple[int, Choice]:  # fmt: skip
    """Transform 7b: (the most rows of a decode-only step the runner takes, 0 for none; the choice)."""
    name = "decode_runner"
    if config.decode_runner == "off":
        return 0, Choice(name, "off", "--decode-runner off: every compiled step runs its graph")
    if not compile_step:
        return 0, Choice(name, "off", "the step runs eagerly: the runner takes a compiled engine's decode steps")
    bounds = None if row_table is None else row_table.gemm_bounds()
    if not native or bounds is None:
        return 0, Choice(name, "off", "the projections do not run Tandem's row kernels (the runner's)")
    if attention != "torch":
        return 0, Choice(name, "off", f"the {attention} attention backend (the runner attends as the torch ops do)")
    dtype = model.embed_tokens.weight.dtype
    if kv_dtype != dtype:
        why = f"the KV cache is {kv_dtype}, the weights {dtype}: the runner stores K/V in the weights' dtype"
        return 0, Choice(name, "off", why)
    why_not = NativeDecode.unsupported(model)
    if why_not is not None:
        return 0, Choice(name, "off", why_not)
    rows = NativeDecode.most_rows(model, bounds[1])
    span = "1 row" if rows == 1 else f"1-{rows} rows"
    head_not = NativeDecode.head_unsupported(model, rows)
    head = "and its LM head " if head_not is None else ""
    why = (f"decode-only steps of {span} (those its projections run Tandem's kernels for) through the whole "
           f"decoder {head}as one C++ call; the compiled graph for the rest")  # fmt: skip
    if head_not is not None:
        why += f"; the LM head after it ({head_not})"
    return rows, Choice(name, span, why)


def with_draft(target: Choice, draft: Choice) -> Choice:
    """The `decode_runner` choice of an engine with a draft model: the target's, the draft's in the reason."""
    return Choice(target.lever, target.value, f"{target.reason}; the draft model: {draft.value} ({draft.reason})")


def decode_runner_dropped() -> Choice:
    """The `decode_runner` choice once an 'auto' compile failed (every step then runs eagerly)."""
    return Choice("decode_runner", "off", "the compile failed: every step runs eagerly")


def compile_failed(exc: BaseException) -> Choice:
    """The `compile` choice once an 'auto' compile failed at warm-up (the step then runs eagerly)."""
    return Choice("compile", "off", f"--compile auto: compiling failed ({type(exc).__name__}: {exc}); eager")
