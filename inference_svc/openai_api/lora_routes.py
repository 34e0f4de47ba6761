"""LoRA adapters over the OpenAI-compatible HTTP API, as vLLM serves them.

Contract:
- `resolve_model(name, base, engine)`: a request's `model` → the adapter that serves it (None: the base model, for
  no name or the served model's own name); any other name that is not a loaded adapter is a `ModelNotFoundError`
  (404 in OpenAI's error shape, `param` "model"). The engine checks again when it queues the request, so an
  adapter unloaded in between gives the same 404.
- `adapter_cards(engine, base, created)`: one `/v1/models` card per loaded adapter, vLLM's shape: `id` its name,
  `root` its folder, `parent` the base model's name; `adapter_card(..., name)` one of them (404 once unloaded).
- `POST /v1/load_lora_adapter` {lora_name, lora_path} and `POST /v1/unload_lora_adapter` {lora_name}: behind the
  API key and the lifecycle like every generation route (`Handler.handle`: 401, 503, 413, 400), answered as vLLM
  does with 200 and a one-line text. A load reads and checks the folder off the engine thread
  (`inference_svc.lora.adapter`: 400 naming the field for anything it refuses), then writes the slot on the engine
  thread between two steps (`AsyncEngine.run_in_engine`), so no step sees a half-written slot; a name already
  loaded or the base model's, or no free slot (`--max-loras`), is 400 naming `lora_name` / `max_loras`; a server
  started without LoRA answers 400 naming `lora_name`. An unload of a name not loaded is 404; of an adapter
  that unfinished requests use, 409 naming it (nothing waits: retry once they are done).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from inference_svc.access_log import RequestRecord
from inference_svc.async_engine import AsyncEngine
from inference_svc.errors import InvalidRequestError, ModelNotFoundError
from inference_svc.lora.adapter import load_adapter
from inference_svc.lora.slots import LoadedAdapter, LoraSlots

if TYPE_CHECKING:
    from inference_svc.openai_api.handling import Handler


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's body of POST /v1/unload_lora_adapter (`lora_int_id` is accepted and not used, as vLLM's)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


def _slots(engine: AsyncEngine | None) -> LoraSlots | None:
    return None if engine is None or engine.engine is None else engine.engine.lora


def _loaded(engine: AsyncEngine | None) -> dict[str, LoadedAdapter]:
    slots = _slots(engine)
    return {} if slots is None else dict(slots.loaded)  # a copy: the engine thread may change it meanwhile


def resolve_model(name: str | None, base: str, engine: AsyncEngine | None) -> str | None:
    """The adapter a request's `model` names (see the module docstring)."""
    if name is None or name == base:
        return None
    loaded = _loaded(engine)
    if name in loaded:
        return name
    also = f" or one of its LoRA adapters ({', '.join(sorted(loaded))})" if loaded else ""
    raise ModelNotFoundError(f"the model '{name}' does not exist here; this server serves '{base}'{also}")


def adapter_cards(engine: AsyncEngine | None, base: str, created: int) -> list[dict[str, Any]]:
    """One card per loaded adapter, in name order (see the module docstring)."""
    return [
        {"id": a.name, "object": "model", "created": created, "owned_by": "tandem", "root": a.path, "parent": base}
        for a in sorted(_loaded(engine).values(), key=lambda a: a.name)
    ]


def adapter_card(engine: AsyncEngine | None, base: str, created: int, name: str) -> dict[str, Any]:
    """The card of adapter `name`; ModelNotFoundError when it is not loaded (any more)."""
    for card in adapter_cards(engine, base, created):
        if card["id"] == name:
            return card
    raise ModelNotFoundError(f"the model '{name}' does not exist here; this server serves '{base}'")


def lora_routes(api: Handler) -> list[Route]:
    """The two routes, handled by `api` (its key check, lifecycle, body reading and error shape)."""

    async def load(request: Request) -> Response:
        return await api.handle(request, lambda engine, body, record: _load(api, engine, body, record), {})

    async def unload(request: Request) -> Response:
        return await api.handle(request, lambda engine, body, record: _unload(api, engine, body, record), {})

    return [
        Route("/v1/load_lora_adapter", load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload, methods=["POST"]),
    ]


def _require_slots(engine: AsyncEngine) -> LoraSlots:
    slots = _slots(engine)
    if slots is None:
        raise InvalidRequestError(
            "lora_name", "this server serves no LoRA adapters (start it with --enable-lora or --lora-modules)"
        )
    return slots


async def _load(api: Handler, engine: AsyncEngine, body: Any, record: RequestRecord) -> Response:
    req: LoadLoraAdapterRequest = api.parse_body(LoadLoraAdapterRequest, body)
    slots = _require_slots(engine)
    base = api.options.model_name
    if req.lora_name == base:
        raise InvalidRequestError("lora_name", f"'{base}' is the base model's name; choose another adapter name")
    if req.lora_name in _loaded(engine):
        raise InvalidRequestError("lora_name", f"an adapter named '{req.lora_name}' is already loaded")
    config = engine.engine.model_config
    adapter = await asyncio.to_thread(load_adapter, req.lora_name, req.lora_path, config, slots.max_rank)
    await engine.run_in_engine(lambda: slots.load(adapter))
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def _unload(api: Handler, engine: AsyncEngine, body: Any, record: RequestRecord) -> Response:
    req: UnloadLoraAdapterRequest = api.parse_body(UnloadLoraAdapterRequest, body)
    _require_slots(engine)
    name = req.lora_name
    await engine.run_in_engine(lambda: engine.engine.unload_lora_adapter(name))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
