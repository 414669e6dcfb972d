"""The artifact manifest: fingerprints of a model, an engine layout, this device and the graph
code, graph signatures, and the checks that run before anything in an artifact directory is
deserialized.

maxjax/aot/ writes and loads artifacts with these; artifacts/FORMAT.md documents the fields.
Nothing here imports or traces model code: a fingerprint reads the loaded model's config,
parameter shapes and tokenizer, a signature is computed from ShapeDtypeStructs, and the code
digest reads source files.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import os
import re
import weakref
from dataclasses import dataclass

import jax
import numpy as np

from maxjax.errors import UserError
from maxjax.graphs import cpu_kernels
from maxjax.graphs.attention import backend_named

log = logging.getLogger("maxjax.aot")

FORMAT_NAME = "maxjax-artifacts"
FORMAT_VERSION = 4
MANIFEST = "manifest.json"


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

    from maxjax.version import __version__
    return {"maxjax": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__}


# XLA flags that change no executable (jax's own compile cache leaves them out of its key too)
_NOT_CODEGEN = ("--xla_force_host_platform_device_count", "--xla_dump")


def codegen_flags() -> list[str]:
    """$XLA_FLAGS that shape the code XLA emits (--xla_cpu_max_isa, optimization levels, ...):
    part of a compile cache key, so an entry compiled under other flags is not reused."""
    return sorted(f for f in os.environ.get("XLA_FLAGS", "").split()
                  if not f.startswith(_NOT_CODEGEN))


# x86 extensions XLA:CPU may emit, as it compiles for the host CPU: an executable built where one
# is present may not run where it is absent
_CPU_ISA = re.compile(r"^(sse|ssse3|avx|fma|f16c|bmi|amx|gfni|vaes|vpclmulqdq|movbe|popcnt|abm|adx)")


def local_device() -> dict:
    """What an executable is compiled for: platform, device kind, runtime version and, on a CPU,
    the vector extensions it has."""
    from maxjax.graphs import cpu_kernels
    dev = jax.devices()[0]
    out = {"platform": jax.export.default_export_platform(), "device_kind": dev.device_kind,
           "platform_version": dev.client.platform_version}
    if out["platform"] == "cpu":
        out["cpu_isa"] = sorted(f for f in cpu_kernels.cpu_flags() if _CPU_ISA.match(f))
    return out


def describe_device(built: dict, local: dict) -> str:
    """`built` (a manifest's compiled_for) in words, naming how it differs from `local`."""
    text = f"{built.get('platform')} {built.get('device_kind')} ({built.get('platform_version')})"
    lacks = sorted(set(built.get("cpu_isa") or ()) - set(local.get("cpu_isa") or ()))
    if lacks:
        text += f", a CPU with {', '.join(lacks)}, which this one lacks"
    elif built.get("cpu_isa") != local.get("cpu_isa"):
        text += ", a CPU with other vector extensions than this one"
    return text


# ---- graph code ----------------------------------------------------------------------------------
# An artifact built from other code is stale even when every shape matches. The code that can
# reach a graph: the modules of maxjax.graphs (the built-in architectures among them), the aot
# module that traces and exports them, and every maxjax module these import, at any depth.
GRAPH_CODE_ROOTS = ("maxjax.graphs", "maxjax.aot.graphs")
# pyproject.toml's package-dir: in the source tree these packages are top-level directories.
SOURCE_DIRS = {"maxjax.graphs": "graphs", "maxjax.server": "server"}


def package_root() -> str:
    """The directory holding this maxjax's sources: the checkout, or site-packages."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module_file(root: str, name: str) -> str | None:
    """The source of module `name` under `root`, installed (maxjax/graphs/...) or source-tree
    (graphs/...) layout; None when it is not a file of the package."""
    parts = name.split(".")
    bases = [os.path.join(root, *parts)]
    for pkg, top in SOURCE_DIRS.items():
        if name == pkg or name.startswith(pkg + "."):
            bases.append(os.path.join(root, top, *parts[len(pkg.split(".")):]))
    for base in bases:
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def _package_modules(root: str, name: str) -> list[str]:
    """`name` and, when it is a package, every module in its directory."""
    path = _module_file(root, name)
    if path is None or os.path.basename(path) != "__init__.py":
        return [name]
    return [name] + [f"{name}.{f[:-3]}" for f in sorted(os.listdir(os.path.dirname(path)))
                     if f.endswith(".py") and f != "__init__.py"]


# An import statement anywhere in a file (in functions, after `;` or `:`): `import a.b, c as d`,
# `from .x import (y, z)` over several lines or continued by a backslash. Read by pattern, not
# parsed (ast.parse of the graph code cost a warm start ~0.1 s): text that only looks like an
# import can add a file, not drop one.
_REST = r"(?:\\\n|[^\n#;\\])*"      # the rest of a statement, over backslash continuations
_IMPORT = re.compile(rf"(?:^|[;:])[ \t]*(?:from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+"
                     rf"(\([^)]*\)|{_REST})|import[ \t]+({_REST}))", re.M)


def _imports(root: str, name: str, path: str) -> set[str]:
    """The maxjax modules a source file imports: for `from A import b`, A.b when it is a
    module, else A."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    package = name if os.path.basename(path) == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for m in _IMPORT.finditer(text):
        base, names, plain = m.groups()
        if plain is not None:
            found.update(n.split()[0] for n in plain.replace("\\", " ").split(",") if n.split())
            continue
        dots = len(base) - len(base.lstrip("."))
        if dots:
            up = package.split(".")[:len(package.split(".")) - dots + 1]
            base = ".".join(up + ([base[dots:]] if base[dots:] else []))
        for n in names.strip("()").replace("\\", " ").split(","):
            if n.split():
                sub = f"{base}.{n.split()[0]}"
                found.add(sub if _module_file(root, sub) else base)
    return {m for m in found if m == "maxjax" or m.startswith("maxjax.")}


def graph_code(root: str) -> dict[str, str]:
    """{module: source file} of the code that can reach a graph (GRAPH_CODE_ROOTS and every
    maxjax module they import), for the package under `root`."""
    todo = [m for r in GRAPH_CODE_ROOTS for m in _package_modules(root, r)]
    files: dict[str, str] = {}
    while todo:
        name = todo.pop()
        path = None if name in files else _module_file(root, name)
        if path is not None:
            files[name] = path
            todo.extend(_imports(root, name, path))
    kernels = files.get("maxjax.graphs.cpu_kernels")
    if kernels:             # the C++ it builds into the graphs' custom calls
        for src in sorted(glob.glob(os.path.join(os.path.dirname(kernels), "kernels", "*.[ch]*"))):
            files[f"maxjax.graphs.kernels/{os.path.basename(src)}"] = src
    return files


def code_digest(root: str | None = None) -> str:
    """sha256 over the graph code (`graph_code`) of the package under `root` (default: this
    one, once a process: a start asks three times), by module name: a checkout and its
    installed copy give the same digest."""
    return _own_code_digest() if root is None else _code_digest(root)


def modules_digest(names: list[str], root: str | None = None) -> str:
    """sha256 over the source of the modules `names` (a package: each module in it)."""
    root = root or package_root()
    h = hashlib.sha256()
    for name in sorted(m for n in names for m in _package_modules(root, n)):
        path = _module_file(root, name)
        if path is not None:
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


@functools.cache
def _own_code_digest() -> str:
    return _code_digest(package_root())


def _code_digest(root: str) -> str:
    h = hashlib.sha256()
    for name, path in sorted(graph_code(root).items()):
        h.update(name.encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()


# ---- fingerprints --------------------------------------------------------------------------------
def tokenizer_digest(tokenizer, chat_template: str | None) -> str:
    h = _vocab_hash(tokenizer) if tokenizer is not None else hashlib.sha256()
    h.update(b"\0template\0" + (chat_template or "").encode())
    return h.hexdigest()


# A start asks two or three times (the cache key, the entry's model check): ~0.1 s each on a
# 49k vocabulary. Nothing adds tokens to a tokenizer once it is loaded.
_VOCAB_HASHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vocab_hash(tokenizer):
    """sha256 fed the tokenizer's vocabulary and special tokens (a copy, to feed on)."""
    try:
        return _VOCAB_HASHES[tokenizer].copy()
    except (KeyError, TypeError):
        pass
    h = hashlib.sha256()
    h.update(canonical(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])))
    h.update(canonical(sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))))
    try:
        _VOCAB_HASHES[tokenizer] = h.copy()
    except TypeError:
        pass
    return h


def weight_signature(params) -> dict:
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return {jax.tree_util.keystr(p): [list(a.shape), str(np.dtype(a.dtype))] for p, a in flat}


def model_fingerprint(model) -> dict:
    """Everything about the model a graph or its tokens depend on; `fingerprint` digests the rest."""
    fp = {"name": model.name, "dtype": model.dtype,
          "config": json.loads(canonical(model.config.to_dict())),
          "weights": weight_signature(model.params),
          "tokenizer_digest": tokenizer_digest(model.tokenizer, model.chat_template)}
    if getattr(model, "vision", None):     # an image encoder's graphs and weights
        fp["vision"] = {"config": json.loads(canonical(model.vision.config.to_dict())),
                        "weights": weight_signature(model.vision.params)}
    kernels = cpu_kernels.kernels_of(model.params)
    if kernels:             # only then: the digest of every other model stays what it was
        fp["kernels"], fp["kernel_isa"] = kernels, cpu_kernels.isa()
    fp["fingerprint"] = digest({k: v for k, v in fp.items() if k != "name"})
    return fp


ENGINE_FIELDS = ("max_length", "max_batch_size", "max_batch_input_tokens", "kv_cache_page_size",
                 "num_kv_pages", "max_pages_per_row", "dtype", "buckets", "lora_slots",
                 "max_lora_rank", "platform", "attention", "kv_cache_format", "mesh", "kernel_isa",
                 "state_slots", "state_pool_dtype")
# engine fingerprint fields a flag chooses but does not set (named in a mismatch)
ENGINE_FLAGS = {"attention": "--use-experimental-kernels",
                "kernel_isa": "the CPU kernels' instruction set: this CPU, or MAXJAX_CPU_ISA"}
# engine fingerprint field -> the flag a user sets it with
FLAGS = {"max_length": "--max-length", "max_batch_size": "--max-batch-size",
         "max_batch_input_tokens": "--max-batch-input-tokens",
         "kv_cache_page_size": "--kv-cache-page-size", "num_kv_pages": "--num-kv-pages",
         "dtype": "--quantization-encoding", "kv_cache_format": "--kv-cache-format",
         "state_slots": "--max-batch-size, --enable-prefix-caching, --num-speculative-tokens",
         "state_pool_dtype": "--state-pool-dtype"}


def engine_fingerprint(layout, engine_cfg, dtype: str) -> dict:
    fp = {"max_length": layout.max_length, "max_batch_size": engine_cfg.max_batch_size,
          "max_batch_input_tokens": engine_cfg.max_batch_input_tokens,
          "kv_cache_page_size": layout.page_size, "num_kv_pages": layout.num_pages,
          "max_pages_per_row": layout.max_pages_per_row, "dtype": dtype,
          "buckets": [[b.num_tokens, b.num_rows, b.num_samples] for b in layout.buckets],
          # the LoRA slot stacks are graph inputs (graphs/lora.py); the adapters themselves are not
          "lora_slots": layout.lora_slots, "max_lora_rank": layout.max_lora_rank,
          # the platform the layout was planned for, and its attention backend
          "platform": layout.platform, "attention": layout.attention,
          "kv_cache_format": layout.kv_dtype,
          # the graphs are sharded over it: its shape and device kind (not which devices)
          "mesh": describe_mesh(layout.mesh)}
    if layout.state_slots:      # a hybrid model's request-state pools (graphs/state.py)
        fp["state_slots"], fp["state_pool_dtype"] = layout.state_slots, layout.state_dtype
    if layout.mtp_layers:       # the steps keep their hidden states for the MTP draft
        fp["mtp_layers"] = layout.mtp_layers
    if backend_named(layout.attention).needs_cpu_kernels:  # its calls are built for one ISA
        fp["kernel_isa"] = cpu_kernels.isa()
    fp["fingerprint"] = digest(fp)
    return fp


def describe_mesh(mesh) -> dict | None:
    if mesh is None:
        return None
    devs = list(mesh.devices.flat)
    return {"shape": dict(mesh.shape), "device_kinds": sorted({d.device_kind for d in devs}),
            "num_processes": len({d.process_index for d in devs})}


# ---- graph signatures ----------------------------------------------------------------------------
def avals(tree) -> list:
    return [[list(a.shape), str(np.dtype(a.dtype))] for a in jax.tree.leaves(tree)]


def flat_in(sig: dict, names: tuple) -> list:
    """The input avals of a signature in calling order, the graph's `arg_names` (JSON objects
    do not keep order)."""
    return [x for n in names for x in sig["in"].get(n, [])]


def signature(args, out_leaves, names: tuple) -> dict:
    """In: per argument (named by the graph's `arg_names`: params, kv, step; logits, sampling;
    params, images), its flat leaves; out: (sample, kv)."""
    return {"in": {n: avals(a) for n, a in zip(names, args)},
            "out": {"sample": avals(out_leaves[0]), "kv": avals(out_leaves[1])}}


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


SEAL = "manifest_sha256"


def _seal(data: dict) -> str:
    """sha256 of the manifest's canonical JSON without its own seal: any other byte changed in
    the file (a value, a key) changes it. A seal, not a signature: it detects damage and edits,
    not someone who rewrites the seal too."""
    return digest({k: v for k, v in json.loads(canonical(data)).items() if k != SEAL})


def write_manifest(directory: str, data: dict) -> str:
    """Write `data` (sealed: its `manifest_sha256` set) as directory/manifest.json."""
    path = os.path.join(directory, MANIFEST)
    tmp = path + ".tmp"
    data[SEAL] = _seal(data)
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
    if data.get(SEAL) != _seal(data):
        raise UserError(f"{path}: manifest fails its {SEAL} check (corrupt or modified); "
                        f"recreate it with: {fix}")
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
    if pinned.get("kernels", []) != have.get("kernels", []):
        built = "with" if pinned.get("kernels") else "without"
        raise UserError(f"{m.path}: model kernels: the artifacts were built {built} "
                        f"--use-experimental-kernels, this run is "
                        f"{'with' if have.get('kernels') else 'without'} it: pass the same, or "
                        f"recreate them with: {fix}")
    if pinned.get("kernel_isa") != have.get("kernel_isa"):
        raise UserError(f"{m.path}: model kernel_isa: the artifacts' CPU kernels are built for "
                        f"{pinned.get('kernel_isa')}, this run's for {have.get('kernel_isa')} "
                        f"(this CPU, or MAXJAX_CPU_ISA): recreate them here with: {fix}")
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
