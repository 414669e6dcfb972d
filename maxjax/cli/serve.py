"""`maxjax serve`: the HTTP server starts at once (health answers 503), the model loads and every
graph compiles on a background thread, then the engine starts and health turns 200."""
from __future__ import annotations

import asyncio
import logging
import threading
import time

from maxjax.engine.async_engine import AsyncEngine
from maxjax.engine.config import EngineConfig
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

    def stats(self) -> dict:
        return self.inner.stats() if self.inner else {}


def build_engine(model_opts, engine_cfg: EngineConfig, serve_cfg, progress=True) -> AsyncEngine:
    from maxjax.engine.core import EngineCore
    from maxjax.models.loader import load_model
    t0 = time.perf_counter()
    stored = None
    if model_opts.precompiled_artifacts:
        from maxjax.aot import weights as aot_weights
        stored = aot_weights.params_source(model_opts.precompiled_artifacts)
    model = load_model(model_opts.model_path, engine_cfg.quantization_encoding,
                       model_opts.chat_template, progress=progress, params_source=stored)
    engine_cfg.quantization_encoding = model.dtype
    log.info("loaded %s (%s) in %.1f s", model.name, model.dtype, time.perf_counter() - t0)
    layout, executables = None, {}
    if model_opts.precompiled_artifacts:
        from maxjax.aot import load as aot_load
        layout, executables = aot_load.load_for_engine(model_opts.precompiled_artifacts, model,
                                                       engine_cfg,
                                                       model_opts.require_compiled_artifacts)
    core = EngineCore(model, engine_cfg, layout)
    core.runner.set_executables(executables)
    t1 = time.perf_counter()

    def on_compiled(i, n, name):
        log.info("compiling graphs: %d/%d (%s)", i, n, name)
    core.warmup(on_compiled)
    log.info("%d graphs ready in %.1f s (KV pool: %d pages of %d tokens, max length %d)",
             len(core.layout.buckets), time.perf_counter() - t1, core.layout.num_pages,
             core.layout.page_size, core.max_length)
    if model_opts.export_artifacts:
        from maxjax.aot import export as aot_export
        aot_export.export_engine(model_opts.export_artifacts, core)
    name = serve_cfg.served_model_name or model.name
    engine = AsyncEngine(core, model.tokenizer, name, model.chat_template,
                         serve_cfg.max_pending_requests)
    engine.start()
    return engine


def serve(model_opts, engine_cfg: EngineConfig, serve_cfg) -> int:
    from maxjax.server.app import run_server
    lazy = LoadingEngine(serve_cfg.served_model_name)
    stop_holder: dict = {}

    def load():
        try:
            lazy.inner = build_engine(model_opts, engine_cfg, serve_cfg)
        except BaseException as e:  # reported on the main thread
            lazy.failure = e
            loop, stop = stop_holder["loop"], stop_holder["stop"]
            loop.call_soon_threadsafe(stop.set)

    async def main():
        stop = asyncio.Event()
        stop_holder.update(loop=asyncio.get_running_loop(), stop=stop)
        threading.Thread(target=load, name="maxjax-load", daemon=True).start()
        await run_server(lazy, serve_cfg, stop=stop)

    asyncio.run(main())
    if lazy.inner is not None:
        lazy.inner.shutdown()
    if lazy.failure is not None:
        if isinstance(lazy.failure, (UserError, ValueError)):
            raise UserError(str(lazy.failure))
        raise lazy.failure
    return 0
