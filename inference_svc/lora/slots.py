"""The stacked adapter weights of a served model: `max_loras` slots, loaded and unloaded at run time, and the
per-row LoRA deltas of a step.

Contract:
- `LoraSlots(model, max_loras, max_rank, dtype, native)` wraps each decoder layer's four projections of the
  `ServingDecoder` (`qkv`, `o_proj`, `gate_up`, `down_proj`, quantized or not) in a `LoraProjection` and is the one
  owner of the adapter weights they hold: per projection, A stacked [max_loras, P·max_rank, in] and Bᵀ stacked
  [max_loras, P·max_rank, out] in the compute dtype, P the parts a merged projection joins (3 for q/k/v, 2 for
  gate/up). An adapter's parts are laid side by side in its slot: the rows of A for q, then k, then v, and Bᵀ
  block-diagonal (part p's rows write only part p's output columns), the scale folded into Bᵀ, so one pair of
  small matmuls serves a merged projection. Only the parts the adapter targets take rows (`widths`).
- `load(adapter)` writes a checked `LoraAdapter` into a free slot; `unload(name)` frees it. Both run on the engine
  thread between steps (the async engine's command path), so no step ever reads a half-written slot. A load
  beyond `max_loras` or of a name already loaded is an `AdapterError`; `lookup` of an unknown name is a
  `ModelNotFoundError`. Each load gets a new `cache_salt`, so blocks computed under one loading of an adapter are
  never reused under another adapter, the base, or a reload of the same name.
- `with slots.rows(row_slots)` sets a step's rows' slots (-1: the base model) for the forward inside it; a
  `LoraProjection` then returns the base projection's output unchanged, the same tensor and bits, for every base
  row, and adds scale·(x·Aᵀ)·Bᵀ to the rows of each adapter, in place: one base matmul for the whole step, plus
  the adapters' small products. Outside `rows` (embeddings, warm-up) no delta is added. Two ways, chosen
  once at load (`LoraSlots(..., native=)`, the load plan's `lora` choice and each projection's `method()` name it):
  - fused (CPU, Tandem's native library loaded, a dtype of `FUSED_DTYPES`): `rows` turns the slots into one int32
    [T] tensor per step (`FusedRows`), and each projection makes one call, `tandem_native`'s `lora_delta_`
    (tandem_native/csrc/lora.cpp: per row h = A[s]·x, then y += h·Bᵀ[s], in fp32, rounded once). A row's delta
    depends on its own input and adapter only, bit for bit, whatever else the step holds;
  - torch (any other device, or no native library): the adapter rows are grouped by slot once per step
    (`StepRows`): when they already form one run in slot order (one stream, or one adapter's rows side by side)
    each group's product is added in place into its slice of the output; one adapter's rows apart are gathered,
    multiplied and added back (`index_add_`); several adapters' rows apart are gathered in groups padded to one
    size (`Batched`: a padding row repeats its group's first row and its product is zeroed), so two `torch.bmm`
    serve every adapter at once (torch's kernels may round a row differently with the batch's shape).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

import tandem_native
from inference_svc.errors import ModelNotFoundError
from inference_svc.lora.adapter import AdapterError, LoraAdapter, projection_shapes
from shared_model.serving_model import ServingDecoder

MERGED = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
"""A `ServingLayer`'s projection → the Hugging Face projections it joins, in the order of its output."""


FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The compute dtypes the fused operator serves."""


@dataclass(frozen=True)
class FusedRows:
    """A step's rows for the fused operator (see the module docstring)."""

    slots: torch.Tensor
    """int32 [T]: each row's slot in the flat layout, -1 for a base row."""
    op: Callable[..., None]
    """`tandem_native`'s `lora_delta_` (y, x, a, bt, slots, widths)."""


@dataclass(frozen=True)
class StepRows:
    """A step's rows that have an adapter, grouped by slot, for the torch path (see the module docstring)."""

    span: slice
    """Without `gather`: the rows of the flat [T] layout the groups cover, one run, groups in order within it."""
    gather: torch.Tensor | None
    """int64 [n]: the adapter rows grouped by slot (None: they are `span` already)."""
    groups: tuple[tuple[int, slice], ...]
    """(slot, its positions among the n grouped rows)."""
    count: int
    """n, the rows with an adapter."""
    batched: Batched | None = None
    """Set when several adapters' rows are apart: the padded groups for one pair of `bmm`s."""


@dataclass(frozen=True)
class Batched:
    """G adapters' rows in groups padded to g rows each (see the module docstring)."""

    rows: torch.Tensor
    """int64 [G * g]: group i's rows, then its first row again for padding."""
    slots: tuple[int, ...]
    """The G slots, ascending."""
    slot_index: torch.Tensor | None
    """int64 [G]: `slots` to select the stacked weights by (None: they are 0..G-1, a view suffices)."""
    padding: torch.Tensor | None
    """bool [G, g, 1]: True at padding rows (None: every group has g rows)."""


@dataclass(frozen=True)
class LoadedAdapter:
    """An adapter held in a slot."""

    name: str
    path: str
    slot: int
    rank: int
    cache_salt: int
    """Prefix-cache namespace of the requests this loading serves (never 0, the base model's)."""


class LoraProjection(nn.Module):
    """A projection plus its stacked adapters (see the module docstring)."""

    def __init__(self, base: nn.Module, parts_out: Sequence[int], owner: LoraSlots, dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        device = next(itertools.chain(base.parameters(), base.buffers())).device  # a quantized base has buffers
        self.in_features, self.out_features = base.in_features, base.out_features
        self.parts_out = tuple(parts_out)
        width = len(parts_out) * owner.max_rank
        self.register_buffer(
            "lora_a", torch.zeros(owner.max_loras, width, self.in_features, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_bt", torch.zeros(owner.max_loras, width, self.out_features, dtype=dtype, device=device)
        )
        # lora_a: [S, P*R, in]; lora_bt: [S, P*R, out]
        self.widths = [0] * owner.max_loras
        """Rows of `lora_a` / `lora_bt` each slot uses (0: its adapter does not adapt this projection)."""
        self.register_buffer("slot_widths", torch.zeros(owner.max_loras, dtype=torch.int32, device=device))
        # slot_widths: int32 [S], `widths` as the fused operator reads it
        self._owner = owner
        self._base_forward = base.forward
        """The base projection's forward, called directly: a step calls each projection once per layer, and the
        wrapper's own module call already ran the hook machinery (the base carries no hooks of its own)."""

    def method(self) -> tuple[str, str]:
        """The base projection's method (the load plan's record), plus the adapters' delta."""
        base = self.base.method() if hasattr(self.base, "method") else ("F.linear", "F.linear")
        if self._owner.fused is not None:
            delta = "one fused call per projection, tandem::lora_delta_"
        else:
            delta = "torch: one small matmul pair, batched over the adapters present"
        return base[0], f"{base[1]}; plus each adapter row's LoRA delta ({delta})"

    def write(self, slot: int, pieces: Sequence[tuple[torch.Tensor, torch.Tensor] | None], scaling: float) -> None:
        """Fill `slot` from one (A [r, in], B [out_p, r]) per part (None: the part is not adapted)."""
        self.lora_a[slot].zero_()
        self.lora_bt[slot].zero_()
        row, col = 0, 0
        for out_p, piece in zip(self.parts_out, pieces, strict=True):
            if piece is not None:
                a, b = piece
                r = a.shape[0]
                self.lora_a[slot, row : row + r].copy_(a)
                self.lora_bt[slot, row : row + r, col : col + out_p].copy_(b.t() * scaling)
                row += r
            col += out_p
        self.widths[slot] = row
        self.slot_widths[slot] = row

    def clear(self, slot: int) -> None:
        self.widths[slot] = 0
        self.slot_widths[slot] = 0
        self.lora_a[slot].zero_()
        self.lora_bt[slot].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base_forward(x)  # [..., out]: the base projection, all rows at once
        step = self._owner.step
        if step is None:
            return y
        if not y.is_contiguous():
            y = y.contiguous()
        if type(step) is FusedRows:  # one call: y [.., out] += each adapter row's delta, in place
            held = self._buffers  # the buffers by name, without nn.Module.__getattr__'s lookups on every call
            step.op(y, x, held["lora_a"], held["lora_bt"], step.slots, held["slot_widths"])
            return y
        x2 = x.reshape(-1, self.in_features)  # [T, in]
        y2 = y.view(-1, self.out_features)  # [T, out], the same storage as y
        if step.batched is not None:
            return self._batched(step.batched, x2, y, y2)
        if step.gather is None:  # one run in slot order: add each group's product into its rows in place
            xs, ys = x2[step.span], y2[step.span]  # [n, in], [n, out] views
            for slot, pos in step.groups:
                w = self.widths[slot]
                if w:
                    ys[pos].addmm_(xs[pos] @ self.lora_a[slot, :w].t(), self.lora_bt[slot, :w])
            return y
        xs = x2.index_select(0, step.gather)  # [n, in], grouped by slot
        delta = torch.empty(step.count, self.out_features, dtype=y.dtype, device=y.device)  # [n, out]
        for slot, pos in step.groups:
            w = self.widths[slot]
            if w:
                torch.mm(xs[pos] @ self.lora_a[slot, :w].t(), self.lora_bt[slot, :w], out=delta[pos])
            else:
                delta[pos].zero_()
        y2.index_add_(0, step.gather, delta)
        return y

    def _batched(self, b: Batched, x2: torch.Tensor, y: torch.Tensor, y2: torch.Tensor) -> torch.Tensor:
        w = max(self.widths[s] for s in b.slots)
        if w == 0:
            return y
        groups = len(b.slots)
        a, bt = self.lora_a[:, :w], self.lora_bt[:, :w]  # [S, w, in], [S, w, out] views
        if b.slot_index is None:
            a, bt = a[:groups], bt[:groups]
        else:
            a, bt = a.index_select(0, b.slot_index), bt.index_select(0, b.slot_index)
        xs = x2.index_select(0, b.rows).view(groups, -1, self.in_features)  # [G, g, in]
        h = torch.bmm(xs, a.transpose(1, 2))  # [G, g, w]; a narrower adapter's extra rows of A are zero
        if b.padding is not None:
            h.masked_fill_(b.padding, 0.0)  # padding rows add exactly zero
        delta = torch.bmm(h, bt)  # [G, g, out]
        y2.index_add_(0, b.rows, delta.view(-1, self.out_features))
        return y


class LoraSlots:
    """The one owner of a served model's adapter slots (see the module docstring)."""

    def __init__(
        self, model: ServingDecoder, max_loras: int, max_rank: int, dtype: torch.dtype, native: bool = False
    ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.model = model
        self.step: FusedRows | StepRows | None = None
        """The current step's rows: `FusedRows` or `StepRows` (None: no delta anywhere)."""
        device = next(itertools.chain(model.parameters(), model.buffers())).device
        library = tandem_native.library() if native and device.type == "cpu" and dtype in FUSED_DTYPES else None
        self.fused: Callable[..., None] | None = None if library is None else library.lora_delta_
        """The fused operator (`native`: the load plan's choice to run Tandem's kernels), or None: the torch path."""
        self.loaded: dict[str, LoadedAdapter] = {}
        self._salts = itertools.count(1)
        self.projections: list[dict[str, LoraProjection]] = []
        """Per layer: `ServingLayer` attribute name → its wrapped projection."""
        c = model.config
        outs = {p: shape[0] for p, shape in projection_shapes(c).items()}
        for layer in model.layers:
            wrapped = {}
            for attr, parts in MERGED.items():
                base = getattr(layer, attr)
                if isinstance(base, LoraProjection):
                    raise ValueError("the model's projections already carry LoRA slots")
                wrapped[attr] = LoraProjection(base, [outs[p] for p in parts], self, dtype)
                setattr(layer, attr, wrapped[attr])
            self.projections.append(wrapped)

    # ------------------------------------------------------------------ adapters (engine thread)
    def load(self, adapter: LoraAdapter) -> LoadedAdapter:
        """Write `adapter` into a free slot (see the module docstring)."""
        if adapter.name in self.loaded:
            raise AdapterError("lora_name", f"an adapter named {adapter.name!r} is already loaded")
        if adapter.rank > self.max_rank:
            raise AdapterError("r", f"adapter {adapter.name!r} has rank {adapter.rank}, above --max-lora-rank")
        used = {a.slot for a in self.loaded.values()}
        free = [s for s in range(self.max_loras) if s not in used]
        if not free:
            names = ", ".join(sorted(self.loaded))
            raise AdapterError(
                "max_loras", f"all {self.max_loras} adapter slots are in use ({names}); unload one first"
            )
        slot = free[0]
        with torch.inference_mode():
            for layer, wrapped in enumerate(self.projections):
                for attr, parts in MERGED.items():
                    pieces = [adapter.weights.get((layer, p)) for p in parts]
                    wrapped[attr].write(slot, pieces, adapter.scaling)
        loaded = LoadedAdapter(adapter.name, str(adapter.path), slot, adapter.rank, next(self._salts))
        self.loaded[adapter.name] = loaded
        return loaded

    def unload(self, name: str) -> LoadedAdapter:
        """Free the slot of `name` (the caller checked that no request uses it); ModelNotFoundError if unknown."""
        loaded = self.lookup(name)
        with torch.inference_mode():
            for wrapped in self.projections:
                for proj in wrapped.values():
                    proj.clear(loaded.slot)
        del self.loaded[name]
        return loaded

    def name_of_salt(self, salt: int) -> str | None:
        """The name of the loaded adapter whose loading has prefix-cache salt `salt` (for KV-cache events)."""
        return next((a.name for a in self.loaded.values() if a.cache_salt == salt), None)

    def lookup(self, name: str) -> LoadedAdapter:
        """The loaded adapter called `name`; ModelNotFoundError naming it otherwise."""
        loaded = self.loaded.get(name)
        if loaded is None:
            have = ", ".join(sorted(self.loaded)) or "none"
            raise ModelNotFoundError(f"the LoRA adapter '{name}' is not loaded here (loaded: {have})")
        return loaded

    # ------------------------------------------------------------------ steps
    @contextmanager
    def rows(self, row_slots: Sequence[int], device: torch.device) -> Iterator[None]:
        """Serve the step's rows (their slots in the flat [T] layout, -1: base) from their adapters inside."""
        if self.fused is not None:
            self.step = FusedRows(torch.tensor(row_slots, dtype=torch.int32), self.fused)  # [T], once a step
        else:
            self.step = group_rows(row_slots, device)
        try:
            yield
        finally:
            self.step = None


def group_rows(row_slots: Sequence[int], device: torch.device) -> StepRows | None:
    """The `StepRows` of a step whose rows have these slots (-1: base); None when no row has an adapter."""
    by_slot: dict[int, list[int]] = {}
    for i, s in enumerate(row_slots):
        if s >= 0:
            by_slot.setdefault(s, []).append(i)
    if not by_slot:
        return None
    order = [i for idx in by_slot.values() for i in idx]  # grouped by slot, each group in row order
    groups, start = [], 0
    for s, idx in by_slot.items():
        groups.append((s, slice(start, start + len(idx))))
        start += len(idx)
    run = order == list(range(order[0], order[0] + len(order)))
    gather = None if run else torch.tensor(order, dtype=torch.int64, device=device)
    batched = None if run or len(by_slot) < 2 else _batched(by_slot, device)
    return StepRows(slice(order[0], order[0] + len(order)), gather, tuple(groups), len(order), batched)


def _batched(by_slot: dict[int, list[int]], device: torch.device) -> Batched:
    slots = tuple(sorted(by_slot))
    size = max(len(idx) for idx in by_slot.values())
    rows = [i for s in slots for i in by_slot[s] + [by_slot[s][0]] * (size - len(by_slot[s]))]
    padding = None
    if any(len(idx) < size for idx in by_slot.values()):
        pad = [[[j >= len(by_slot[s])] for j in range(size)] for s in slots]
        padding = torch.tensor(pad, dtype=torch.bool, device=device)  # [G, g, 1]
    in_place = slots == tuple(range(len(slots)))
    slot_index = None if in_place else torch.tensor(slots, dtype=torch.int64, device=device)
    return Batched(torch.tensor(rows, dtype=torch.int64, device=device), slots, slot_index, padding)
