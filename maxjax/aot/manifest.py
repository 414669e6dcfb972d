"""The artifact manifest: fingerprints of a model and an engine layout, graph signatures, and the
checks that run before anything in an artifact directory is deserialized.

maxjax/aot/ writes and loads artifacts with these; artifacts/FORMAT.md documents the fields.
Nothing here imports or traces model code: a fingerprint reads the loaded model's config,
parameter shapes and tokenizer, and a signature is computed from ShapeDtypeStructs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

import jax
import numpy as np

from maxjax.errors import UserError

log = logging.getLogger("maxjax.aot")

FORMAT_NAME = "maxjax-artifacts"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Source files whose code ends up in a step graph: an artifact built from other code is stale
# even when every shape matches.
_GRAPH_CODE = ("graphs", "maxjax/engine/runner.py",
               "maxjax/aot/")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_jsonable).encode()


def _jsonable(o):
    if isinstance(o, tuple):
        return list(o)
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    return str(o)


def digest(obj) -> str:
    return hashlib.sha256(canonical(obj)).hexdigest()


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def versions() -> dict:
    import jaxlib

    from maxjax import __version__
    return {"maxjax": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__}


def code_digest() -> str:
    """sha256 over the sources that define the step graphs (graphs/, sampling, runner, aot)."""
    h = hashlib.sha256()
    for rel in _GRAPH_CODE:
        path = os.path.join(_ROOT, rel)
        if not os.path.exists(path):       # graphs/ is installed as maxjax.graphs
            import maxjax.graphs as g
            path = os.path.dirname(g.__file__) if rel == "graphs" else path
        files = ([os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".py")]
                 if os.path.isdir(path) else [path])
        for fp in files:
            h.update(os.path.basename(fp).encode() + b"\0")
            with open(fp, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


# ---- fingerprints --------------------------------------------------------------------------------
def tokenizer_digest(tokenizer, chat_template: str | None) -> str:
    h = hashlib.sha256()
    if tokenizer is not None:
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        h.update(canonical(vocab))
        h.update(canonical(sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))))
    h.update(b"\0template\0" + (chat_template or "").encode())
    return h.hexdigest()


def weight_signature(params) -> dict:
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return {jax.tree_util.keystr(p): [list(a.shape), str(np.dtype(a.dtype))] for p, a in flat}


def model_fingerprint(model) -> dict:
    """Everything about the model a graph or its tokens depend on; `fingerprint` digests the rest."""
    fp = {"name": model.name, "dtype": model.dtype,
          "config": json.loads(canonical(model.config.to_dict())),
          "weights": weight_signature(model.params),
          "tokenizer_digest": tokenizer_digest(model.tokenizer, model.chat_template)}
    fp["fingerprint"] = digest({k: v for k, v in fp.items() if k != "name"})
    return fp


ENGINE_FIELDS = ("max_length", "max_batch_size", "max_batch_input_tokens", "kv_cache_page_size",
                 "num_kv_pages", "max_pages_per_row", "dtype", "buckets")
# engine fingerprint field -> the flag a user sets it with
FLAGS = {"max_length": "--max-length", "max_batch_size": "--max-batch-size",
         "max_batch_input_tokens": "--max-batch-input-tokens",
         "kv_cache_page_size": "--kv-cache-page-size", "num_kv_pages": "--num-kv-pages",
         "dtype": "--quantization-encoding"}


def engine_fingerprint(layout, engine_cfg, dtype: str) -> dict:
    fp = {"max_length": layout.max_length, "max_batch_size": engine_cfg.max_batch_size,
          "max_batch_input_tokens": engine_cfg.max_batch_input_tokens,
          "kv_cache_page_size": layout.page_size, "num_kv_pages": layout.num_pages,
          "max_pages_per_row": layout.max_pages_per_row, "dtype": dtype,
          "buckets": [[b.num_tokens, b.num_rows] for b in layout.buckets]}
    fp["fingerprint"] = digest(fp)
    return fp


# ---- graph signatures ----------------------------------------------------------------------------
def avals(tree) -> list:
    return [[list(a.shape), str(np.dtype(a.dtype))] for a in jax.tree.leaves(tree)]


ARG_NAMES = ("params", "kv", "step", "sampling")


def flat_in(sig: dict) -> list:
    """The input avals of a signature in calling order (JSON objects do not keep order)."""
    return [x for n in ARG_NAMES for x in sig["in"][n]]


def signature(args, out_leaves) -> dict:
    """In: per step argument (params, kv, step, sampling), its flat leaves; out: (sample, kv)."""
    sig = {"in": {n: avals(a) for n, a in zip(ARG_NAMES, args)},
           "out": {"sample": avals(out_leaves[0]), "kv": avals(out_leaves[1])}}
    return sig


# ---- step output structure ---------------------------------------------------------------------
def tree_spec(tree):
    """A JSON description of a step output's structure (tuples, lists, None and NamedTuples of
    maxjax), from which `rebuild` puts the flat output leaves back without tracing anything."""
    if tree is None:
        return None
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        cls = type(tree)
        return {"namedtuple": f"{cls.__module__}:{cls.__qualname__}",
                "children": [tree_spec(x) for x in tree]}
    if isinstance(tree, (tuple, list)):
        return {type(tree).__name__: [tree_spec(x) for x in tree]}
    if isinstance(tree, dict):
        return {"dict": {k: tree_spec(v) for k, v in sorted(tree.items())}}
    return "leaf"


def rebuild(spec, leaves):
    """Inverse of `tree_spec` over an iterator of leaves."""
    if spec is None:
        return None
    if spec == "leaf":
        return next(leaves)
    if "namedtuple" in spec:
        import importlib
        module, name = spec["namedtuple"].split(":")
        if not module.startswith("maxjax."):
            raise UserError(f"artifact output type {spec['namedtuple']} is not a maxjax type")
        cls = getattr(importlib.import_module(module), name)
        return cls(*(rebuild(c, leaves) for c in spec["children"]))
    if "tuple" in spec or "list" in spec:
        kind = tuple if "tuple" in spec else list
        return kind(rebuild(c, leaves) for c in spec[kind.__name__])
    return {k: rebuild(v, leaves) for k, v in spec["dict"].items()}


def spec_leaves(spec) -> int:
    if spec is None:
        return 0
    if spec == "leaf":
        return 1
    children = (spec.get("children") or spec.get("tuple") or spec.get("list")
                or list(spec.get("dict", {}).values()))
    return sum(spec_leaves(c) for c in children)


# ---- manifest I/O and checks ---------------------------------------------------------------------
@dataclass
class Manifest:
    path: str
    data: dict

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path)

    def file(self, rel: str) -> str:
        return os.path.join(self.directory, rel)


def write_manifest(directory: str, data: dict) -> str:
    path = os.path.join(directory, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True, default=_jsonable)
        f.write("\n")
    os.replace(tmp, path)
    return path


def read_manifest(directory: str, fix: str) -> Manifest:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise UserError(f"--precompiled-artifacts {directory}: no such directory (create it with: {fix})")
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: missing; not an artifact directory (create it with: {fix})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: manifest is not valid JSON ({e}); recreate it with: {fix}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise UserError(f"{path}: not a maxjax artifact manifest; recreate it with: {fix}")
    if data.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: format_version {data.get('format_version')!r}, this maxjax reads "
                        f"{FORMAT_VERSION}; recreate it with: {fix}")
    return Manifest(path, data)


def check_versions(m: Manifest, fix: str, executables: bool) -> None:
    """maxjax and the graph code must match; jax/jaxlib must match where this run would load
    compiled executables (they are tied to one build). Exports alone may cross jax versions:
    jax.export's calling convention is versioned and `deserialize` refuses what it cannot read."""
    have, pinned = versions(), m.data.get("versions", {})
    for k, v in have.items():
        if pinned.get(k) == v:
            continue
        if k == "maxjax" or executables:
            raise UserError(f"{m.path}: built with {k} {pinned.get(k)}, this is {k} {v}; "
                            f"recreate the artifacts with: {fix}")
        log.warning("%s: exports built with %s %s, this is %s; jax.export keeps them loadable",
                    m.path, k, pinned.get(k), v)
    if m.data.get("code_digest") != code_digest():
        raise UserError(f"{m.path}: built from other graph code (code_digest differs from this "
                        f"maxjax checkout); recreate the artifacts with: {fix}")


def check_model(m: Manifest, model, fix: str) -> None:
    pinned, have = m.data.get("model", {}), model_fingerprint(model)
    # field by field (not the stored digest alone), so an edited manifest cannot pass
    if pinned.get("dtype") != have["dtype"]:
        raise UserError(f"{m.path}: model dtype: artifacts {pinned.get('dtype')}, this run "
                        f"{have['dtype']} (pass --quantization-encoding {pinned.get('dtype')} or "
                        f"recreate with: {fix})")
    pc, hc = pinned.get("config", {}), have["config"]
    for k in sorted(set(pc) | set(hc)):
        if pc.get(k) != hc.get(k):
            raise UserError(f"{m.path}: model config field {k}: artifacts {pc.get(k)!r}, this "
                            f"model {hc.get(k)!r}; recreate the artifacts with: {fix}")
    pw, hw = pinned.get("weights", {}), have["weights"]
    for k in sorted(set(pw) | set(hw)):
        if pw.get(k) != hw.get(k):
            raise UserError(f"{m.path}: model weight {k}: artifacts {pw.get(k)}, this model "
                            f"{hw.get(k)}; recreate the artifacts with: {fix}")
    if pinned.get("tokenizer_digest") != have["tokenizer_digest"]:
        raise UserError(f"{m.path}: model tokenizer or chat template differs from the one the "
                        f"artifacts were built with; recreate them with: {fix}")
    if pinned.get("fingerprint") != have["fingerprint"]:
        raise UserError(f"{m.path}: model fingerprint differs; recreate the artifacts with: {fix}")


def check_files(m: Manifest, fix: str) -> None:
    """Every file the manifest lists exists, lies inside the directory and has its sha256."""
    root = os.path.realpath(m.directory)
    for g in m.data.get("graphs", []):
        for kind, entry in g.get("files", {}).items():
            rel = entry.get("path", "")
            path = os.path.realpath(m.file(rel))
            if not rel or os.path.commonpath([root, path]) != root:
                raise UserError(f"{m.path}: graph {g.get('name')}: {kind} path {rel!r} leaves the "
                                f"artifact directory")
            if not os.path.isfile(path):
                raise UserError(f"{m.path}: graph {g.get('name')}: {kind} file {rel} is missing; "
                                f"recreate the artifacts with: {fix}")
            if file_sha256(path) != entry.get("sha256"):
                raise UserError(f"{m.path}: graph {g.get('name')}: {kind} file {rel} fails its "
                                f"sha256 check (corrupt or modified); recreate it with: {fix}")
