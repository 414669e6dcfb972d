"""The model routes of a server of several models (server/router.py): /v1/models lists every
configured model, loaded or not, and each loaded one's LoRA adapters; POST
/v1/models/{name}/load and /unload (behind the API key, as every route) load one now or unload it
once its requests have finished."""
from __future__ import annotations

from aiohttp import web

from .openapi import describe
from .protocol import model_card
from .responses import ModelCard, ModelList
from .router import ModelSlot, RoutedState
from .state import STATE


def _configured(st: RoutedState, name: str) -> ModelSlot:
    """The model `name` names (a LoRA adapter is loaded and unloaded by its own routes)."""
    if name in st.router.slots:
        return st.router.slots[name]
    raise st.router.unknown(name)


def _cards(st: RoutedState, slot: ModelSlot) -> list[dict]:
    # planned_bytes: what it holds once loaded, by its memory plan (None: unplanned)
    planned = slot.memory.bytes if slot.memory is not None else None
    if not slot.loaded:
        return [{"id": slot.name, "object": "model", "created": st.created,
                 "owned_by": "maxjax", "root": slot.name, "parent": None, "loaded": False,
                 "planned_bytes": planned}]
    ms = slot.state
    defaults = ms.sampling_defaults.in_force()
    adapters = slot.engine.lora_adapters()
    return [dict(model_card(slot.name, ms.created, slot.engine.max_length, defaults),
                 loaded=True, planned_bytes=planned)] + [
        dict(model_card(a, ms.created, slot.engine.max_length, defaults, parent=slot.name,
                        root=path), loaded=True) for a, path in adapters.items()]


@describe(response=ModelList)
async def list_models(request: web.Request) -> web.Response:
    """Every configured model (`loaded`: whether it is in memory now; `planned_bytes`: what it
    holds once loaded, by its memory plan) and the LoRA adapters of the loaded ones."""
    st: RoutedState = request.app[STATE]
    return web.json_response({"object": "list", "data": [
        card for slot in st.router.slots.values() for card in _cards(st, slot)]})


@describe(response=ModelCard)
async def get_model(request: web.Request) -> web.Response:
    """One model (or adapter) by id; loads nothing."""
    st: RoutedState = request.app[STATE]
    model_id = request.match_info["model_id"]
    slot = st.router.find(model_id)
    return web.json_response(next(c for c in _cards(st, slot) if c["id"] == model_id))


@describe(response=ModelCard)
async def load_model(request: web.Request) -> web.Response:
    """Load a configured model now (unloading the least recently used others as
    --max-loaded-models and the memory budget say); answers once it serves."""
    st: RoutedState = request.app[STATE]
    slot = await st.router.load(_configured(st, request.match_info["name"]).name)
    return web.json_response(dict(_cards(st, slot)[0], load_seconds=round(slot.load_seconds or 0,
                                                                           3)))


@describe(response=ModelCard)
async def unload_model(request: web.Request) -> web.Response:
    """Unload a model once the requests using it have finished (new ones wait for its reload);
    a model not loaded is left as it is."""
    st: RoutedState = request.app[STATE]
    slot = _configured(st, request.match_info["name"])
    await st.router.unload(slot.name)
    return web.json_response(_cards(st, slot)[0])


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", get_model)
    app.router.add_post("/v1/models/{name:.+}/load", load_model)
    app.router.add_post("/v1/models/{name:.+}/unload", unload_model)
