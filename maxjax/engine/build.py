"""Building a ready engine, the one way every entry point does it (`maxjax serve`, maxjax.LLM and so
`maxjax generate`; `maxjax warm-cache` loads its model with `load`):
  1. load the model, its converted weights from the precompiled artifacts when they hold them;
  2. the step executables: loaded from the artifacts after checking them against the engine config
     (whose unset values take the ones the artifacts pinned), else compiled;
  3. warm-up: every bucket ready, the executables' first-run priming armed (EngineCore.prime_next).
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

from maxjax.engine.config import EngineConfig
from maxjax.engine.core import EngineCore
from maxjax.errors import UserError
from maxjax.models.loader import LoadedModel, load_model

log = logging.getLogger("maxjax.engine")


def load(model: str | LoadedModel | None, quantization_encoding: str | None = None,
         chat_template: str | None = None, precompiled_artifacts: Sequence[str] = (),
         progress: bool = False) -> LoadedModel:
    """A LoadedModel as it is; else `load_model(model, ...)` (a GGUF file, a HF directory or
    repo id, None for the embedded default). `progress`: a loading bar and a log line."""
    if isinstance(model, LoadedModel):
        return model
    stored = None
    if precompiled_artifacts:
        from maxjax.aot import weights as aot_weights
        stored = aot_weights.params_source(precompiled_artifacts)
    loaded = load_model(model, quantization_encoding, chat_template, progress=progress,
                        params_source=stored)
    if progress:
        log.info("loaded %s (%s) in %.1f s", loaded.name, loaded.dtype, loaded.load_seconds)
    return loaded


def build_core(model: str | LoadedModel | None, engine_cfg: EngineConfig, *,
               chat_template: str | None = None, precompiled_artifacts: Sequence[str] = (),
               require_compiled: bool = False, progress: bool = False) -> EngineCore:
    """A warmed-up EngineCore. `engine_cfg` is completed in place: its quantization_encoding
    becomes the model's dtype, its unset values the artifacts' pinned ones. `require_compiled`:
    refuse artifacts that hold no executable for this device. `progress`: a loading bar and log
    lines for loading and compiling."""
    model = load(model, engine_cfg.quantization_encoding, chat_template, precompiled_artifacts,
                 progress)
    engine_cfg.quantization_encoding = model.dtype
    loaded = ()
    if precompiled_artifacts and engine_cfg.enable_lora:
        raise UserError("--enable-lora with --precompiled-artifacts: artifacts hold no LoRA "
                        "graphs yet; drop one of the two")
    if precompiled_artifacts:
        from maxjax.aot import load as aot_load
        loaded = aot_load.load_for_engine(precompiled_artifacts, model, engine_cfg,
                                          require_compiled)
    core = EngineCore(model, engine_cfg, *loaded)
    t0 = time.perf_counter()
    core.warmup(_log_compiled if progress else None)
    if progress:
        lay = core.layout
        log.info("%d graphs ready in %.1f s (KV pool: %d pages of %d tokens, max length %d)",
                 len(lay.buckets), time.perf_counter() - t0, lay.num_pages, lay.page_size,
                 core.max_length)
    return core


def _log_compiled(i: int, n: int, name: str) -> None:
    log.info("compiling graphs: %d/%d (%s)", i, n, name)
