"""Building a ready engine, the one way every entry point does it (`maxjax serve`, maxjax.LLM and so
`maxjax generate`; `maxjax warm-cache` loads its model with `load`):
  1. load the model, its converted weights restored from the precompiled artifacts (onto the
     engine's mesh, maxjax/aot/weights.py) when they store them;
  2. the step executables: loaded from the precompiled artifacts after checking them against the
     engine config (whose unset values take the ones the artifacts pinned); else loaded from the
     compile cache (maxjax/aot/cache.py), or compiled and stored there on a miss; else (the cache
     off) compiled;
  3. warm-up: every bucket ready, the executables' first-run priming armed (EngineCore.prime_next).
With `progress`, each phase logs one line, compiling a count per graph and `Still compiling
(N s elapsed)` while a long compile gives no other sign of life.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Sequence

from maxjax.engine.config import EngineConfig
from maxjax.engine.core import EngineCore, plan_layout
from maxjax.errors import UserError
from maxjax.models.loader import LoadedModel, load_model
from maxjax.models.source import ModelSource

log = logging.getLogger("maxjax.engine")
HEARTBEAT_SECONDS = 15.0


def load(model: str | ModelSource | LoadedModel | None, quantization_encoding: str | None = None,
         chat_template: str | None = None, precompiled_artifacts: Sequence[str] = (),
         progress: bool = False, mesh=None, platform: str | None = None,
         kernels: bool = False) -> LoadedModel:
    """A LoadedModel as it is; else `load_model(model, ...)` (a ModelSource, or its path: a GGUF
    file, a HF directory or repo id, None for the embedded default). With
    `precompiled_artifacts` that store the converted weights for `mesh` (the engine's,
    `replica_mesh`), they are restored onto it instead (maxjax/aot/weights.py). `progress`: a log line (and a loading bar on a
    terminal). `platform`: whose default encoding (None: this machine's); `kernels`:
    --use-experimental-kernels (a quantized GGUF's default encoding is then its own)."""
    if isinstance(model, LoadedModel):
        return model
    stored = None
    if precompiled_artifacts:
        from maxjax.aot import weights as aot_weights
        stored = aot_weights.params_source(precompiled_artifacts, mesh)
    if progress:
        log.info("Loading weights: %s", getattr(model, "model_path", model)
                 or "the embedded SmolLM2-135M-Instruct")
    loaded = load_model(model, quantization_encoding, chat_template,
                        progress=progress and sys.stderr.isatty(), params_source=stored,
                        platform=platform, kernels=kernels)
    if progress:
        log.info("Loaded %s (%s) in %.1f s", loaded.name, loaded.dtype, loaded.load_seconds)
    return loaded


def build_core(model: str | ModelSource | LoadedModel | None, engine_cfg: EngineConfig, *,
               chat_template: str | None = None, precompiled_artifacts: Sequence[str] = (),
               require_compiled: bool = False, progress: bool = False,
               compile_cache: bool | None = None, compile_cache_max_size: str | None = None,
               replica: int = 0, executor=None) -> EngineCore:
    """A warmed-up EngineCore. `engine_cfg` is completed in place: its quantization_encoding
    becomes the model's dtype, its unset values the artifacts' pinned ones (or the sizes this
    machine gives). `require_compiled`: refuse artifacts that hold no executable for this
    device. `compile_cache`: False turns the compile cache off (None: on unless
    MAXJAX_NO_COMPILE_CACHE=1); `compile_cache_max_size` its cap (maxjax/aot/cache.py).
    `progress`: log lines for loading and compiling. `replica`: which of the
    --data-parallel-degree device groups (maxjax/engine/devices.py) the engine runs on.
    `executor`: what the runner's calls go through (ModelRunner; None: this process's own)."""
    from maxjax.aot import cache
    from maxjax.engine.step_policy import check_flags
    phases = {"start": since_process_start()}
    check_flags(engine_cfg)
    from maxjax.engine import speculative
    speculative.draft_tokens(engine_cfg)          # its flags checked before the weights load
    resolve_kernels(engine_cfg, precompiled_artifacts)
    use_cache = cache.enabled(compile_cache)
    request = _request(model, engine_cfg, chat_template) if use_cache and \
        not precompiled_artifacts else None
    from maxjax.aot import prefetch
    early = request and prefetch.start(cache.directory(), request)
    t = time.perf_counter()
    model = load(model, engine_cfg.quantization_encoding, chat_template, precompiled_artifacts,
                 progress, replica_mesh(engine_cfg, replica) if precompiled_artifacts else None,
                 kernels=engine_cfg.use_experimental_kernels)
    phases["weights"] = time.perf_counter() - t
    engine_cfg.quantization_encoding = model.dtype
    t = time.perf_counter()
    model = on_devices(model, engine_cfg, replica)
    phases["placing"] = time.perf_counter() - t
    t0 = time.perf_counter()
    loaded = ()
    if precompiled_artifacts:
        from maxjax.aot import load as aot_load
        loaded = aot_load.load_for_engine(precompiled_artifacts, model, engine_cfg,
                                          require_compiled)
    elif use_cache:
        loaded = _from_cache(model, engine_cfg, cache.max_bytes(compile_cache_max_size), progress,
                             early or None, request)
    phases["graphs"] = time.perf_counter() - t0
    t = time.perf_counter()
    core = EngineCore(model, engine_cfg, *loaded, executor=executor)
    phases["engine and KV pool"] = time.perf_counter() - t
    n = len(core.layout.buckets)
    t = time.perf_counter()
    with Heartbeat(progress and not loaded) as beat:
        if progress and not loaded:
            log.info("Compiling %d step graphs%s", n, "" if use_cache else " (compile cache off)")
        core.warmup(beat.graph_done if progress else None)
    phases["compiling" if not loaded else "warm-up"] = time.perf_counter() - t
    if progress:
        lay = core.layout
        from maxjax.graphs import cpu_kernels
        linear = cpu_kernels.kernels_of(core.model.params)
        kernels = f", {' '.join(linear)} {cpu_kernels.isa()}" if linear else ""
        log.info("Engine ready in %.1f s: %d step graphs (%s attention%s), KV pool of %d pages "
                 "of %d tokens, max length %d", time.perf_counter() - t0, n, lay.attention,
                 kernels, lay.num_pages, lay.page_size, core.max_length)
        if lay.memory_report:
            log.info("%s", lay.memory_report)
        if phases["start"] is not None:
            log.info("Start-up %.1f s from process start: %s", since_process_start(),
                     ", ".join(f"{'imports and setup' if k == 'start' else k} {v:.1f} s"
                               for k, v in phases.items()))
    return core


def since_process_start() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def replica_mesh(engine_cfg: EngineConfig, replica: int = 0):
    """Replica `replica`'s mesh of --devices; None on one device."""
    from maxjax.engine import devices
    return devices.replica_meshes(engine_cfg.devices, engine_cfg.data_parallel_degree)[replica]


def on_devices(model: LoadedModel, engine_cfg: EngineConfig, replica: int = 0,
               platforms: Sequence[str] | None = None) -> LoadedModel:
    """The model with its params on replica `replica`'s mesh of --devices (as it is on one
    device), its quantized matrices packed for the CPU kernels when they run
    (`resolve_kernels`); UserError for what a mesh does not support yet. `platforms`: where the
    graphs run (None: this machine)."""
    from maxjax.engine import devices
    mesh = replica_mesh(engine_cfg, replica)
    if resolve_kernels(engine_cfg, platforms=platforms):
        return experimental_kernels(model)
    from maxjax.graphs import cpu_kernels
    if cpu_kernels.kernels_of(model.params):     # weights restored from such artifacts
        raise UserError("the artifacts' stored weights are laid out for --use-experimental-kernels"
                        ": pass it, or recreate the artifacts without it")
    if mesh is not None:
        if engine_cfg.enable_lora:
            raise UserError(f"--enable-lora with --devices {engine_cfg.devices} or "
                            "--data-parallel-degree: LoRA runs on one device only for now")
        if engine_cfg.speculative_method == "draft" and (
                mesh.size > 1 or engine_cfg.data_parallel_degree > 1):
            raise UserError(f"--speculative-method draft with --devices {engine_cfg.devices} or "
                            "--data-parallel-degree: with a draft model the target runs on one "
                            "device only (the draft's: --draft-devices)")
    return devices.place_model(model, mesh)


def resolve_kernels(engine_cfg: EngineConfig, precompiled_artifacts: Sequence[str] = (),
                    platforms: Sequence[str] | None = None) -> bool:
    """Whether maxjax's CPU kernels (graphs/cpu_kernels.py) run, written into
    --use-experimental-kernels: True requires them (a UserError naming why they cannot run),
    False keeps XLA's path, None (the default) turns them on wherever they run: what
    --precompiled-artifacts were built with, else on this CPU unless one log line says why not.
    `platforms`: where the graphs run (None: this machine)."""
    import jax
    flag, source = engine_cfg.use_experimental_kernels, "--use-experimental-kernels"
    if flag is False:
        return False
    if flag is None and precompiled_artifacts:
        from maxjax.aot import load as aot_load
        flag = aot_load.pinned_kernels(precompiled_artifacts)
        source = "--precompiled-artifacts (built with the CPU kernels)"
        if not flag:
            engine_cfg.use_experimental_kernels = False
            return False
    platforms = list(platforms or [jax.export.default_export_platform()])
    devices = engine_cfg.devices or ""
    from maxjax.graphs import cpu_kernels
    why = (f"they are for the CPU (graphs for {', '.join(platforms)})" if platforms != ["cpu"]
           else f"they run on one device (--devices {devices})"
           if replica_mesh(engine_cfg) is not None
           else "they run on one device (--data-parallel-degree)"
           if engine_cfg.data_parallel_degree > 1 else cpu_kernels.unavailable())
    if why and flag:
        raise UserError(f"{source}: {why}")
    if why:
        log.info("CPU kernels off: %s; XLA's path runs", why)
    elif flag is None:
        log.info("CPU kernels on (%s)", cpu_kernels.isa())
    engine_cfg.use_experimental_kernels = why is None
    return why is None


def experimental_kernels(model: LoadedModel) -> LoadedModel:
    """The model's int8 and 4-bit matrices packed for graphs/cpu_kernels.py (their attention
    kernel is the layout's choice: maxjax/engine/core.py plan_layout); other weights as they
    are."""
    import dataclasses

    from maxjax.graphs import cpu_kernels
    from maxjax.models.quantize import Q4_TYPES
    if model.dtype != "int8" and model.dtype not in Q4_TYPES:
        return model
    return dataclasses.replace(model, params=cpu_kernels.pack_params(model.params))


def _request(model, engine_cfg: EngineConfig, chat_template: str | None) -> str | None:
    """maxjax/aot/prefetch.py's key of this start (None: a LoadedModel, or a model path that is
    not on disk yet: the load reports it)."""
    if isinstance(model, LoadedModel):
        return None
    from maxjax.aot import prefetch
    from maxjax.models.loader import resolve_model_path
    from maxjax.models.source import as_source
    try:
        return prefetch.request_key(resolve_model_path(model, engine_cfg.quantization_encoding),
                                    engine_cfg, chat_template, as_source(model).options())
    except (UserError, OSError):
        return None


def _from_cache(model, engine_cfg: EngineConfig, limit: int, progress: bool, early=None,
                request: str | None = None):
    """(layout, executables, kv_init) from the compile cache entry of this configuration; on a
    miss, compiled and stored there first. None when it cannot be stored (then the engine
    compiles as without a cache). `early`: the prefetch (maxjax/aot/prefetch.py) this start's
    `request` key found; the entry it loads is recorded under that key."""
    import jax

    from maxjax.aot import cache, export, prefetch
    layout = plan_layout(engine_cfg, model)
    # The sizes this machine gave are pinned, so the loader plans the same layout.
    engine_cfg.num_kv_pages, engine_cfg.max_length = layout.num_pages, layout.max_length
    path = cache.entry_path(model, engine_cfg, layout)
    loaded = cache.load(path, model, engine_cfg, early.take(path) if early else None)
    if request:
        prefetch.remember(cache.directory(), request, path)
    if loaded is not None:
        return loaded
    n = len(layout.buckets) + 1
    if progress:
        log.info("Compiling %d graphs (not in the compile cache yet: storing them in %s)", n,
                 path)
    try:
        with Heartbeat(progress) as beat:
            _, compiled = cache.fill(path, model, engine_cfg, layout,
                                     [jax.export.default_export_platform()], export.default_jobs(),
                                     beat.graph_done if progress else None)
    except OSError as e:
        log.warning("compile cache: cannot write %s (%s); compiling without it", path, e)
        return ()
    cache.evict(limit, keep=path)
    from maxjax.aot import graphs
    return (layout, *graphs.engine_graphs(compiled, model, layout))


class Heartbeat:
    """While active: `graph_done(i, n, name)` logs the progress count; a thread logs
    `Still compiling (N s elapsed)` when no graph finished for HEARTBEAT_SECONDS."""

    def __init__(self, active: bool):
        self.active = active
        self.t0 = self.last = time.perf_counter()
        self._stop = threading.Event()
        self.done = (0, 0)

    def __enter__(self) -> Heartbeat:
        if self.active:
            threading.Thread(target=self._run, name="maxjax-heartbeat", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def graph_done(self, i: int, n: int, name: str) -> None:
        self.last, self.done = time.perf_counter(), (i, n)
        log.info("Compiled %d/%d graphs (%s, %.0f s elapsed)", i, n, name, self.last - self.t0)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            now = time.perf_counter()
            if now - self.last >= HEARTBEAT_SECONDS:
                self.last = now
                log.info("Still compiling (%.0f s elapsed)", now - self.t0)
