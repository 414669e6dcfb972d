"""Building a ready engine, the one way every entry point does it (`maxjax serve`, maxjax.LLM and so
`maxjax generate`; `maxjax warm-cache` loads its model with `load`):
  1. load the model, its converted weights restored from the precompiled artifacts (onto the
     engine's mesh, maxjax/aot/weights.py) when they store them;
  2. the plan (maxjax/engine/plan.py), from the flags with what the precompiled artifacts pin
     adopted, and its step executables: loaded from those artifacts after checking them against
     the plan; else loaded from the compile cache (maxjax/aot/cache.py), or compiled and stored
     there on a miss; else (the cache off) compiled;
  3. warm-up: every bucket ready, the executables' first-run priming armed (EngineCore.prime_next).
With `progress`, each phase logs one line, compiling a count per graph and `Still compiling
(N s elapsed)` while a long compile gives no other sign of life.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Sequence

from maxjax.engine.config import EngineConfig
from maxjax.engine.core import EngineCore
from maxjax.engine.pins import Pins
from maxjax.engine.plan import (EnginePlan, Prepared, check_mesh_flags, plan_engine, prepare,
                                 replica_mesh)
from maxjax.errors import UserError
from maxjax.models import sampling_defaults
from maxjax.models.sampling_defaults import describe
from maxjax.models.loader import LoadedModel, load_model, read_checkpoint
from maxjax.models.source import ModelSource

log = logging.getLogger("maxjax.engine")
HEARTBEAT_SECONDS = 15.0


def load(model: str | ModelSource | LoadedModel | None, prepared: Prepared,
         chat_template: str | None = None, precompiled_artifacts: Sequence[str] = (),
         progress: bool = False, mesh=None) -> LoadedModel:
    """A LoadedModel as it is; else `model` (a ModelSource, or its path: a GGUF file, a HF
    directory or repo id, None for the embedded default) loaded for the `prepared` start: its
    header read, the plan's encoding chosen from it (`Prepared.with_header`), its weights
    converted to that (maxjax/models/loader.py load_model). With `precompiled_artifacts` that
    store the converted weights for `mesh` (the engine's, `replica_mesh`), they are restored
    onto it instead (maxjax/aot/weights.py). `progress`: a log line (and a loading bar on a
    terminal)."""
    if isinstance(model, LoadedModel):
        return model
    stored = None
    if precompiled_artifacts:
        from maxjax.aot import weights as aot_weights
        stored = aot_weights.params_source(precompiled_artifacts, mesh)
    if progress:
        log.info("Loading weights: %s", getattr(model, "model_path", model)
                 or "the embedded SmolLM2-135M-Instruct")
    header = read_checkpoint(model, prepared.config.quantization_encoding)
    prepared = prepared.with_header(header)
    loaded = load_model(header, prepared.encoding, chat_template,
                        progress=progress and sys.stderr.isatty(), params_source=stored,
                        kernels=prepared.kernels)
    if progress:
        log.info("Loaded %s (%s) in %.1f s", loaded.name, loaded.dtype, loaded.load_seconds)
    return loaded


def build_core(model: str | ModelSource | LoadedModel | None, flags: EngineConfig, *,
               chat_template: str | None = None, precompiled_artifacts: Sequence[str] = (),
               require_compiled: bool = False, progress: bool = False,
               compile_cache: bool | None = None, compile_cache_max_size: str | None = None,
               replica: int = 0, pins: dict | None = None, executor=None,
               prepared: Prepared | None = None) -> EngineCore:
    """A warmed-up EngineCore for the user's `flags`, planned once (maxjax/engine/plan.py;
    `core.plan`). `require_compiled`: refuse artifacts that hold no executable for this
    device. `compile_cache`: False turns the compile cache off (None: on unless
    MAXJAX_NO_COMPILE_CACHE=1); `compile_cache_max_size` its cap (maxjax/aot/cache.py).
    `progress`: log lines for loading and compiling. `replica`: which of the
    --data-parallel-degree device groups (maxjax/engine/devices.py) the engine runs on.
    `pins`: layout values fixed elsewhere (a group's process 0: maxjax/engine/distributed.py).
    `executor`: what the runner's calls go through (ModelRunner; None: this process's own).
    `prepared`: the plan's first half made for these flags already (`prepare_start`)."""
    from maxjax.aot import cache
    clock = Clock()
    if precompiled_artifacts:
        from maxjax.aot import load as aot_load
    # the plan's first half, before the weights load: flags checked once, the kernels (whose
    # library builds once) chosen, since the weights' encoding follows them
    prepared = prepared or prepare_start(flags, precompiled_artifacts)
    if pins:
        prepared = prepared.adopt(Pins(pins))
    plan_seconds = prepared.seconds
    flags, kernels = prepared.config, prepared.kernels
    use_cache = cache.enabled(compile_cache)
    limit = cache.max_bytes(compile_cache_max_size)
    request = _request(model, flags.replace(use_experimental_kernels=kernels), chat_template) \
        if use_cache and not precompiled_artifacts else None
    from maxjax.aot import prefetch
    if precompiled_artifacts:
        early = _early_prefetch(_artifacts_key(precompiled_artifacts)) or (
            flags.data_parallel_degree == 1 and prefetch.of_artifacts(precompiled_artifacts))
    else:
        early = _early_prefetch(request) or (request and prefetch.start(cache.directory(),
                                                                        request))
    try:
        stored_at = weights_entry(model, flags, chat_template, kernels, replica) \
            if use_cache and not precompiled_artifacts else None
        clock.mark("CPU kernels and cache key")
        restored = stored_at and _restore_weights(stored_at, model, progress)
        model = restored or load(model, prepared, chat_template, precompiled_artifacts, progress,
                                 replica_mesh(flags, replica) if precompiled_artifacts else None)
        clock.mark("weights")
        model = on_devices(model, flags, replica, kernels=kernels)
        if stored_at and not restored:
            from maxjax.aot import weight_cache
            weight_cache.store(stored_at, model, limit)
        clock.mark("placing")
        t0 = time.perf_counter()
        loaded = ()
        if precompiled_artifacts:
            arts = aot_load.open_artifacts(precompiled_artifacts, model, flags, require_compiled)
            t_plan = time.perf_counter()
            plan = plan_engine(prepared.adopt(arts.pins, arts.platform), model)
            plan_seconds += time.perf_counter() - t_plan
            loaded = aot_load.load_for_engine(arts, model, plan, require_compiled,
                                              early.take(early.path) if early else None)
        else:
            t_plan = time.perf_counter()
            plan = plan_engine(prepared, model)
            plan_seconds += time.perf_counter() - t_plan
            if use_cache:
                loaded = _from_cache(model, plan, limit, progress, early or None, request)
    except BaseException:
        if early:       # a failed start leaves no deserialization running behind it
            early.take("")
        raise
    clock.mark("graphs")
    drafts = _draft_graphs(precompiled_artifacts, require_compiled, limit if use_cache else None,
                           progress)
    model = dataclasses.replace(model, sampling_defaults=sampling_defaults.read(
        model.source, flags.generation_config, flags.enable_penalties))
    core = EngineCore(model, plan, *loaded, executor=executor, graphs=drafts, replica=replica)
    core.plan_seconds = plan_seconds
    clock.mark("engine and KV pool")
    n = len(core.layout.buckets)
    with Heartbeat(progress and not loaded) as beat:
        if progress and not loaded:
            log.info("Compiling %d step graphs%s", n, "" if use_cache else " (compile cache off)")
        core.warmup(beat.graph_done if progress else None)
    clock.mark("compiling" if not loaded else "warm-up")
    if progress:
        lay = core.layout
        from maxjax.graphs import cpu_kernels
        linear = cpu_kernels.kernels_of(core.model.params)
        kernels = f", {' '.join(linear)} {cpu_kernels.isa()}" if linear else ""
        log.info("Engine ready in %.1f s: %d step graphs (%s attention%s), KV pool of %d %s "
                 "pages of %d tokens, max length %d", time.perf_counter() - t0, n, lay.attention,
                 kernels, lay.num_pages, lay.kv_dtype, lay.page_size, core.max_length)
        if lay.memory_report:
            log.info("%s", lay.memory_report)
        if lay.state_report:
            log.info("%s", lay.state_report)
        log.info("Sampling defaults of requests that leave them out: %s",
                 describe(core.model.sampling_defaults.in_force()))
        if clock.start is not None:
            log.info("Start-up %.1f s from process start: %s", since_process_start(),
                     ", ".join(f"{k} {v:.1f} s" for k, v in clock.phases.items()))
        log.info("Plan made in %.1f ms (flags, kernels, layout and pool; inside the phases "
                 "above)", plan_seconds * 1e3)
    return core


_EARLY: dict = {}


def _artifacts_key(dirs: Sequence[str]) -> str:
    return "artifacts:" + "|".join(os.path.abspath(d) for d in dirs)


def prepare_start(flags: EngineConfig, artifacts: Sequence[str] = ()) -> Prepared:
    """The plan's first half (maxjax/engine/plan.py prepare) for a start on this machine, from
    `artifacts` when given (the kernels as they were built with)."""
    pinned_kernels = None
    if artifacts:
        from maxjax.aot import load as aot_load
        pinned_kernels = aot_load.pinned_kernels(artifacts)
    return prepare(flags, pinned_kernels=pinned_kernels)


def prefetch_early(model, flags: EngineConfig, chat_template: str | None = None,
                   compile_cache: bool | None = None,
                   artifacts: Sequence[str] = ()) -> Prepared | None:
    """The plan's first half for this start (`prepare_start`: build_core takes it, so the flags
    are checked and the kernels chosen once), and the executables it will load (maxjax/aot/
    prefetch.py: the compile cache's entry, or `artifacts`' first directory) deserializing from
    now on, before the caller's own imports (`maxjax serve`'s server); build_core takes them
    over when it asks for the same. Quietly None where the flags are refused (build_core meets
    the same and reports it)."""
    from maxjax.aot import cache, prefetch
    try:
        prepared = prepare_start(flags, artifacts)      # with artifacts: their FFI too
        if flags.data_parallel_degree > 1:
            return prepared
        if artifacts:
            request, started = _artifacts_key(artifacts), prefetch.of_artifacts(artifacts)
        elif not cache.enabled(compile_cache):
            return prepared
        else:
            request = _request(model, prepared.config.replace(
                use_experimental_kernels=prepared.kernels), chat_template)
            started = request and prefetch.start(cache.directory(), request)
    except Exception as e:     # noqa: BLE001: build_core meets the same and says so
        log.debug("early prefetch skipped (%s)", e)
        return None
    if started:
        _EARLY["prefetch"] = (request, started)
    return prepared


def _early_prefetch(request: str | None):
    """`prefetch_early`'s Prefetch when it was for `request`; another is waited for (two
    deserializations at once crash XLA:CPU) and dropped."""
    got = _EARLY.pop("prefetch", None)
    if got is None:
        return None
    key, started = got
    if key == request:
        return started
    started.take("")
    return None


class Clock:
    """A start's phases, end to end from process start: `mark(name)` closes the phase since the
    previous mark (the first: since build_core began; before it, "imports and setup")."""

    def __init__(self):
        self.start = since_process_start()
        self.phases = {"imports and setup": self.start or 0.0}
        self.last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self.last
        self.last = now


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


def on_devices(model: LoadedModel, flags: EngineConfig, replica: int = 0,
               kernels: bool = False) -> LoadedModel:
    """The model with its params on replica `replica`'s mesh of --devices (as it is on one
    device), its quantized matrices packed for the CPU kernels when they run (`kernels`:
    maxjax/engine/plan.py choose_kernels); UserError for what a mesh does not support yet."""
    from maxjax.engine import devices
    mesh = replica_mesh(flags, replica)
    check_mesh_flags(flags, mesh, model.config)
    if kernels:       # one device (choose_kernels): a replica's mesh holds every array whole
        return devices.place_whole(experimental_kernels(model), mesh)
    from maxjax.graphs import cpu_kernels
    if cpu_kernels.kernels_of(model.params):     # weights restored from such artifacts
        raise UserError("the artifacts' stored weights are laid out for --use-experimental-kernels"
                        ": pass it, or recreate the artifacts without it")
    return devices.place_model(model, mesh)


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


def weights_entry(model, flags: EngineConfig, chat_template: str | None, kernels: bool,
                   replica: int) -> str | None:
    """The compile cache's converted-weights entry of this start (maxjax/aot/weight_cache.py);
    None where the store does not apply: a LoadedModel, a mesh, a group, remote code, a model
    path that is not on disk yet (the load reports it)."""
    from maxjax.aot import weight_cache
    from maxjax.models.loader import resolve_model_path
    from maxjax.models.source import as_source
    src = None if isinstance(model, LoadedModel) else as_source(model)
    if src is None or src.trust_remote_code or \
            not weight_cache.usable(replica, replica_mesh(flags, replica)):
        return None
    try:
        path = resolve_model_path(src, flags.quantization_encoding)
        return weight_cache.entry_path(weight_cache.key(
            path, src.options(), chat_template, flags.quantization_encoding, kernels))
    except (UserError, OSError):
        return None


def _restore_weights(path: str, model, progress: bool) -> LoadedModel | None:
    from maxjax.aot import weight_cache
    from maxjax.models.loader import EMBEDDED_NAME
    from maxjax.models.source import as_source
    restored = weight_cache.restore(path, as_source(model).model_path or EMBEDDED_NAME)
    if restored is not None and progress:
        log.info("Loaded %s (%s) in %.1f s (converted weights from the compile cache)",
                 restored.name, restored.dtype, restored.load_seconds)
    return restored


def _draft_graphs(artifacts: Sequence[str], require_compiled: bool, limit: int | None,
                  progress: bool):
    """Where a draft model's graphs come from (maxjax/engine/draft.py): the artifacts' draft
    directories when they have them (`maxjax warm-cache --speculative-method draft`), else the
    compile cache (`limit` None: off, they compile at warm-up)."""
    from maxjax.aot.export import DRAFT_DIR
    dirs = [os.path.join(d, DRAFT_DIR) for d in artifacts]
    if dirs and all(os.path.isdir(d) for d in dirs):
        def from_artifacts(model, plan):
            from maxjax.aot import load as aot_load
            cfg = plan.config
            wrote = ", ".join(os.path.abspath(d) for d in artifacts)
            command = (f"the `maxjax warm-cache` that wrote {wrote}, with "
                       f"--speculative-method draft --draft-model-path {cfg.draft_model_path}")
            arts = aot_load.open_artifacts(dirs, model, cfg, require_compiled, command)
            return aot_load.load_for_engine(arts, model, plan, require_compiled)
        return from_artifacts
    return None if limit is None else (lambda m, p: _from_cache(m, p, limit, progress))


def _from_cache(model, plan: EnginePlan, limit: int, progress: bool, early=None,
                request: str | None = None):
    """(executables, kv_init) from the compile cache entry of this plan; on a miss, compiled
    and stored there first. () when it cannot be stored (then the engine compiles as without a
    cache). `early`: the prefetch (maxjax/aot/prefetch.py) this start's `request` key found;
    the entry it loads is recorded under that key."""
    import jax

    from maxjax.aot import cache, export, prefetch
    path = cache.entry_path(model, plan)
    loaded = cache.load(path, model, plan, early.take(path) if early else None)
    if request:
        prefetch.remember(cache.directory(), request, path)
    if loaded is not None:
        return loaded
    from maxjax.aot import graphs
    n = len(graphs.graph_specs(model, plan.layout))
    if progress:
        log.info("Compiling %d graphs (not in the compile cache yet: storing them in %s)", n,
                 path)
    try:
        with Heartbeat(progress) as beat:
            _, compiled = cache.fill(path, model, plan, [jax.export.default_export_platform()],
                                     export.default_jobs(), beat.graph_done if progress else None)
    except OSError as e:
        log.warning("compile cache: cannot write %s (%s); compiling without it", path, e)
        return ()
    cache.evict(limit, keep=path)
    return graphs.engine_graphs(compiled, model, plan.layout)


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
