"""A compiled forward of the one decoder, for serving: torch.compile around the attention calls.

Contract:
- `CompiledDecoder(model)` wraps a `ServingDecoder` (`shared_model.serving_model`, quantized or not) and offers
  `hidden_states(input_ids, positions, backend)` with the decoder's own contract. The decoder's code is not changed
  or copied: `torch.compile` (inductor) traces `ServingDecoder.hidden_states` itself, and
  fuses what lies between the projections (norms, RoPE, SiLU·mul, residual adds) into a few generated kernels.
- Attention, two ways, chosen by the backend the caller passes for the call:
  - A traced backend (`traced = True` on its class, e.g. `inference_svc.attention.native_cpu.GraphDecode`) holds
    everything its layers need as tensors (the KV cache, the step's metadata) and its `__call__` is one call of a
    tensor-only operator (`tandem::paged_attention`, whose schema declares the cache mutated): dynamo traces it,
    so the cache and metadata are graph inputs, read at each call, and the operator runs from inside the graph
    with no Python (on the CPU, under a C++ wrapper). Its `mark_dynamic()` marks the metadata's sizes unbacked
    while the graphs compile: they reach only the operator, so one graph serves every batch size, context length
    and block-table width.
  - Any other `AttentionBackend` stays eager and opaque: each `backend(layer, q, k, v, scale)` call is the custom
    op `tandem::attention(backend, layer, q, k, v, scale)`, whose first argument is the backend itself, wrapped as
    an opaque reference object (`GraphBackend`, torch 2.13's opaque objects): dynamo passes it into the graph as
    an input (no guard on it: see Guards), and the op's Python implementation calls it. So any backend works unchanged
    (its plans, host-side logic and cache writes are never traced), with no registry: the op finds nothing, it is
    given the backend. These graphs run under inductor's Python wrapper (its C++ wrapper cannot pass a Python
    object to an operator). The op declares no mutated arguments although a paged backend writes its cache:
    those writes go to tensors that are not graph inputs and that the graph never reads, and the layers' calls stay
    in order because each layer's output is the next one's input. It returns a contiguous tensor of q's shape and
    dtype (what the decoder expects of a backend).
  The engine passes a traced backend for decode-only steps where the C++ kernels read its cache
  (`inference_svc.engine.model_runner`), and its per-step Python backend otherwise. Why the split: the Python
  backends plan on the host (block tables and lengths read into lists, a branch per chunk), which a graph cannot
  trace, and they serve every ops and cache kind; a decode-only step needs no plan, and is the step whose
  per-layer Python cost matters.
- Shapes: the token axis is dynamic. Where no projection branches on T (`one_traced_graph`: every
  `row_bounds()` empty, as a dense model's, whose row table is chosen inside one `tandem::table_gemm` call), the
  traced graph is compiled with T unbacked, so one graph serves every T >= 1, a lone decode included (a backed size
  1 would specialise: a graph of its own, a third of a cold start); the opaque graph serves T >= 2. A quantized
  model branches on T at its `row_bounds()` (an int4 projection takes its row kernel up to `int4_gemv.MAX_ROWS`
  rows, so T in 2..16 and T >= 17 are two graphs; in bf16 with AMX tiles it branches at 8 and at
  `serving_model.TILE_MAX_ROWS`), which an unbacked size cannot decide: its graphs are one per branch of T >= 2
  and one for T == 1 (torch specialises size 1).
  `warm_up(run, packages)` calls `run` (which must reach
  every kind of step), returns the seconds it took, and records them in `compile_seconds`. After warm-up the compiled
  code never compiles again: a call whose shapes or guards no graph covers is refused by dynamo at its guard check (the
  'fail_on_recompile' stance), before anything ran, and runs the same decoder eagerly instead; `eager_calls` counts
  those calls and the first is logged. So serving never stalls on a compile.
- Threads: by default inductor writes each CPU kernel's thread count into its code (`#pragma omp parallel
  num_threads(N)`, N the count at compile time, unless N is every CPU of the machine) and dynamo guards the count
  (its global-state guard): a call on another count would run the old count's threads or miss every graph.
  `CompiledDecoder(model, dynamic_threads=True)` (the engine's, when its thread governor runs:
  `inference_svc.executor.governor`) compiles kernels that read OpenMP's count at each call and drops the
  global-state guard. Where the count at compile time is every CPU of the machine, inductor's own kernels already
  do (`#pragma omp parallel` with no count, and a kernel whose work is too small stays serial); elsewhere it
  compiles with inductor's `cpp.dynamic_threads`, which also opens a parallel region in every kernel however small
  (a few percent of a 2 ms int4 step: docs/benchmarks.md §30). Either way it checks torch's global state itself at
  each call, the thread count aside
  (`_GlobalState`: the first call's state, a step's under `torch.inference_mode()`); a call in another state runs
  eagerly, counted in `eager_calls`. Tandem's C++ kernels (`at::parallel_for`) and oneDNN's read the count at each
  call anyway. The compile cache keys the graphs by the option (`inference_svc.executor.compile_cache`).
- Wrapper: no size, stride or alignment asserts (`_OPTIONS`), and on the CPU a C++ wrapper around the generated
  kernels of the traced backends' graphs (`_CPU_OPTIONS`): each kernel and operator call of the graph no longer
  pays for Python (docs/benchmarks.md has the measurements).
- Numerics: the fused kernels may round differently from eager (the same maths in another order), so the compiled
  forward is not bit-equal to the eager one: it is checked against it by greedy-token equality and a logit
  tolerance (tests/inference_svc/engine/test_compiled_engine.py). Inductor's `emulate_precision_casts` is on: a
  fused kernel rounds each op's result to its dtype (bf16) as eager would, instead of keeping it in fp32 up to the
  kernel's end. Without it the T == 1 and T >= 2 graphs, fused differently, round a bf16 row differently (a verify row's
  logits then differ from its decode row's; docs/benchmarks.md). Inference only: run it under
  `torch.inference_mode()`, with inputs made there too (dynamo's guards check the tensors' dispatch keys).
- An fp32 or bf16 model's projections run Tandem's row kernels inside the graph by the row table the caller chose
  (`CompiledDecoder(model, row_table=...)`, `serving_model.compiled_row_table`, set by
  `serving_model.set_row_kernels`; the module's own eager forward then uses it too, until `release_row_kernels()`):
  another summation order, covered by the same checks, and the same bits for a row at any row count a kernel
  serves.
- `compiler_available()` says whether inductor can build kernels here (on CPU it needs a C++ compiler).
- Guards: dynamo checks before each call that its graph still applies. Here the guards on module state (every
  parameter and attribute of the model's modules) are dropped: checking them cost a sizeable part of a small
  model's step (docs/benchmarks.md). A served model's modules do not change after it was prepared, merged and
  quantized: the one attribute the graph reads that may change, `ServingLinear.row_table`, is set once here and
  only reset when the compiled forward is dropped (a failed compile, `release_row_kernels`), after which no graph
  runs. Of the other guards only the portable ones are kept (`_guard_filter`: the inputs' tensor guards, those of
  a traced backend's tensors included, the symbolic shapes, torch's global state such as grad mode and the thread
  count): not the identity of the modules and functions the code calls (Tandem's source is fixed for a process,
  and the compile cache's key holds its hash), nor the backend's type, which is checked here instead: the opaque
  graphs only ever receive this module's `_OpaqueCall`, and a traced backend of a class other than the one the
  graphs were compiled for runs eagerly (counted in `eager_calls`). Nothing in the guards tells two decoders of
  one architecture apart (a target and a same-shaped draft model), so each `CompiledDecoder` compiles its own
  copy of the forward's code object (`_own_forward`): dynamo keeps graphs per code object, and a decoder's calls
  only ever meet its own graphs (its own row table, quantization and weights).
- Saved graphs (`warm_up(run, packages)`, `packages` a folder the compile cache keys by model, flags, torch, CPU
  and Tandem's code: `inference_svc.executor.compile_cache`): without saved graphs there, the warm-up traces and
  compiles, recording each kind's graphs (dynamo's transformed code, their guards, and inductor's compiled
  graphs through AOTAutograd's bundled entries) in a torch `CompilePackage` per kind, saved there as
  `<kind>/entry` after the warm-up. With them, each kind's package is installed on a fresh code object before the
  warm-up (dynamo's frame evaluation finds the graphs by their guards, as it finds graphs it traced: no tracing,
  no AOTAutograd, no C++ compiler) and the warm-up must run entirely from them ('fail_on_recompile'). A package
  that cannot be read or installed (another torch, changed source: torch checks the inlined functions' source
  hashes), or a warm-up step that no saved graph covers, is logged and dropped: the graphs are traced as without
  them and saved in their place, never an error. `precompiled` says which happened. The same bits either way: a
  loaded graph is the saved one. Marks of dynamic sizes (`maybe_mark_dynamic`) are put on inputs only while
  tracing: a graph traced with them takes inputs without them, and a loaded graph's guards want none (a package
  keeps the inputs' metadata, not their marks). A traced function's globals are a namespace of its own; a
  loading one's are this module's (where torch installs a package's names): so a trace after a load, in one
  process, never meets a name the package installed.
- One decoder at a time per process runs calls through its graphs: the 'fail_on_recompile' stance is dynamo's
  process-wide state, so a second decoder compiling while another is inside a call would be refused as a
  recompile. The engine is single-threaded, and a server holds one engine.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch._dynamo.package import CompilePackage, DiskDynamoStore
from torch._library.opaque_object import get_opaque_type_name, register_opaque_type
from torch._opaque_base import OpaqueBase

from shared_model.attention import AttentionBackend
from shared_model.serving_model import RowTable, ServingDecoder, set_row_kernels


def _guard_filter(entries: list) -> list[bool]:
    """The guards kept (see the module docstring): none on module state, and of the rest only the portable ones
    (the inputs' tensor guards, symbolic shapes, torch's global state), the guards a saved package can hold."""
    modules = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    portable = torch.compiler.keep_portable_guards_unsafe(entries)
    return [a and b for a, b in zip(modules, portable, strict=True)]


def _guard_filter_dynamic_threads(entries: list) -> list[bool]:
    """`_guard_filter` less torch's global-state guard, which holds the intra-op thread count: graphs compiled with
    dynamic threads serve any count, and `CompiledDecoder` checks the rest of that state itself (`_GlobalState`)."""
    return [keep and g.guard_type != "GLOBAL_STATE" for keep, g in zip(_guard_filter(entries), entries, strict=True)]


_OPTIONS = {
    "guard_filter_fn": _guard_filter,
    "emulate_precision_casts": True,
    "size_asserts": False,
    "alignment_asserts": False,
}
"""No guards on module attributes, each op's result rounded to its dtype as eager rounds it, whatever the fusion
(see the module docstring), and no size, stride or alignment asserts in the generated wrapper. Those asserts
re-check, at every call, the graph's inputs (the activations, which dynamo's guards have just checked, and the
parameters, which no guard checks: a served model's are never replaced after warm-up, the invariant the dropped
module guards rely on too) and the outputs of the operators: `tandem::attention` (whose implementation refuses a
result of another shape and returns it contiguous in q's dtype, as its fake kernel promises), `tandem::paged_attention`
(the same, from C++) and Tandem's packed GEMV operators (fresh contiguous results). Their cost:
docs/benchmarks.md."""
_CPU_OPTIONS = {"cpp_wrapper": True}
"""On the CPU, a C++ wrapper around a traced backend's graphs instead of a Python one: each kernel and operator call
of the graph no longer pays for Python, for a longer cold compile (docs/benchmarks.md). Not for the opaque
backends' graphs (it cannot pass a Python object to an operator), and not on CUDA (not measured there)."""
_DYNAMIC_THREADS_OPTIONS = {"cpp.dynamic_threads": True}
"""Inductor's CPU kernels read OpenMP's thread count at each call (`#pragma omp parallel` without a
`num_threads(N)` fixed at compile time, per-thread reduction buffers sized at run time), so the thread governor's
count (`inference_svc.executor.governor`) reaches them. An inductor option of this compile only (its config is
patched while the graphs compile, and the FX graph cache keys by it), never the process-wide environment switch."""
_KINDS = ("opaque", "traced")
PACKAGE_FILE = "entry"
"""A kind's saved graphs: `<packages>/<kind>/entry` (torch's `DiskDynamoStore` layout)."""
_RECOMPILE = "Detected recompile"
"""The start of the RuntimeError dynamo raises under the 'fail_on_recompile' stance."""
log = logging.getLogger(__name__)


class GraphBackend(OpaqueBase):
    """An `AttentionBackend` as the graph's `tandem::attention` receives it: an opaque reference object (dynamo
    guards its type only and passes it into the graph as an input; the op's implementation calls `backend`)."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def __reduce__(self) -> tuple[type[GraphBackend], tuple[None]]:
        """How inductor's graph cache keys it: as any backend (a run-time input, never part of the graph), so a
        graph that saw one is cached across processes like every other."""
        return GraphBackend, (None,)


register_opaque_type(GraphBackend, typ="reference")
_LIBRARY = torch.library.Library("tandem", "FRAGMENT")  # the native library adds its own fragments
"""The `tandem::attention` operator, declared through `torch.library.Library` rather than `torch.library.custom_op`,
whose Python wrapper costs more per call (once per layer and step)."""
_LIBRARY.define(
    f"attention({get_opaque_type_name(GraphBackend)} backend, int layer_idx, Tensor q, Tensor k, Tensor v, "
    "float scale) -> Tensor"
)


def _attention(
    backend: GraphBackend, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    out = backend.backend(layer_idx, q, k, v, scale)  # [B, T, Hq, D]
    if out.shape != q.shape:
        raise RuntimeError(f"tandem::attention: the backend returned {tuple(out.shape)} for q {tuple(q.shape)}")
    return out.to(q.dtype).contiguous()  # what the fake promises the graph: q's shape, dtype and layout


_LIBRARY.impl("attention", _attention, "CompositeExplicitAutograd")  # any device: the backend handles it


@torch.library.register_fake("tandem::attention")
def _(backend: object, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    del backend, layer_idx, k, v, scale
    return q.new_empty(q.shape)


class _OpaqueCall:
    """What the graph of an opaque backend calls per layer: `tandem::attention` with the backend as its argument."""

    def __init__(self, backend: GraphBackend) -> None:
        self.backend = backend

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.ops.tandem.attention(self.backend, layer_idx, q, k, v, scale)


def _forward(
    model: ServingDecoder, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
) -> torch.Tensor:
    """The compiled function: the decoder's own `hidden_states` (each `CompiledDecoder` compiles a copy of this
    function's code, so that its graphs are its own: dynamo keeps graphs per code object, and the module guards that
    would tell two decoders apart are dropped)."""
    return model.hidden_states(input_ids, positions, backend)


def _own_forward(loading: bool = False) -> Callable[..., torch.Tensor]:
    """A function of `_forward`'s code in a code object of its own. The globals dynamo installs its compiled graphs
    in are the function's: a traced one gets a namespace of its own (nothing a saved package installed can clash
    with the names a trace picks), one that loads packages this module's (where torch's package installs them)."""
    scope = (
        _forward.__globals__
        if loading
        else {"__name__": __name__, "__builtins__": _forward.__globals__["__builtins__"]}
    )
    return types.FunctionType(_forward.__code__.replace(), scope, _forward.__name__)


def is_traced(backend: object) -> bool:
    """Whether `backend` is one the graph traces (tensor-only operators: the module docstring)."""
    return getattr(type(backend), "traced", False) is True


def compiler_available(device: torch.device) -> tuple[bool, str]:
    """Whether inductor can generate kernels for `device` here, and if not, why (a sentence)."""
    if device.type == "cpu":  # the compilers inductor itself tries (`torch._inductor.config.cpp.cxx`: $CXX or g++)
        from torch._inductor import config as inductor_config

        cxx = inductor_config.cpp.cxx
        names = [c for c in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if c]
        found = next((path for path in map(shutil.which, names) if path), None)
        if found is None:
            return False, f"no C++ compiler on PATH ({', '.join(names)}; inductor's CPU backend needs one: g++)"
        return True, f"inductor's C++ backend ({found})"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False, "triton is not installed (inductor's CUDA backend needs it)"
        return True, "inductor's Triton backend"
    return False, f"no compiled path for device type {device.type!r}"


class CompiledDecoder:
    """`ServingDecoder.hidden_states` compiled by inductor, attention by the caller's backend (module doc)."""

    def __init__(self, model: ServingDecoder, row_table: RowTable | None = None, dynamic_threads: bool = False) -> None:
        """`row_table`: the projections' kernels by row count (`serving_model.compiled_row_table`); None keeps
        `F.linear` (the caller's choice of kernels). `dynamic_threads`: the graphs run on the intra-op thread count
        of each call (module docstring, Threads); False: on the count they were compiled at."""
        self.model = model
        self.row_table = row_table
        self.dynamic_threads = dynamic_threads
        self._state: _GlobalState | None = None
        """Torch's global state of the first call (the warm-up's, which the graphs were compiled or loaded in), the
        thread count aside (dynamic threads only)."""
        self.row_kernels = set_row_kernels(model, row_table)
        """Projections that run Tandem's row kernels by `row_table` (`serving_model.set_row_kernels`)."""
        self.one_traced_graph = not any(m.row_bounds() for m in model.modules() if hasattr(m, "row_bounds"))
        """Whether one traced graph serves every T >= 1: no projection branches on T (module docstring, Shapes)."""
        # room for the graphs of each kind of backend and each branch of T (every decoder has its own code objects)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._cpu = next(model.parameters()).device.type == "cpu"
        self._functions = {kind: _own_forward() for kind in _KINDS}
        """Each kind's function, in a code object of its own (dynamo's graphs and a package's are kept on it)."""
        self._packages: dict[str, CompilePackage] = {}
        self._compiled = {kind: self._compile(kind, None) for kind in _KINDS}
        """'opaque': for opaque backends (through `tandem::attention`); 'traced': for traced backends (their
        tensor-only operators in the graph)."""
        self._traced_type: type | None = None
        """The traced backend's class the graphs were compiled for (its guard is not kept: checked here)."""
        self._compiling = True
        """Whether a call may compile (marks its dynamic sizes): during a warm-up that traces."""
        self.precompiled = ""
        """What `warm_up` did with its packages: 'loaded N graphs', 'traced ...', or why not."""
        self.compile_seconds: float | None = None
        """Seconds `warm_up` took (None before it ran)."""
        self.eager_calls = 0
        """Calls after warm-up that no compiled graph covered, run eagerly instead (the first one is logged)."""

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """As `ServingDecoder.hidden_states` ([B, T] ids and positions -> [B, T, hidden]), through the graph."""
        # fresh storage for views (a decode step's rows of one host copy): guards would pin their storage offsets
        input_ids = input_ids.clone() if input_ids.storage_offset() else input_ids
        positions = positions.clone() if positions.storage_offset() else positions
        if self._compiling and input_ids.dim() == 2:  # marks only while compiling: a graph compiled with them
            # takes calls without them, and a loaded one wants none
            if self.one_traced_graph and is_traced(backend):  # one graph for every T: its size unbacked (a backed
                # size 1 would specialise, a graph of its own)
                torch._dynamo.decorators.mark_unbacked(input_ids, 1)
                torch._dynamo.decorators.mark_unbacked(positions, positions.dim() - 1)
            elif input_ids.shape[1] > 1:  # one graph per branch of T >= 2 (a table step of one row count, such
                # as 2, specializes to it: maybe_mark_dynamic allows that)
                torch._dynamo.maybe_mark_dynamic(input_ids, 1)
                torch._dynamo.maybe_mark_dynamic(positions, positions.dim() - 1)
        if self.dynamic_threads and self._state is None:
            self._state = _GlobalState()
        if is_traced(backend):
            compiled, graph_backend = self._compiled["traced"], backend
            if self._traced_type is None:
                self._traced_type = type(backend)
            if self._compiling:  # the metadata's sizes reach only the operator
                backend.mark_dynamic()  # type: ignore[attr-defined]
        else:
            compiled, graph_backend = self._compiled["opaque"], _OpaqueCall(GraphBackend(backend))
        if self.compile_seconds is None and self._compiling:
            return compiled(self.model, input_ids, positions, graph_backend)
        if graph_backend is backend and type(backend) is not self._traced_type:
            reason = f"a traced backend of another class ({type(backend).__name__})"
        elif self._state is not None and (changed := self._state.changed()):
            reason = f"torch's global state changed ({changed})"
        else:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return compiled(self.model, input_ids, positions, graph_backend)
            except RuntimeError as exc:  # raised at the guard check, before the graph ran: nothing happened yet
                if _RECOMPILE not in str(exc) or self.compile_seconds is None:  # a loaded warm-up's miss: raised
                    raise
                reason = _reason(exc)
        self.eager_calls += 1
        if self.eager_calls == 1:
            log.warning("compiled decoder: no graph covers this step (%s); such steps run eagerly", reason)
        return self.model.hidden_states(input_ids, positions, backend)

    def release_row_kernels(self) -> None:
        """Give the model back its eager projections (`F.linear`): when this compiled forward is dropped."""
        set_row_kernels(self.model, None)
        self.row_table, self.row_kernels = None, 0

    def _compile(self, kind: str, package: CompilePackage | None) -> Callable[..., torch.Tensor]:
        """`torch.compile(fullgraph=True)` of `kind`'s function, its graphs recorded in `package` when given."""
        options = dict(_OPTIONS)
        if kind == "traced" and self._cpu:
            options.update(_CPU_OPTIONS)
        if self.dynamic_threads:
            options["guard_filter_fn"] = _guard_filter_dynamic_threads
            if torch.get_num_threads() != os.cpu_count():  # else inductor leaves the count to OpenMP anyway
                options.update(_DYNAMIC_THREADS_OPTIONS)
        guards = options.pop("guard_filter_fn")
        backend = torch._TorchCompileInductorWrapper(None, options, None)  # what torch.compile builds
        return torch._dynamo.optimize(backend=backend, nopython=True, dynamic=None, guard_filter_fn=guards,
                                      package=package)(self._functions[kind])  # fmt: skip

    def warm_up(self, run: Callable[[], object], packages: Path | None = None) -> float:
        """Compile by calling `run` (steps of each kind through `hidden_states`); returns and records its seconds.

        `packages`: a folder for this decoder's saved graphs (`<kind>/PACKAGE_FILE`; the module docstring). When it
        holds them they are installed and `run` must find every step covered by them (no tracing: a warm start);
        when it does not, or loading or a step fails, the graphs are traced and compiled and saved there."""
        start = time.perf_counter()
        if packages is not None and self._load(packages):
            try:
                self._compiling = False
                run()
            except RuntimeError as exc:
                if _RECOMPILE not in str(exc):
                    raise
                self.precompiled = f"not used: a warm-up step no saved graph covers ({_reason(exc)})"
                log.warning("compiled decoder: saved graphs %s; tracing", self.precompiled)
                self._unload()
        if self._compiling or not self._packages:
            self._compiling = True
            if packages is not None:
                self._functions = {kind: _own_forward() for kind in _KINDS}
                self._packages = {kind: CompilePackage(fn) for kind, fn in self._functions.items()}
                self._compiled = {kind: self._compile(kind, self._packages[kind]) for kind in _KINDS}
            with torch._functorch.config.patch(bundled_autograd_cache=True):  # the packages' graphs, recorded
                run()
            if packages is not None:
                self._save(packages)
        self._compiling = False
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds

    def _load(self, folder: Path) -> bool:
        """Install the saved graphs of each kind from `folder` (both or neither); whether they were."""
        if not all((folder / kind / PACKAGE_FILE).is_file() for kind in _KINDS):
            self.precompiled = ""  # none saved: a first compile
            return False
        store = DiskDynamoStore(str(folder))
        try:
            with torch.inference_mode():  # the guards' dispatch keys are those of inference tensors
                for kind in _KINDS:
                    self._functions[kind] = _own_forward(loading=True)
                    entry = store.load_cache_entry(kind)
                    package = CompilePackage(self._functions[kind], entry.dynamo)
                    self._packages[kind] = package
                    package.install(entry.backends)
                    self._compiled[kind] = self._compile(kind, package)
        except Exception as exc:  # a package of another torch, source or shape: traced instead, never fatal
            self.precompiled = f"not loaded ({type(exc).__name__}: {exc})"
            log.warning("compiled decoder: saved graphs %s; tracing", self.precompiled)
            self._unload()
            return False
        graphs = sum(len(code.guarded_codes) for p in self._packages.values() for code in p.cache_entry().codes)
        self.precompiled = f"loaded {graphs} graphs"
        return True

    def _unload(self) -> None:
        """Drop the installed packages: their functions are replaced by fresh ones (new code objects, which no
        package's entries reach) before anything traces; the names they installed in this module stay, unused
        (unique per compiled graph; `_own_forward` keeps traced functions' names apart)."""
        self._packages = {}
        self._functions = {kind: _own_forward() for kind in _KINDS}
        self._compiled = {kind: self._compile(kind, None) for kind in _KINDS}
        self._compiling = True

    def _save(self, folder: Path) -> None:
        store = DiskDynamoStore(str(folder))
        try:
            for kind, package in self._packages.items():
                store.save_package(package, kind)
        except Exception as exc:  # the compiled step still serves; the next start traces again
            done = f"traced; not saved ({type(exc).__name__}: {exc})"
            log.warning("compiled decoder: graphs %s", done)
        else:
            graphs = sum(len(code.guarded_codes) for p in self._packages.values() for code in p.cache_entry().codes)
            done = f"traced {graphs} graphs and saved them"
        self.precompiled = f"{self.precompiled}; {done}" if self.precompiled else done


class _GlobalState:
    """Torch's global state (grad mode, autocast, default dtype, deterministic algorithms, ...) as dynamo's
    global-state guard checks it, less the intra-op thread count: the check `_guard_filter_dynamic_threads` leaves
    out of the graphs' guards. One reference per thread count seen, each made when the state differs from the
    first one in the count alone; a check costs a dictionary lookup and dynamo's own comparison."""

    def __init__(self) -> None:
        self._guards = {torch.get_num_threads(): torch._C._dynamo.guards.GlobalStateGuard()}
        self._first = next(iter(self._guards.values()))

    def changed(self) -> str:
        """'' when the state is the reference's but for the thread count; else what changed (dynamo's names)."""
        guard = self._guards.get(torch.get_num_threads())
        if guard is not None:
            return "" if guard.check() else guard.reason().strip()
        differ = self._first.reason().split()
        if differ != ["num_threads"]:
            return " ".join(n for n in differ if n != "num_threads")
        self._guards[torch.get_num_threads()] = torch._C._dynamo.guards.GlobalStateGuard()
        return ""


def _reason(exc: BaseException) -> str:
    """The guard failures dynamo lists in its recompile error (else its first line)."""
    lines = [line.strip() for line in str(exc).splitlines()]
    failures = [line.removeprefix("- ") for line in lines if line.startswith("- ")]
    return "; ".join(failures) if failures else (lines[0] if lines else type(exc).__name__)
