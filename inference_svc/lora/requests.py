"""How requests meet adapters inside the engine: a request's adapter by name, unloading one no request uses, and
which adapters the running and waiting requests use (for `vllm:lora_requests_info`).

Contract:
- `resolve(slots, name)` → (slot, prefix-cache salt) of the adapter a request names: (-1, 0) for None (the base
  model); `ModelNotFoundError` naming it when LoRA is off or no such adapter is loaded. The engine calls it when it
  queues the request (on its thread), so a request admitted before an unload keeps its slot to the end.
- `unload(slots, name, sequences)` frees the adapter's slot unless an unfinished request (running or waiting) uses
  it: then `AdapterInUseError` (HTTP 409) naming the adapter and how many requests hold it; nothing waits.
- `adapter_names(slots, sequences)` → the sorted names of the adapters those sequences use.
"""

from __future__ import annotations

from collections.abc import Iterable

from inference_svc.engine.sequence import Sequence
from inference_svc.errors import AdapterInUseError, ModelNotFoundError
from inference_svc.lora.slots import LoadedAdapter, LoraSlots


def resolve(slots: LoraSlots | None, name: str | None) -> tuple[int, int]:
    """(slot, cache salt) for a request naming adapter `name` (see the module docstring)."""
    if name is None:
        return -1, 0
    if slots is None:
        raise ModelNotFoundError(f"the LoRA adapter '{name}' is not loaded here (this server serves no adapters)")
    loaded = slots.lookup(name)
    return loaded.slot, loaded.cache_salt


def unload(slots: LoraSlots | None, name: str, sequences: Iterable[Sequence]) -> LoadedAdapter:
    """Free `name`'s slot if no unfinished request uses it (see the module docstring)."""
    if slots is None:
        raise ModelNotFoundError(f"the LoRA adapter '{name}' is not loaded here (this server serves no adapters)")
    loaded = slots.lookup(name)
    users = sum(1 for s in sequences if s.lora_slot == loaded.slot and not s.is_finished)
    if users:
        raise AdapterInUseError(
            f"the LoRA adapter '{name}' serves {users} unfinished request(s); unload it once they are done"
        )
    return slots.unload(name)


def adapter_names(slots: LoraSlots | None, sequences: Iterable[Sequence]) -> tuple[str, ...]:
    """The names of the adapters `sequences` use, sorted."""
    if slots is None:
        return ()
    by_slot = {a.slot: a.name for a in slots.loaded.values()}
    return tuple(sorted({by_slot[s.lora_slot] for s in sequences if s.lora_slot in by_slot}))
