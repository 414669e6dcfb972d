"""Converted weights stored with the artifacts (orbax-checkpoint), restored straight into the
engine's sharding, so that serving from artifacts converts no checkpoint.

`save` (warm-cache, maxjax/aot/export.py) writes the params pytree as the engine holds it:
converted, in its encoding (float32, bfloat16, int8 / q4 `QuantizedWeight` pytrees) and, on a
mesh, already in the per-device fused layout (graphs/sharding.tensor_parallel_layout) and
sharded, into DIR/weights/ with orbax; in a multi-host group every process writes its own
shards (orbax coordinates them through jax.distributed, so DIR is a directory every process
shares). The manifest's `weights` entry records the tree (each leaf's shape, dtype and
PartitionSpec, QuantizedWeight nodes with their bits), the encoding, the source checkpoint's
digest, the layout degree and the files' names, sizes and sha256s.

`params_source` (maxjax/engine/build.py, through `load_model(params_source=)`) restores it
before anything converts the checkpoint: when the entry is for this source, encoding, model
config and mesh, orbax restores into `jax.ShapeDtypeStruct`s carrying this run's
`NamedSharding`s, so each process reads only its shards. A store for another checkpoint,
encoding or mesh (or none) gives None: the normal load. A store whose files are missing, of
another size, fail their sha256 or that orbax cannot read is a UserError. The files are hashed
on a second thread while orbax restores them (hashlib and tensorstore both release the GIL), and
the params are handed over only once every digest matched; in a group every process hashes
every file (they share the directory).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
import warnings

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from maxjax.aot import manifest as mf
from maxjax.errors import UserError

log = logging.getLogger("maxjax.aot")
WEIGHTS_DIR = "weights"
_HUB_BLOB = "blobs"     # huggingface_hub's cache: snapshots/REV/FILE -> blobs/<sha256 of FILE>


# ---- the source checkpoint -----------------------------------------------------------------------
def source_digest(path: str) -> str | None:
    """sha256 over the checkpoint's weight files: a GGUF, or an HF directory's config.json and
    *.safetensors (a file of the Hugging Face cache is named by its sha256 there: read, not
    hashed again); None for no checkpoint on disk."""
    if not os.path.exists(path):
        return None
    if os.path.isfile(path):
        return mf.file_sha256(path)
    names = sorted(f for f in os.listdir(path) if f == "config.json" or f.endswith(
        (".safetensors", ".safetensors.index.json")))
    h = hashlib.sha256()
    for name in names:
        full = os.path.join(path, name)
        real = os.path.realpath(full)
        blob = os.path.basename(real)
        if os.path.basename(os.path.dirname(real)) == _HUB_BLOB and len(blob) == 64 and \
                name.endswith(".safetensors"):
            digest = blob
        else:
            digest = mf.file_sha256(full)
        h.update(f"{name}\0{digest}\0".encode())
    return h.hexdigest()


# ---- the params pytree as JSON -------------------------------------------------------------------
def describe(tree):
    """The params pytree's structure and leaves (shape, dtype, PartitionSpec on a mesh) as JSON."""
    from maxjax.graphs.quant import QuantizedWeight
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {"dict": {k: describe(v) for k, v in tree.items()}}
    if isinstance(tree, (list, tuple)):
        return {type(tree).__name__: [describe(v) for v in tree]}
    if isinstance(tree, QuantizedWeight):
        return {"quantized": tree.bits, "fields": {f.name: describe(getattr(tree, f.name))
                                                   for f in dataclasses.fields(tree)
                                                   if f.name != "bits"}}
    s = getattr(tree, "sharding", None)
    spec = [list(p) if isinstance(p, tuple) else p for p in s.spec] \
        if isinstance(s, NamedSharding) else None
    return {"array": [list(tree.shape), str(np.dtype(tree.dtype)), spec]}


def abstract(desc, mesh):
    """`describe`'s tree of ShapeDtypeStructs, sharded on `mesh` (None: this process's first
    device). ValueError when the description does not fit."""
    from maxjax.graphs.quant import QuantizedWeight
    if desc is None:
        return None
    if "dict" in desc:
        return {k: abstract(v, mesh) for k, v in desc["dict"].items()}
    for kind in (list, tuple):
        if kind.__name__ in desc:
            return kind(abstract(v, mesh) for v in desc[kind.__name__])
    if "quantized" in desc:
        return QuantizedWeight(**{k: abstract(v, mesh) for k, v in desc["fields"].items()},
                               bits=int(desc["quantized"]))
    shape, dtype, spec = desc["array"]
    if (spec is None) != (mesh is None):
        raise ValueError("stored for another mesh")
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if mesh is None else \
        NamedSharding(mesh, PartitionSpec(*(tuple(p) if isinstance(p, list) else p for p in spec)))
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)


# ---- writing -------------------------------------------------------------------------------------
def stored(flag: bool | None) -> bool:
    """Whether warm-cache stores the weights (--store-weights / --no-store-weights): on unless
    told, on a mesh (each process then restores only its shards) as on one device, where it
    was measured on SmolLM2 (BENCHMARKS.md, Stored weights with orbax): restoring beat
    converting the GGUF in every run, int8 (its default encoding) 3.25 -> 2.65 s of serve's
    weight phase, float32 3.4 -> 3.2 s, for 121 / 353 MB of disk (zstd) and ~1 s of
    warm-cache."""
    return flag is not False


def _checkpointer():
    import orbax.checkpoint as ocp
    # Naming the processes makes orbax's barriers those of the jax.distributed client; by
    # default they are a collective (multihost_utils.sync_global_devices), which compiles a
    # program in every process of a group that serves from artifacts.
    opts = ocp.options.MultiprocessingOptions(
        active_processes=set(range(jax.process_count())) if jax.process_count() > 1 else None)
    return ocp.Checkpointer(ocp.StandardCheckpointHandler(multiprocessing_options=opts),
                            multiprocessing_options=opts)


def save(directory: str, model) -> dict:
    """Write the model's params (as the engine holds them) into directory/weights (every process
    of a group calls it); the manifest entry."""
    import orbax.checkpoint as ocp
    from maxjax.graphs.sharding import params_mesh
    t0 = time.perf_counter()
    path = os.path.join(os.path.abspath(directory), WEIGHTS_DIR)
    _checkpointer().save(path, args=ocp.args.StandardSave(model.params))
    mesh = params_mesh(model.params)
    cfg = model.config
    entry = {"path": WEIGHTS_DIR, "dtype": model.dtype, "tree": describe(model.params),
             "source_name": os.path.basename(model.source.rstrip("/")),
             "source_sha256": source_digest(model.source),
             "degree": 1 if mesh is None else mesh.size,
             "qkv_shards": cfg.qkv_shards, "gate_up_shards": cfg.gate_up_shards,
             "files": _files(path)}
    entry["bytes"] = sum(f["bytes"] for f in entry["files"].values())
    log.info("stored the converted weights (%.0f MB) in %s in %.1f s", entry["bytes"] / 1e6,
             path, time.perf_counter() - t0)
    return entry


def _files(path: str, digests: bool = True) -> dict[str, dict]:
    """{relative path: {bytes, sha256}} of every file under `path` (sha256 with `digests`)."""
    out = {}
    for base, _, names in os.walk(path):
        for n in names:
            full = os.path.join(base, n)
            out[os.path.relpath(full, path)] = {"bytes": os.path.getsize(full)}
            if digests:
                out[os.path.relpath(full, path)]["sha256"] = mf.file_sha256(full)
    return dict(sorted(out.items()))


# ---- restoring -----------------------------------------------------------------------------------
def params_source(dirs, mesh=None):
    """A `load_model(params_source=...)` hook: (config, params) restored onto `mesh` (None: one
    device) when an artifact directory stores them for this source, encoding, config and mesh,
    else None (load and convert as usual)."""
    dirs = [dirs] if isinstance(dirs, str) else list(dirs)

    def load(arch, cfg, dtype: str, source: str):
        for d in dirs:
            try:
                m = mf.read_manifest(os.path.abspath(d), "maxjax warm-cache")
            except UserError:
                return None         # open_artifacts reports the problem with the full command
            entry = m.data.get("weights")
            reason = entry and _mismatch(m, entry, cfg, dtype, source, mesh)
            if entry and not reason:
                return restore(m, entry, cfg, mesh)
            if entry:
                log.info("%s: stored weights not used (%s); converting %s", d, reason, source)
        return None
    return load


def _mismatch(m: mf.Manifest, entry: dict, cfg, dtype: str, source: str, mesh) -> str | None:
    """Why the store does not stand in for this load; None when it does."""
    if entry.get("dtype") != dtype:
        return f"encoding {entry.get('dtype')}, this run {dtype}"
    degree = 1 if mesh is None else mesh.size
    if entry.get("degree") != degree:
        return f"laid out for {entry.get('degree')} devices, this run {degree}"
    if m.data.get("engine", {}).get("mesh") != mf.describe_mesh(mesh):
        return "stored for another mesh"
    if json.loads(mf.canonical(_laid_out(entry, cfg).to_dict())) != \
            m.data.get("model", {}).get("config"):
        return "another model config"
    digest = source_digest(source)
    if digest is None or entry.get("source_sha256") != digest:
        return "converted from another checkpoint"
    return None


def _laid_out(entry: dict, cfg):
    """The config as the stored params are laid out (graphs/sharding.tensor_parallel_layout)."""
    return dataclasses.replace(cfg, qkv_shards=entry.get("qkv_shards", 1),
                               gate_up_shards=entry.get("gate_up_shards", 1))


def _hash_all(path: str, names) -> tuple[dict, float]:
    t0 = time.perf_counter()
    return {n: mf.file_sha256(os.path.join(path, n)) for n in names}, time.perf_counter() - t0


def _quiet_failed_restore() -> None:
    """A failed orbax restore leaves its other reads running against the event loop it closed:
    each reports "Event loop is closed" (sys.unraisablehook), its task's error ("Task
    exception was never retrieved", asyncio's logger) or a coroutine never awaited: hundreds of
    tracebacks around the one line that names the damaged file. Those are dropped from here on;
    nothing else."""
    if getattr(sys.unraisablehook, "maxjax_quiet", False):
        return
    previous = sys.unraisablehook

    def hook(u):
        if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) ==
                "Event loop is closed"):
            previous(u)
    hook.maxjax_quiet = True
    sys.unraisablehook = hook
    warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
    logging.getLogger("asyncio").addFilter(
        lambda r: not (r.msg.startswith("Task exception was never retrieved") and
                       "orbax" in r.getMessage()) if isinstance(r.msg, str) else True)


def restore(m: mf.Manifest, entry: dict, cfg, mesh):
    """(config laid out as stored, params on `mesh`) from the store `entry` of manifest `m`."""
    import orbax.checkpoint as ocp
    t0 = time.perf_counter()
    path = m.file(entry.get("path", WEIGHTS_DIR))
    fix = "recreate the artifacts with maxjax warm-cache"
    root = os.path.realpath(m.directory)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise UserError(f"{m.path}: stored weights path {entry.get('path')!r} leaves the "
                        "artifact directory")
    listed = entry.get("files") or {}
    have = _files(path, digests=False) if os.path.isdir(path) else {}
    # A file the manifest does not list is not read: OCDBT reads what its (hashed) manifest names.
    for name, want in listed.items():
        if not isinstance(want, dict) or have.get(name, {}).get("bytes") != want.get("bytes"):
            why = "missing" if name not in have else "of another size"
            raise UserError(f"{m.path}: stored weights file {WEIGHTS_DIR}/{name} is {why}; {fix}")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hashed = pool.submit(_hash_all, path, listed)
        try:
            target = abstract(entry["tree"], mesh)
            params = _checkpointer().restore(path, args=ocp.args.StandardRestore(target))
            error = None
        except Exception as e:      # whatever orbax / tensorstore found wrong in the files
            params, error = None, e
            _quiet_failed_restore()
        digests, hash_seconds = hashed.result()
    for name, want in listed.items():       # a damaged file is named, whatever orbax made of it
        if digests[name] != want.get("sha256"):
            raise UserError(f"{m.path}: stored weights file {WEIGHTS_DIR}/{name} fails its "
                            f"sha256 check (corrupt or modified); {fix}")
    if error is not None:
        msg = " ".join(str(error).split())[:200]
        raise UserError(f"{m.path}: stored weights in {WEIGHTS_DIR}/ cannot be restored "
                        f"({type(error).__name__}: {msg}); {fix}")
    if mf.weight_signature(params) != m.data.get("model", {}).get("weights"):
        raise UserError(f"{m.path}: stored weights do not match the manifest's weight shapes; "
                        f"{fix}")
    log.info("restored the stored weights from %s in %.2f s (every file's sha256 checked "
             "alongside: %.2f s)", path, time.perf_counter() - t0, hash_seconds)
    return _laid_out(entry, cfg), params
