"""`maxjax warm-cache`: plan the engine as serve would (maxjax/engine/plan.py) for the first
target platform and write its graphs as artifacts (maxjax/aot/export.py), or into the compile
cache entry that serve, generate and maxjax.LLM with the same model and engine flags load."""
from __future__ import annotations

import os
import shlex
import time

import jax

from maxjax.aot import cache, group
from maxjax.aot.export import DRAFT_DIR, default_jobs, normalize_targets, write_artifacts
from maxjax.aot.load import check_target_arch
from maxjax.engine.build import weights_entry, load, on_devices
from maxjax.engine.config import EngineConfig
from maxjax.engine.pins import Pins
from maxjax.engine.plan import draft_plan, plan_engine, prepare
from maxjax.errors import UserError


def warm_cache(model_opts, flags: EngineConfig, artifacts_dir: str | None,
               targets: list[str] | None, jobs: int | None,
               store_weights: bool | None = None) -> int:
    """Artifacts into `artifacts_dir`; without one, into the compile cache. In a multi-host
    group every process runs it and they write one directory (maxjax/aot/group.py)."""
    platforms, archs = normalize_targets(targets)
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1 (got {jobs})")
    local = jax.export.default_export_platform()
    check_target_arch(archs, "--target")       # a local GPU must be the architecture named
    if artifacts_dir is None and local not in platforms:
        raise UserError(f"--target {' '.join(platforms)}: the compile cache holds graphs for this "
                        f"machine ({local}); pass --artifacts-dir for another machine's")
    if artifacts_dir is None and group.size() > 1:
        raise UserError("--num-processes: a group's warm-cache writes one artifact directory: "
                        "pass --artifacts-dir (a directory every process shares)")
    model, plan = warm_plan(model_opts, flags, platforms)
    kernels = plan.kernels
    t0 = time.perf_counter()
    if artifacts_dir is None:
        directory = cache.entry_path(model, plan)
        data, _ = cache.fill(directory, model, plan, platforms, jobs, replace=True)
        limit = cache.max_bytes(model_opts.compile_cache_max_size)
        cache.evict(limit, keep=directory)
        stored_at = platforms[0] == local and weights_entry(
            model_opts.source(), plan.flags, model_opts.chat_template, kernels, 0)
        if stored_at:       # what serve on this machine would convert: maxjax/aot/weight_cache.py
            from maxjax.aot import weight_cache
            if weight_cache.store(stored_at, model, limit):
                print(f"converted weights stored: {stored_at}")
    else:
        directory = os.path.abspath(artifacts_dir)
        data = write_artifacts(directory, model, plan, platforms, jobs,
                               progress=group.is_leader(), store_weights=store_weights,
                               archs=archs, compile_cache=model_opts.compile_cache,
                               chat_template=model_opts.chat_template)
    if plan.config.speculative_method == "draft":
        _draft_graphs(model, plan, artifacts_dir and os.path.join(directory, DRAFT_DIR), platforms,
                      jobs, archs, model_opts.compile_cache_max_size, model_opts.compile_cache)
    took = time.perf_counter() - t0
    kinds = "exports + executables" if data["compiled_for"] else "exports"
    print(f"wrote {len(data['graphs'])} graphs ({kinds} for {', '.join(platforms)}) in {took:.1f} s")
    print(f"artifacts: {directory}")
    if artifacts_dir is None:
        print("in the compile cache: `maxjax serve` with the same model and engine flags loads them")
    serve = ["maxjax", "serve", "--precompiled-artifacts", directory]     # the rest is pinned
    if group.size() > 1:
        serve += ["--coordinator-address", "HOST:PORT", "--num-processes", str(group.size()),
                  "--process-id", "I"]
    if data.get("weights"):
        print(f"converted weights stored ({data['weights']['bytes'] / 1e6:.0f} MB, orbax)")
    print(f"serve with: {shlex.join(serve)}")
    return 0


def warm_plan(model_opts, flags: EngineConfig, platforms: list[str]):
    """(the placed model, its plan) as serve would make them (maxjax/engine/plan.py), for the
    first target: the machine the graphs are planned for (its defaults, buckets and dtype, its
    attention backend; the other targets get exports of the same graphs). In a group every
    process adopts process 0's pool size and max length."""
    prepared = prepare(flags, platform=platforms[0], platforms=platforms)
    model = load(model_opts.source(), prepared, model_opts.chat_template, progress=True)
    model = on_devices(model, prepared.config, kernels=prepared.kernels)   # replica 0's
    plan = plan_engine(prepared, model)
    pinned = dict(zip(plan.pins, group.from_leader(list(plan.pins.values()))))
    if pinned != plan.pins:
        plan = plan_engine(prepared.adopt(Pins(pinned)), model)
    return model, plan


def _draft_graphs(model, plan, directory: str | None, platforms, jobs, archs, cache_size,
                  compile_cache: bool | None = None) -> None:
    """The draft model's graphs (maxjax/engine/plan.py draft_plan) into `directory` (inside
    the target's artifacts), or into the compile cache (None)."""
    from maxjax.engine import draft
    dmodel = draft.load_draft(plan.config, model, plan.layout.max_length, plan.layout.platform)
    dplan = draft_plan(plan, dmodel)
    if directory is None:
        path = cache.entry_path(dmodel, dplan)
        data, _ = cache.fill(path, dmodel, dplan, platforms, jobs, replace=True)
        cache.evict(cache.max_bytes(cache_size), keep=path)
    else:
        data = write_artifacts(directory, dmodel, dplan, platforms, jobs,
                               progress=group.is_leader(), store_weights=False, archs=archs,
                               compile_cache=compile_cache)
    print(f"draft model: {len(data['graphs'])} graphs in {directory or path}")
