"""`maxjax serve`: the HTTP server starts at once (health answers 503), the model loads and every
graph compiles on a background thread, then the engine starts and health turns 200."""
from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import threading
import time

from maxjax.engine.async_engine import AsyncEngine, check_max_pending
from maxjax.engine.config import EngineConfig
from maxjax.engine.replicas import ReplicatedEngine
from maxjax.engine.stats import EngineStats
from maxjax.errors import UserError

log = logging.getLogger("maxjax.serve")


class LoadingEngine:
    """The server's EngineClient while the model loads; forwards to the AsyncEngine once ready."""

    def __init__(self, model_name: str | None):
        self.inner: AsyncEngine | None = None
        self._model_name = model_name
        self.failure: BaseException | None = None

    @property
    def is_ready(self) -> bool:
        return self.inner is not None and self.inner.is_ready

    def __getattr__(self, name):
        inner = self.__dict__.get("inner")
        if inner is None:
            if name == "model_name":
                return self._model_name or "loading"
            raise AttributeError(name)
        return getattr(inner, name)

    def stats(self) -> EngineStats:
        return self.inner.stats() if self.inner else EngineStats()


def build_engine(model_opts, engine_cfg: EngineConfig, serve_cfg, progress=True, leader=None,
                 on_death=None, prepared=None):
    """The started AsyncEngine, or with --data-parallel-degree D a ReplicatedEngine of D.
    `leader`: process 0's plan channel of a multi-host group (maxjax/engine/distributed.py);
    `on_death`: called once every replica's engine thread has died. `prepared`: the plan's
    first half for these flags (maxjax/engine/build.py prefetch_early; None: made here)."""
    from maxjax.engine.build import build_core, load, prepare_start
    from maxjax.engine.plan import replica_mesh
    check_max_pending(serve_cfg.max_pending_requests)   # before anything loads
    model = model_opts.source()
    arts = model_opts.precompiled_artifacts
    if leader is None:      # a group's processes plan for the mesh they span (distributed.py)
        prepared = prepared or prepare_start(engine_cfg, arts)
    if leader is None and engine_cfg.data_parallel_degree > 1:   # loaded once, placed on each
        # replica's devices, in the encoding the plan picks (the kernels' choice decides a GGUF's)
        model = load(model, prepared, model_opts.chat_template, arts, progress,
                     replica_mesh(prepared.config) if arts else None)
    engines, pins = [], None
    for replica in range(engine_cfg.data_parallel_degree):
        if leader is not None:
            from maxjax.engine.distributed import build_group_core
            core = build_group_core(model_opts, engine_cfg, leader, progress)
        else:
            core = build_core(model, engine_cfg, chat_template=model_opts.chat_template,
                              precompiled_artifacts=model_opts.precompiled_artifacts,
                              require_compiled=model_opts.require_compiled_artifacts,
                              progress=progress, compile_cache=model_opts.compile_cache,
                              compile_cache_max_size=model_opts.compile_cache_max_size,
                              replica=replica, pins=pins, prepared=prepared)
            # Every replica runs replica 0's plan (memory is planned for all of them at once).
            pins = pins or core.plan.pins
        if model_opts.export_artifacts and replica == 0:
            from maxjax.aot import export as aot_export
            aot_export.export_engine(model_opts.export_artifacts, core, model_opts.compile_cache,
                                     model_opts.chat_template)
        name, aliases = served_names(core.model, serve_cfg.served_model_name)
        engines.append(AsyncEngine(core, core.model.tokenizer, name, core.model.chat_template,
                                   serve_cfg.max_pending_requests, model_aliases=aliases))
    engine = engines[0] if len(engines) == 1 else ReplicatedEngine(engines)
    if on_death is not None:
        for e in engines:
            e.on_death = lambda: on_death() if engine.dead is not None else None
    engine.start()
    return engine


def served_names(model, override: str | None) -> tuple[str, tuple[str, ...]]:
    """(the model id /v1/models lists, other ids requests may use): --served-model-name alone,
    else --model-path as the user gave it, with the file or directory's name (what maxjax
    served before) still accepted."""
    if override:
        return override, ()
    name = model.served_name or model.name
    return name, (model.name,) if model.name != name else ()


# glibc's mallopt parameter and its default on 64-bit Linux (64 * sizeof(size_t) / 4)
_M_MXFAST, _MXFAST_DEFAULT = 1, 128


def fastbins(on: bool) -> None:
    """glibc's fastbins on or off (nothing elsewhere). Deserializing an XLA executable builds
    and frees ~10^5 small protobuf nodes, and with fastbins glibc then spends ~10% of it merging
    them back (malloc_consolidate): a start turns them off until it is ready."""
    try:        # the process's own symbols: libc's, without find_library's ldconfig run
        ctypes.CDLL(None).mallopt(_M_MXFAST, _MXFAST_DEFAULT if on else 0)
    except (OSError, AttributeError, TypeError):    # not glibc
        pass


def settle_heap() -> None:
    """After a start with the collector and fastbins off (cmd_serve): one collection, then what
    is left (modules, the engine, its tokenizer) goes to the permanent generation, out of every
    later collection's scan."""
    t0 = time.perf_counter()
    fastbins(True)
    gc.collect()
    gc.freeze()
    gc.enable()
    log.info("start-up heap collected and frozen in %.2f s", time.perf_counter() - t0)


def serve(model_opts, engine_cfg: EngineConfig, serve_cfg, group=None, prepared=None) -> int:
    """`group`: the resolved DistributedOptions of a multi-host run (None: one process); process
    0 serves, the others follow it (maxjax/engine/distributed.py). `prepared`: the plan's first
    half for these flags (maxjax/engine/build.py prefetch_early; None: made when it loads)."""
    from maxjax.server.app import run_server
    # What the imports made (~130k objects) goes to the permanent generation uncollected: the
    # start's one collection (settle_heap) then scans what the engine made alone (0.08 s ->
    # 0.02 s), and the imports' garbage stays (~2k objects, once).
    gc.freeze()
    if group is not None and group.process_id > 0:
        gc.enable()     # a follower's start ends in its loop, not here
        fastbins(True)
        from maxjax.engine.distributed import run_follower
        return run_follower(model_opts, engine_cfg, group)
    from maxjax.models.loader import EMBEDDED_NAME
    lazy = LoadingEngine(serve_cfg.served_model_name or model_opts.model_path or EMBEDDED_NAME)
    stop_holder: dict = {}
    channel: dict = {}

    def stop_serving():
        stop_holder["loop"].call_soon_threadsafe(stop_holder["stop"].set)

    def load():
        try:
            if group is not None:
                from maxjax.engine.distributed import Leader
                channel["leader"] = Leader(group)
            built = build_engine(model_opts, engine_cfg, serve_cfg,
                                 leader=channel.get("leader"), on_death=stop_serving,
                                 prepared=prepared)
            lazy.inner = built      # ready: what follows is off the start's path
            settle_heap()
        except BaseException as e:  # reported on the main thread
            lazy.failure = e
            loop, stop = stop_holder["loop"], stop_holder["stop"]
            loop.call_soon_threadsafe(stop.set)

    async def main():
        stop = asyncio.Event()
        stop_holder.update(loop=asyncio.get_running_loop(), stop=stop)
        loader = threading.Thread(target=load, name="maxjax-load", daemon=True)
        await run_server(lazy, serve_cfg, stop=stop, on_listen=loader.start)

    asyncio.run(main())
    if lazy.inner is not None:
        lazy.inner.shutdown()
    if "leader" in channel:
        channel["leader"].close()
    if lazy.inner is not None and lazy.inner.dead is not None:
        log.critical("exiting: the engine thread died (%s)", lazy.inner.dead)
        return 1
    if lazy.failure is not None:
        if isinstance(lazy.failure, (UserError, ValueError)):
            raise UserError(str(lazy.failure))
        raise lazy.failure
    return 0
