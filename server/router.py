"""Several models behind one server (`maxjax serve --model A --model B`, --models-file): a
ModelRouter holds one ModelSlot per configured model, each with its own engine and its own
ServerState, loaded on its first request and unloaded, least recently used first, when more than
--max-loaded-models would be loaded or when the loaded models' planned bytes and its own would
exceed the memory budget (maxjax/engine/model_memory.py plans both before any model loads).

The routes are not told about it: the app's STATE is a RoutedState that answers for the model the
request's body names (read_json calls `pick_model`, which loads it if needed and marks it in use
until the middleware's `end_request`); a route reads `st.engine`, `st.tokenizer`... as with one
model. The model a request picks is held in a ContextVar, which each request's handler task has
to itself (and the tasks it starts copy)."""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from typing import Callable

from maxjax.engine.model_memory import GiB, ModelMemory
from maxjax.engine.stats import EngineStats
from maxjax.errors import UserError

from .config import ServeConfig
from .engine_client import EngineClient
from .generation import AdmissionState
from .metrics import ModelMetrics, ServerMetrics
from .protocol import APIError
from .state import ServerState

log = logging.getLogger("maxjax.server.router")

_IDLE_POLL = 0.02      # seconds between looks at an engine an unload waits on


@dataclass
class ModelSlot:
    name: str
    start: Callable[[], EngineClient]       # builds and starts the engine (blocking)
    cfg: ServeConfig                        # the server's settings with this model's own
    engine: EngineClient | None = None
    state: ServerState | None = None
    last_used: float = 0.0
    in_flight: int = 0                      # handlers that picked it and have not ended
    draining: bool = False                  # an unload waits for it to go idle
    load_seconds: float | None = None       # its last load's
    memory: ModelMemory | None = None       # its planned bytes; None: unplanned (not counted)

    @property
    def planned_bytes(self) -> int:
        return self.memory.bytes if self.memory is not None else 0

    @property
    def loaded(self) -> bool:
        return self.engine is not None


@dataclass
class _Unloaded:
    """A slot's engine while it is not loaded: what a RoutedState answers with before the first
    model has loaded, or once every model was unloaded (/health: ready with the router)."""
    model_name: str
    router: ModelRouter
    dead: None = None
    tokenizer: None = None
    chat_template: None = None
    max_length: int = 0
    model_aliases: tuple = ()

    @property
    def is_ready(self) -> bool:
        return self.router.is_ready

    def lora_adapters(self) -> dict:
        return {}

    def stats(self) -> EngineStats:
        return EngineStats()

    def info(self) -> dict:
        return {"model": self.model_name, "loaded": False, "structured_output": False}


def _idle(slot: ModelSlot) -> bool:
    if slot.in_flight:
        return False
    try:
        s = slot.engine.stats()
    except Exception:       # a dead engine runs nothing
        return True
    return not (s.scheduler.running or s.scheduler.waiting)


class ModelRouter:
    """The configured models, in order (the first answers requests that name none)."""

    def __init__(self, slots: list[ModelSlot], max_loaded: int | None = None,
                 budget: int | None = None):
        names = [s.name for s in slots]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"two models are named {dup!r}: give each its own name")
        self.slots = {s.name: s for s in slots}
        self.max_loaded = max_loaded or len(slots)
        self.budget = budget        # bytes the loaded models' plans may hold; None: no cap
        self.is_ready = False       # the first model's start-up load has finished
        self.dead: BaseException | None = None
        self._swap: asyncio.Lock | None = None     # one load or eviction at a time
        self._pool = None           # the server's one tokenizer thread, shared by the models
        self._shared: tuple | None = None

    # ---- what the server reads --------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return next(iter(self.slots))

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def loaded_engines(self) -> list[tuple[str, EngineClient]]:
        return [(s.name, s.engine) for s in self.slots.values() if s.engine is not None]

    def stats(self) -> EngineStats:
        return EngineStats()

    def default_slot(self) -> ModelSlot:
        """The most recently used loaded model, else the first configured."""
        loaded = [s for s in self.slots.values() if s.loaded]
        return max(loaded, key=lambda s: s.last_used) if loaded else next(iter(self.slots.values()))

    def find(self, model: str | None) -> ModelSlot:
        """The slot `model` names: a model's name or a LoRA adapter
        loaded on one; None: the first. 404 listing the served models otherwise."""
        if model is None:
            return next(iter(self.slots.values()))
        if model in self.slots:
            return self.slots[model]
        for s in self.slots.values():
            if s.engine is not None and model in s.engine.lora_adapters():
                return s
        raise self.unknown(model)

    def unknown(self, model: str) -> APIError:
        return APIError(404, f"model {model!r} does not exist; this server serves "
                             f"{', '.join(map(repr, self.slots))}", param="model",
                        code="model_not_found")

    # ---- the server's side ------------------------------------------------------------------
    def attach(self, cfg: ServeConfig, metrics: ServerMetrics, admission: AdmissionState,
               created: int, pool) -> None:
        self._shared = (metrics, admission, created)
        self._pool = pool
        for s in self.slots.values():
            s.state = self._state(s, s.engine or _Unloaded(s.name, self))

    def _state(self, slot: ModelSlot, engine) -> ServerState:
        metrics, admission, created = self._shared
        return ServerState(engine=engine, cfg=slot.cfg, metrics=ModelMetrics(metrics, slot.name),
                           admission=admission, created=created, tokenizer_pool=self._pool)

    async def acquire(self, name: str) -> ModelSlot:
        """The slot loaded (loading it, and first unloading the least recently used others as
        the cap says) and marked in use until `release`."""
        slot = self.slots[name]
        slot.last_used = time.monotonic()
        while slot.draining:           # an unload waits for it: wait for that, then reload
            await asyncio.sleep(_IDLE_POLL)
        if slot.engine is None:
            async with self._lock():
                if slot.engine is None:
                    await self._make_room(slot)
                    await self._load(slot)
        slot.in_flight += 1
        slot.last_used = time.monotonic()
        return slot

    def release(self, slot: ModelSlot) -> None:
        slot.in_flight -= 1

    async def load(self, name: str) -> ModelSlot:
        slot = await self.acquire(name)
        self.release(slot)
        return slot

    async def unload(self, name: str) -> bool:
        """Unload once its requests have finished; False when it was not loaded."""
        slot = self.slots[name]
        async with self._lock():
            if slot.engine is None:
                return False
            await self._unload(slot)
        return True

    def _lock(self) -> asyncio.Lock:
        if self._swap is None:
            self._swap = asyncio.Lock()
        return self._swap

    def too_big(self, slot: ModelSlot) -> APIError | None:
        """The error of a model whose plan alone exceeds the memory budget; None: it fits."""
        if self.budget is None or slot.planned_bytes <= self.budget:
            return None
        return APIError(503, f"model {slot.name!r} needs {slot.planned_bytes} bytes "
                             f"({slot.planned_bytes / GiB:.3f} GiB: {slot.memory.line()}), more "
                             f"than the memory budget of {self.budget} bytes "
                             f"({self.budget / GiB:.3f} GiB) the loaded models share; it "
                             f"cannot be loaded (--models-memory-budget, or its --num-kv-pages)",
                        param="model", code="model_too_large")

    def _victims(self, slot: ModelSlot) -> list[ModelSlot]:
        """The least recently used loaded others to unload so that `slot` fits the count cap
        and the memory budget."""
        loaded = sorted((s for s in self.slots.values() if s.loaded and s is not slot),
                        key=lambda s: s.last_used)
        held = sum(s.planned_bytes for s in loaded) + slot.planned_bytes
        out = []
        for victim in loaded:
            over_count = len(loaded) - len(out) + 1 > self.max_loaded
            over_memory = self.budget is not None and held > self.budget
            if not (over_count or over_memory):
                break
            out.append(victim)
            held -= victim.planned_bytes
        return out

    async def _make_room(self, slot: ModelSlot) -> None:
        error = self.too_big(slot)
        if error is not None:
            raise error
        for victim in self._victims(slot):
            log.info("unloading %s (least recently used) to load %s", victim.name, slot.name)
            await self._unload(victim)

    async def _load(self, slot: ModelSlot) -> None:
        t0 = time.perf_counter()
        log.info("loading model %s", slot.name)
        try:
            engine = await asyncio.get_running_loop().run_in_executor(None, slot.start)
        except Exception as e:
            log.error("model %s failed to load: %s", slot.name, e)
            raise APIError(503, f"model {slot.name!r} failed to load: "
                                f"{' '.join(str(e).split())[:500]}", param="model") from None
        slot.engine, slot.state = engine, self._state(slot, engine)
        slot.load_seconds = time.perf_counter() - t0
        log.info("model %s loaded in %.2f s", slot.name, slot.load_seconds)

    async def _unload(self, slot: ModelSlot) -> None:
        """Waits until no request uses it (new ones wait for its reload), then shuts it down
        and frees its memory."""
        slot.draining = True
        try:
            while not _idle(slot):
                await asyncio.sleep(_IDLE_POLL)
            engine, slot.engine = slot.engine, None
            slot.state = self._state(slot, _Unloaded(slot.name, self))
            await asyncio.get_running_loop().run_in_executor(None, _free, engine)
        finally:
            slot.draining = False
        log.info("model %s unloaded", slot.name)

    def start_first(self) -> None:
        """The first model's engine, built on the calling thread at start-up (as one model's
        is); `is_ready` once it runs."""
        slot = next(iter(self.slots.values()))
        error = self.too_big(slot)
        if error is not None:
            raise UserError(f"{error.message} (it is the first model, loaded at start)")
        engine = slot.start()
        slot.engine, slot.last_used = engine, time.monotonic()
        if self._shared is not None:
            slot.state = self._state(slot, engine)
        self.is_ready = True

    def shutdown(self) -> None:
        for s in self.slots.values():
            if s.engine is not None:
                s.engine.shutdown()


def _free(engine) -> None:
    engine.shutdown()
    del engine
    gc.unfreeze()       # the start-up froze what it made (settle_heap): let its cycles go
    gc.collect()


# ---- the app's state ------------------------------------------------------------------------
_CURRENT: contextvars.ContextVar[ModelSlot | None] = contextvars.ContextVar(
    "maxjax_model", default=None)


class RoutedState:
    """The app's STATE with several models: the ServerState of the model the current request
    picked (the default slot's before it picks one)."""

    def __init__(self, router: ModelRouter, cfg: ServeConfig):
        from concurrent.futures import ThreadPoolExecutor
        self.router = router
        # the picked model's ServerState holds its view of these (ModelMetrics)
        metrics = ServerMetrics(router, model_label=True)
        pool = ThreadPoolExecutor(1, thread_name_prefix="maxjax-tokenize")
        from .protocol import now
        router.attach(cfg, metrics, AdmissionState(cfg.max_queue_size, metrics), now(), pool)
        self.tokenizer_pool = pool

    def __getattr__(self, name):
        slot = _CURRENT.get() or self.router.default_slot()
        return getattr(slot.state, name)

    def begin_request(self) -> None:
        _CURRENT.set(None)

    async def pick_model(self, model) -> None:
        slot = self.router.find(model if isinstance(model, str) else None)
        held = _CURRENT.get()
        if held is slot:
            return
        if held is not None:
            self.router.release(held)
            _CURRENT.set(None)
        _CURRENT.set(await self.router.acquire(slot.name))

    def end_request(self) -> None:
        held = _CURRENT.get()
        if held is not None:
            self.router.release(held)
            _CURRENT.set(None)


def model_slots(specs, start: Callable, cfg: ServeConfig) -> list[ModelSlot]:
    """One slot per (name, spec, server overrides); `start(spec, slot_cfg)` builds its engine."""
    out = []
    for name, spec, overrides in specs:
        slot_cfg = dataclasses.replace(cfg, served_model_name=name, **overrides)
        out.append(ModelSlot(name, (lambda spec=spec, c=slot_cfg: start(spec, c)), slot_cfg))
    return out

