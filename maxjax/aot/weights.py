"""Converted weights stored beside the graph artifacts, so a GGUF is not dequantized again.
Opt-in (`MAXJAX_ARTIFACT_WEIGHTS=1 maxjax warm-cache ...`): it did not pay off when measured.

Measured (tools/bench_startup.py, SmolLM2 f32, default buckets, shared 2-core CPU): GGUF
dequantization 2.4-3.0 s at load average ~3, against 2.9 s for the stored 538 MB file (its
sha256, the GGUF's sha256 that ties it to its source, reading, device_put); only under heavy
load (average ~7) did it win, 4.0 s -> 2.2 s in-process. Only GGUF sources are stored: an HF
safetensors checkpoint already loads without conversion. A different GGUF file, or another
dtype, just loads the normal way.

maxjax/aot/ calls `save` from warm-cache; maxjax/models/loader.py calls the `params_source` that
serve.py / llm.py build with `params_source(dirs)` when --precompiled-artifacts is given.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time

import jax
import numpy as np

from maxjax.aot import manifest as mf
from maxjax.errors import UserError

log = logging.getLogger("maxjax.aot")
WEIGHTS_FILE = "params.safetensors"


def _source_digest(path: str) -> str:
    return mf.file_sha256(path)


def save(directory: str, model) -> dict | None:
    """Write the model's params (as loaded: converted, in its dtype); the manifest entry or None."""
    from maxjax.models.quantize import is_quantized
    if not (os.path.isfile(model.source) and model.source.endswith(".gguf")) or \
            is_quantized(model.dtype):      # quantized weights load fast from the GGUF
        return None
    from safetensors.numpy import save_file
    flat, _ = jax.tree_util.tree_flatten_with_path(model.params)
    arrays = {jax.tree_util.keystr(p): np.asarray(jax.device_get(a)) for p, a in flat}
    if any(a.dtype == jax.numpy.bfloat16 for a in arrays.values()):
        return None                 # numpy safetensors has no bfloat16: GPU runs convert instead
    path = os.path.join(directory, WEIGHTS_FILE)
    save_file(arrays, path)
    return {"path": WEIGHTS_FILE, "sha256": mf.file_sha256(path), "bytes": os.path.getsize(path),
            "dtype": model.dtype, "source_sha256": _source_digest(model.source),
            "source_name": os.path.basename(model.source)}


def params_source(dirs):
    """A `load_model(params_source=...)` hook: the stored params when an artifact directory holds
    them for this very source file and dtype, else None (load and convert as usual)."""
    dirs = [dirs] if isinstance(dirs, str) else list(dirs)

    def load(arch, cfg, dtype: str, source: str):
        for d in dirs:
            try:
                m = mf.read_manifest(os.path.abspath(d), "maxjax warm-cache")
            except UserError:
                return None         # load_for_engine reports the problem with the full command
            entry = m.data.get("weights")
            if not entry or entry.get("dtype") != dtype or not os.path.isfile(source):
                continue
            if entry.get("source_sha256") != _source_digest(source):
                log.info("%s: stored weights are for another checkpoint; converting %s", d, source)
                continue
            return _load(m, entry, cfg)
        return None
    return load


def _nest(flat: dict):
    """{"['layers'][0]['wo']": array, ...} -> {"layers": [{"wo": array}, ...]}: the params pytree
    (nested dicts and lists) rebuilt from its `keystr` paths, checked by flattening it again."""
    tree: dict = {}
    for key, value in flat.items():
        path = [k if k else int(i) for k, i in re.findall(r"\['([^']*)'\]|\[(\d+)\]", key)]
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value

    def lists(node):
        if not isinstance(node, dict):
            return node
        if node and all(isinstance(k, int) for k in node):
            return [lists(node[i]) for i in range(len(node))]
        return {k: lists(v) for k, v in node.items()}
    out = lists(tree)
    flat_again = jax.tree_util.tree_flatten_with_path(out)[0]
    if sorted(jax.tree_util.keystr(p) for p, _ in flat_again) != sorted(flat):
        raise UserError("stored weights: their names do not form a params pytree; recreate the "
                        "artifacts with maxjax warm-cache")
    return out


def _load(m: mf.Manifest, entry: dict, cfg):
    from safetensors.numpy import load_file
    t0 = time.perf_counter()
    if mf.canonical(m.data.get("model", {}).get("config")) != mf.canonical(
            json.loads(mf.canonical(cfg.to_dict()))):
        return None             # another model: load_for_engine names the differing field
    path = m.file(entry["path"])
    if not os.path.isfile(path) or mf.file_sha256(path) != entry["sha256"]:
        raise UserError(f"{m.path}: stored weights {entry['path']} are missing or fail their sha256 "
                        "check; recreate the artifacts with maxjax warm-cache")
    arrays = load_file(path)
    want = m.data.get("model", {}).get("weights", {})
    have = {k: [list(a.shape), str(a.dtype)] for k, a in arrays.items()}
    if have != want:
        raise UserError(f"{m.path}: stored weights do not match the manifest's weight shapes; "
                        "recreate the artifacts with maxjax warm-cache")
    params = _nest({k: jax.device_put(a) for k, a in arrays.items()})
    log.info("loaded stored weights from %s in %.2f s", path, time.perf_counter() - t0)
    return params
