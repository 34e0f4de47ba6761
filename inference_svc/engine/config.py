"""Engine settings: one frozen, validated dataclass.

Contract:
- `EngineConfig` is immutable; every field is checked at construction and an invalid value raises
  `EngineConfigError` whose message (and `field` attribute) names the field.
- `kv_cache_memory` accepts bytes as an int or a string with a unit ("2GiB", "512MiB", "1.5GB", "4096").
  `parse_bytes` is the one parser of that syntax.
- The config holds no derived state: the engine resolves "auto" values (device, dtype, backend, budgets) when it
  builds itself, and reports what it chose in `Engine.info()`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from inference_svc.engine.types import MAX_SPECULATIVE_TOKENS
from inference_svc.errors import InferenceError
from shared_model.ledger import DEFAULT_GROUP_SIZE, INT4_GROUP_SIZES, QUANTIZATIONS

ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8", "int8")
"""`kv_cache_dtype` values (`inference_svc.engine.kv_cache` maps them to torch dtypes)."""
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
DEFAULT_CPU_KV_BYTES = 256 * 1024**2
SPECULATIVE_METHODS = ("off", "ngram")
COMPILE_MODES = ("auto", "on", "off")
CPU_KERNEL_MODES = ("auto", "off")
INT4_KERNELS = ("auto", "torch")
OMP_WAIT_POLICIES = ("auto", "passive", "bounded", "active")
"""`omp_wait` values (`inference_svc.executor.threads` applies them)."""
THREAD_GOVERNOR_MODES = ("auto", "off")
"""`thread_governor` values (`inference_svc.executor.governor`)."""
DECODE_RUNNER_MODES = ("auto", "off")
"""`decode_runner` values (`inference_svc.executor.prepare.choose_decode_runner`)."""
DEFAULT_COMPILE_CACHE = "~/.cache/tandem/compile"

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


class EngineConfigError(InferenceError, ValueError):
    """An EngineConfig field has an invalid value; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def parse_bytes(value: int | str, field: str = "kv_cache_memory") -> int:
    """'2GiB' → 2147483648, '1.5GB' → 1500000000, 4096 → 4096. Must be > 0."""
    if isinstance(value, bool):
        raise EngineConfigError(field, f"expected bytes or a size like '2GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise EngineConfigError(field, f"expected bytes or a size like '2GiB' or '512MiB', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise EngineConfigError(field, f"expected bytes or a size like '2GiB', got {type(value).__name__}")
    if n <= 0:
        raise EngineConfigError(field, f"must be > 0 bytes, got {value!r}")
    return n


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise EngineConfigError(name, f"must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches, caches and runs. Defaults suit a CPU demo; every field has a CLI flag."""

    block_size: int = 16
    """Tokens per KV-cache block (the paging unit, and the prefix-cache granularity)."""
    kv_cache_memory: int | str | None = None
    """KV-cache budget: bytes or a size string ('2GiB'). None: 256MiB on CPU, gpu_memory_fraction of free on GPU."""
    gpu_memory_fraction: float = 0.85
    """On GPU with kv_cache_memory=None: fraction of free memory (after weights) given to the KV cache."""
    max_num_seqs: int = 64
    """Most sequences running (holding KV blocks) at once."""
    max_num_batched_tokens: int | str = "auto"
    """Most tokens (decode tokens + prefill chunk tokens) computed in one engine step: a number, or 'auto' (on a CPU
    prefill_chunk_size + max_num_seqs, one whole chunk beside every running decode, so a burst of prompts gets its
    first tokens over short steps; 2048 on a GPU: `inference_svc.executor.step_budget`)."""
    prefill_group_tokens: int | str = "auto"
    """Most prefill tokens of one step, prompts of the running sequences' chunks and new admissions summed: once a
    step holds this many, no further waiting prompt joins it (the step's first chunk always does, up to
    prefill_chunk_size). A number, or 'auto' (on a CPU 128 tokens or the step budget if smaller, so a burst of short
    prompts gets its first tokens over two or more steps instead of all at the end of one; 256 where the quantized
    products of 128 rows dequantize their weights at each step; on a GPU the step budget, no limit:
    `inference_svc.executor.step_budget`)."""
    enable_chunked_prefill: bool = True
    """Split long prompts into chunks of at most prefill_chunk_size tokens, interleaved with decodes."""
    prefill_chunk_size: int = 512
    """Largest prefill chunk of one sequence in one step (when chunked prefill is on)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of earlier requests that share a prompt prefix (hash chains, LRU eviction)."""
    attention_backend: str = "auto"
    """'torch', 'triton' or 'auto' (triton on CUDA when available, torch otherwise)."""
    dtype: str = "auto"
    """Weights (compute) dtype: 'auto' (the bundle's own), 'float32'/'fp32', 'bfloat16'/'bf16', 'float16'/'fp16'."""
    kv_cache_dtype: str = "auto"
    """K/V cache storage: 'auto' (the compute dtype), 'fp32', 'bf16', 'fp16', or 'fp8' (e4m3) / 'int8' with an fp32
    scale per (block, kv head); attention reads other dtypes in fp32. fp8/int8 hold about 2x bf16's tokens."""
    device: str = "auto"
    """'auto' (cuda when available, else cpu), 'cpu', 'cuda' or 'cuda:N'."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); None: the model's max_position_embeddings, capped by the KV pool."""
    max_new_tokens_limit: int = 4096
    """Ceiling on a request's max_new_tokens; requests asking more are refused."""
    verify_checksums: bool = False
    """Check every bundle file against its tandem_bundle.json (size, SHA-256) before loading; refuse a mismatch."""
    quantization: str = "none"
    """Weight-only quantization at load: 'none', 'int8' (per output channel) or 'int4' (groups of
    quantization_group_size inputs); the LM head is int8 under both (`shared_model.quantize`)."""
    quantization_group_size: int = DEFAULT_GROUP_SIZE
    """Inputs per int4 scale and zero: 32, 64, 128 or 256."""
    compile: str = "auto"
    """Compiled decode step (torch.compile, inductor) around the eager paged attention: 'on', 'off' or 'auto'
    (compiled for a CPU model of at least 2M parameters when a C++ compiler is present: a rule, never a timing).
    Compiled before health says SERVING; never recompiled while serving."""
    triton_autotune: bool = True
    """The Triton attention kernels time their tile configs on the first launch of each shape (CUDA only); off:
    one heuristic config (reproducible, nothing timed at start)."""
    cpu_kernels: str = "auto"
    """Tandem's C++ CPU kernels (row GEMM, int8/int4 GEMV, decode attention, sampling): 'auto' (where the CPU has
    AVX-512 BW/VL/VNNI and a C++ compiler is present) or 'off' (torch's kernels everywhere)."""
    decode_runner: str = "auto"
    """A compiled engine's decode-only steps (a token per sequence, or verify items, up to the rows its projections
    run Tandem's kernels for: `tandem::row_gemm`, then AMX `tandem::tile_gemm`, or a quantized row kernel) through
    the whole decoder as one C++ call (`shared_model.native_decode`) instead of the compiled graph: 'auto' (where it
    serves the model: fp32 or bf16 with Tandem's kernels, every projection dense or quantized with a row kernel, a
    KV cache in the weights' dtype) or 'off' (the graph for every step)."""
    int4_kernel: str = "auto"
    """int4 layers' kernel: 'auto' (Tandem's int4 GEMV and its layout where the CPU kernels run, activations rounded
    to int8 per group as llama.cpp's Q4_0) or 'torch' (torch's packed int4 kernel and layout)."""
    threads: int | str = "auto"
    """CPU threads for the model's ops (torch intra-op threads): 'auto' (the CPUs this process may use, capped by
    its cgroup CPU quota: `inference_svc.executor.threads`) or a number."""
    omp_wait: str = "auto"
    """How OpenMP's idle worker threads wait between parallel regions: 'passive' (sleep at once: leaves the CPU to
    others), 'bounded' (spin about ten microseconds, then sleep: for a machine shared with busy processes), 'active'
    (spin) or 'auto' (passive where a CPU quota or the thread count oversubscribes the CPUs, else the runtime's
    default: `inference_svc.executor.threads`). Takes effect when set before torch
    starts, as `tandem serve` does."""
    thread_governor: str = "auto"
    """Between steps, give intra-op threads up while other processes keep this process's CPUs busy and take them
    back when they leave (`threads` is the most): 'auto' (on for a CPU engine of more than one thread; the compiled
    step's kernels then follow the count at each call) or 'off' (`threads` at every step:
    `inference_svc.executor.governor`)."""
    compile_cache: str = DEFAULT_COMPILE_CACHE
    """Folder of compiled decode steps (torch's compile artifacts) keyed by model, graph flags, torch and CPU: a
    second start of the same model loads them instead of compiling; a bundle's own `compile_cache/` folder (written
    by `tandem warm`) is read first. 'off': neither read nor written."""
    compile_cache_max_mb: int = 2048
    """Most megabytes the `compile_cache` folder keeps (an entry is 8-30 MB): after a start, its least recently
    used entries go until it fits (never the one this start uses; a bundle's own folder is never pruned)."""
    speculative: str = "off"
    """Speculative decoding by default: 'off', 'ngram' (drafts by prompt lookup) or the folder of a small draft
    model sharing the target's tokenizer; drafts are verified in one batched forward, greedy output is unchanged
    and sampled output keeps its distribution. A request may turn it on or off with `num_speculative_tokens`."""
    num_speculative_tokens: int = 4
    """Most drafted tokens verified per step when speculating (1..16)."""
    speculative_ngram_min: int = 1
    """Shortest suffix of a sequence that prompt lookup matches against its earlier tokens."""
    speculative_ngram_max: int = 4
    """Longest suffix that prompt lookup tries first."""
    speculative_verify_cost: float = 0.1
    """Cost of one extra verified row relative to a whole decode step: the back-off's cost model speculates only
    while the expected tokens per step beat it (see `inference_svc.engine.speculative`)."""
    speculative_max_batch: int = 8
    """No drafts while the engine holds more requests than this, running or waiting (at most `max_num_seqs` count:
    a wide batch is compute-bound, and drafted rows would take budget from the prefill of those being admitted);
    0: no cap."""
    enable_lora: bool = False
    """Serve LoRA adapters (vLLM's flag): allocate `max_loras` adapter slots, so adapters can be loaded at run time
    (POST /v1/load_lora_adapter); on by itself when `lora_modules` names any. Steps then run eagerly."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters served from the start, each NAME=DIR or vLLM's JSON '{"name": NAME, "path": DIR}' (repeatable,
    vLLM's spelling): DIR is a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) for this base
    model; a request picks one by `model`."""
    max_loras: int = 1
    """Most LoRA adapters loaded at once (the adapter slots): requests for all of them share every step."""
    max_lora_rank: int = 16
    """Largest LoRA rank an adapter may have; a higher one is refused. Slots are sized by it."""

    def __post_init__(self) -> None:
        names = ["block_size", "max_num_seqs", "prefill_chunk_size"]
        for name in ("max_num_batched_tokens", "prefill_group_tokens"):
            value = getattr(self, name)
            if isinstance(value, str) and value.strip().isdigit():
                object.__setattr__(self, name, int(value))  # a flag's text
            if getattr(self, name) != "auto":
                names.append(name)
        for name in names:
            _positive_int(name, getattr(self, name))
        _positive_int("max_new_tokens_limit", self.max_new_tokens_limit)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        self._check_threads()
        if self.quantization not in QUANTIZATIONS:
            raise EngineConfigError("quantization", f"must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise EngineConfigError(
                "quantization_group_size", f"must be one of {INT4_GROUP_SIZES}, got {self.quantization_group_size!r}"
            )
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        self._check_speculative()
        if not isinstance(self.gpu_memory_fraction, (int, float)) or not 0 < self.gpu_memory_fraction <= 1:
            raise EngineConfigError("gpu_memory_fraction", f"must be in (0, 1], got {self.gpu_memory_fraction!r}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "verify_checksums", "triton_autotune"):
            if not isinstance(getattr(self, name), bool):
                raise EngineConfigError(name, f"must be a bool, got {getattr(self, name)!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise EngineConfigError(
                "attention_backend", f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.cpu_kernels not in CPU_KERNEL_MODES:
            raise EngineConfigError("cpu_kernels", f"must be one of {CPU_KERNEL_MODES}, got {self.cpu_kernels!r}")
        if self.decode_runner not in DECODE_RUNNER_MODES:
            raise EngineConfigError(
                "decode_runner", f"must be one of {DECODE_RUNNER_MODES}, got {self.decode_runner!r}"
            )
        if self.int4_kernel not in INT4_KERNELS:
            raise EngineConfigError("int4_kernel", f"must be one of {INT4_KERNELS}, got {self.int4_kernel!r}")
        if self.compile not in COMPILE_MODES:
            raise EngineConfigError("compile", f"must be one of {', '.join(COMPILE_MODES)}; got {self.compile!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(
                "kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}"
            )
        if self.dtype not in DTYPES:
            raise EngineConfigError("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise EngineConfigError("device", f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        self._check_lora()

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise EngineConfigError("enable_lora", f"must be a bool, got {self.enable_lora!r}")
        _positive_int("max_loras", self.max_loras)
        _positive_int("max_lora_rank", self.max_lora_rank)
        modules = self.lora_modules
        if isinstance(modules, list):
            object.__setattr__(self, "lora_modules", modules := tuple(modules))
        if not isinstance(modules, tuple):
            raise EngineConfigError("lora_modules", f"must be a list of NAME=DIR, got {modules!r}")
        names = [name for name, _ in self.lora_module_dirs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise EngineConfigError("lora_modules", f"the adapter name {dup[0]!r} is given twice")
        if len(names) > self.max_loras:
            raise EngineConfigError(
                "lora_modules", f"{len(names)} adapters are more than --max-loras {self.max_loras} slots hold"
            )
        if self.lora_enabled and self.compile == "on":
            raise EngineConfigError(
                "compile", "'on' cannot serve LoRA adapters (the compiled step takes no per-row adapter); use auto/off"
            )

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine holds adapter slots (`enable_lora`, or any `lora_modules`)."""
        return self.enable_lora or bool(self.lora_modules)

    @property
    def lora_module_dirs(self) -> list[tuple[str, str]]:
        """`lora_modules` as (name, folder) pairs; EngineConfigError naming `lora_modules` for a malformed one."""
        out = []
        for item in self.lora_modules:
            name, sep, folder = item.partition("=") if isinstance(item, str) else ("", "", "")
            if isinstance(item, str) and item.lstrip().startswith("{"):  # vLLM's JSON form
                try:
                    spec = json.loads(item)
                except json.JSONDecodeError:
                    spec = None
                ok = isinstance(spec, dict) and isinstance(spec.get("name"), str) and isinstance(spec.get("path"), str)
                name, sep, folder = (spec["name"], "=", spec["path"]) if ok else ("", "", "")  # type: ignore[index]
            if not sep or not name.strip() or not folder.strip() or name != name.strip():
                raise EngineConfigError(
                    "lora_modules", f'each must be NAME=DIR or {{"name": NAME, "path": DIR}}, got {item!r}'
                )
            out.append((name, folder))
        return out

    def _check_threads(self) -> None:
        if isinstance(self.threads, str) and self.threads.strip().isdigit():
            object.__setattr__(self, "threads", int(self.threads))  # a flag's text: the number it spells
        if self.threads != "auto" and (
            not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads <= 0
        ):
            raise EngineConfigError("threads", f"must be 'auto' or a positive integer, got {self.threads!r}")
        if self.omp_wait not in OMP_WAIT_POLICIES:
            raise EngineConfigError("omp_wait", f"must be one of {OMP_WAIT_POLICIES}, got {self.omp_wait!r}")
        if self.thread_governor not in THREAD_GOVERNOR_MODES:
            raise EngineConfigError(
                "thread_governor", f"must be one of {THREAD_GOVERNOR_MODES}, got {self.thread_governor!r}"
            )
        if not isinstance(self.compile_cache, str) or not self.compile_cache.strip():
            raise EngineConfigError("compile_cache", f"must be a folder or 'off', got {self.compile_cache!r}")
        if (
            not isinstance(self.compile_cache_max_mb, int) or isinstance(self.compile_cache_max_mb, bool)
            or self.compile_cache_max_mb < 1
        ):  # fmt: skip
            raise EngineConfigError(
                "compile_cache_max_mb", f"must be a positive number of megabytes, got {self.compile_cache_max_mb!r}"
            )

    def _check_speculative(self) -> None:
        if not isinstance(self.speculative, str) or (
            self.speculative not in SPECULATIVE_METHODS and not Path(self.speculative).is_dir()
        ):
            raise EngineConfigError(
                "speculative",
                f"must be 'off', 'ngram' or the folder of a draft model, got {self.speculative!r} (no such folder)",
            )
        for name in ("num_speculative_tokens", "speculative_ngram_min", "speculative_ngram_max"):
            _positive_int(name, getattr(self, name))
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise EngineConfigError(
                "num_speculative_tokens", f"must be at most {MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise EngineConfigError(
                "speculative_ngram_min",
                f"{self.speculative_ngram_min} is above speculative_ngram_max={self.speculative_ngram_max}",
            )
        cost = self.speculative_verify_cost
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < 1:
            raise EngineConfigError("speculative_verify_cost", f"must be a number in [0, 1), got {cost!r}")
        m = self.speculative_max_batch
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise EngineConfigError("speculative_max_batch", f"must be an integer >= 0 (0: no cap), got {m!r}")

    @property
    def draft_model_path(self) -> Path | None:
        """The draft model's folder, when `speculative` names one."""
        return None if self.speculative in SPECULATIVE_METHODS else Path(self.speculative)

    @property
    def kv_cache_bytes(self) -> int | None:
        """kv_cache_memory in bytes (None when unset)."""
        return None if self.kv_cache_memory is None else parse_bytes(self.kv_cache_memory)
