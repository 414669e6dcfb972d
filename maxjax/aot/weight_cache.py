"""Converted weights in the compile cache: a warm start reads them instead of converting the
checkpoint again.

A start on one device that converts its checkpoint (maxjax/engine/build.py) stores what it
made: the params pytree as the engine holds it (encoded, packed for the CPU kernels), the
tokenizer (`save_pretrained`) and the model config, as a cache entry of its own,
`$MAXJAX_CACHE_DIR/weights-<key>`. The key is known before anything loads: the checkpoint's
files (names, sizes, modification times), the source flags, the chat template, the
--quantization-encoding, whether the CPU kernels run, the versions, the conversion and graph
code, and the device. The entry is one file of raw arrays (`params.bin`, each leaf at a
64-byte-aligned offset) and the tokenizer's files, every one listed with its sha256 in the
sealed manifest; `restore` hashes what it reads and hands the params over only when every
digest matched. An entry that fails a check is removed with a warning and the checkpoint is
converted as usual: never loaded, never fatal. Entries count against the cache's size cap and
are evicted like compiled ones (maxjax/aot/cache.py); weights over a quarter of the cap are not
stored.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import logging
import os
import shutil
import time

import jax
import numpy as np

from maxjax.aot import cache, group
from maxjax.aot import manifest as mf
from maxjax.aot.weights import abstract, describe

log = logging.getLogger("maxjax.cache")
PREFIX = "weights-"
PARAMS = "params.bin"
TOKENIZER = "tokenizer"
KIND = cache.WEIGHTS_KIND
_ALIGN = 64
_FIX = "maxjax serve (it converts the checkpoint and stores the entry again)"


@functools.cache
def conversion_code_digest() -> str:
    """The graph code (which holds each architecture's conversion) and maxjax.models (readers,
    quantization) together."""
    return mf.digest([mf.code_digest(), mf.modules_digest(["maxjax.models",
                                                            "maxjax.aot.weight_cache"])])


def key(model_path: str, source: dict, chat_template: str | None, encoding: str | None,
        kernels: bool) -> str:
    """The entry's key: what the conversion's output depends on, known before it runs."""
    from maxjax.aot import prefetch
    from maxjax.graphs import cpu_kernels
    chat_template = chat_template and os.path.realpath(chat_template)   # however it was typed
    return mf.digest({"model": [model_path, prefetch.file_stats(model_path), source],
                      "chat_template": [chat_template, chat_template and
                                        prefetch.file_stats(chat_template)], "encoding": encoding, "kernels": kernels,
                      "versions": mf.versions(), "code": conversion_code_digest(),
                      "device": mf.local_device(), "kernel_isa": cpu_kernels.isa()})[:32]


def entry_path(entry_key: str, root: str | None = None) -> str:
    return os.path.join(root or cache.directory(), PREFIX + entry_key)


def usable(replica: int, mesh) -> bool:
    """Whether this start may use the store: one device, one process, replica 0."""
    return mesh is None and replica == 0 and group.size() == 1


# ---- writing -------------------------------------------------------------------------------------
def store(path: str, model, limit: int) -> bool:
    """Write `model` (a LoadedModel as the engine holds it, on one device) into the entry at
    `path`; False (nothing written) for what the store does not hold: an image encoder, weights
    over a quarter of `limit`, a tokenizer or config that does not round-trip."""
    tok = model.tokenizer
    if model.vision is not None or os.path.isdir(path) or \
            (tok is not None and not type(tok).__module__.startswith("transformers.")):
        return False
    leaves = jax.tree.leaves(model.params)
    total = sum(int(a.nbytes) for a in leaves)
    if total > limit // 4:
        log.info("compile cache: converted weights (%.1f GB) not stored: over a quarter of the "
                 "cap (%.1f GB)", total / 1e9, limit / 1e9)
        return False
    config = json.loads(mf.canonical(model.config.to_dict()))
    if _config(type(model.config), config) != model.config:
        return False
    t0 = time.perf_counter()
    tmp = cache.new_tmp(os.path.dirname(path))
    try:
        if tok is not None:
            _save_tokenizer(tok, os.path.join(tmp, TOKENIZER))
        offsets, h = [], hashlib.sha256()
        with open(os.path.join(tmp, PARAMS), "wb") as f:
            for a in leaves:
                pad = -f.tell() % _ALIGN
                f.write(b"\0" * pad)
                h.update(b"\0" * pad)
                offsets.append(f.tell())
                data = np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)
                f.write(data)
                h.update(data)
        files = {rel: {"bytes": os.path.getsize(os.path.join(tmp, rel)),
                       "sha256": mf.file_sha256(os.path.join(tmp, rel))}
                 for rel in _tokenizer_files(tmp)}
        files[PARAMS] = {"bytes": os.path.getsize(os.path.join(tmp, PARAMS)),
                         "sha256": h.hexdigest()}
        mf.write_manifest(tmp, {
            "format": mf.FORMAT_NAME, "format_version": mf.FORMAT_VERSION, "kind": KIND,
            "compiled_for": mf.local_device(), "graphs": [],
            "model": {"name": model.name, "served_name": model.served_name,
                      "source": model.source, "dtype": model.dtype,
                      "architecture": model.arch.name, "config": config,
                      "chat_template": model.chat_template,
                      "tokenizer_class": tok and [type(tok).__module__, type(tok).__name__],
                      "tokenizer_digest": mf.tokenizer_digest(tok, None)},
            "tree": describe(model.params), "offsets": offsets, "files": files})
        if not cache.publish(tmp, path):
            return False
        cache.evict(limit, keep=path)
    except OSError as e:
        log.warning("compile cache: cannot store the converted weights in %s (%s)", path, e)
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("compile cache: stored the converted weights (%.0f MB) in %s in %.1f s",
             total / 1e6, path, time.perf_counter() - t0)
    return True


def _save_tokenizer(tok, path: str) -> None:
    """`save_pretrained`, and the added tokens in tokenizer_config.json: without them,
    from_pretrained parses the whole tokenizer.json in Python for its added tokens before the
    tokenizers library parses it again (0.06 s of a 0.14 s load on SmolLM2's 3.5 MB)."""
    tok.save_pretrained(path)
    config = os.path.join(path, "tokenizer_config.json")
    added = getattr(tok, "added_tokens_decoder", None)
    if not added or not os.path.isfile(config):
        return
    with open(config, encoding="utf-8") as f:
        data = json.load(f)
    data.setdefault("added_tokens_decoder", {str(i): t.__getstate__() for i, t in added.items()})
    with open(config, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)


def _tokenizer_files(root: str) -> list[str]:
    base = os.path.join(root, TOKENIZER)
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, _, names in os.walk(base) for n in names)


def _config(cls, data: dict):
    """The ModelConfig of its `to_dict` as JSON (lists back to the tuples they were)."""
    def tuples(v):
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v
    return cls(**{k: tuples(v) for k, v in data.items()})


# ---- restoring -----------------------------------------------------------------------------------
def restore(path: str, served_name: str):
    """The LoadedModel stored at `path` with its params on this process's first device; None
    when there is no entry, or when it fails a check (it is then removed, with a warning)."""
    if not os.path.isdir(path):
        return None
    t0 = time.perf_counter()
    try:
        model = _restore(path, served_name)
    except Exception as e:     # a bad entry is rebuilt, whatever broke in it
        log.warning("compile cache: converted weights %s refused (%s); removing them and "
                    "converting the checkpoint", os.path.basename(path),
                    " ".join(str(e).split())[:300])
        cache.remove(path)
        return None
    cache.touch(path)
    model.load_seconds = time.perf_counter() - t0
    log.info("compile cache: read the converted weights from %s in %.2f s (every file's sha256 "
             "checked)", path, model.load_seconds)
    return model


def _restore(path: str, served_name: str):
    from maxjax.graphs.config import ModelConfig
    from maxjax.models import registry
    from maxjax.models.loader import LoadedModel
    m = mf.read_manifest(path, _FIX)
    if m.data.get("kind") != KIND or m.data.get("compiled_for") != mf.local_device():
        raise ValueError("not a converted-weights entry for this device")
    files, info = m.data["files"], m.data["model"]
    root = os.path.realpath(path)
    for rel in files:
        if os.path.commonpath([root, os.path.realpath(m.file(rel))]) != root:
            raise ValueError(f"file {rel!r} leaves the entry")
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="maxjax-tokenizer") as pool:
        tokenizing = pool.submit(_tokenizer, m, files, info["tokenizer_class"])
        raw = _map(m.file(PARAMS), files[PARAMS]["bytes"])
        if hashlib.sha256(raw).hexdigest() != files[PARAMS]["sha256"]:
            raise ValueError(f"{PARAMS} fails its sha256 check (corrupt or modified)")
        target = abstract(m.data["tree"], None)
        specs, tree = jax.tree.flatten(target)
        offsets = m.data["offsets"]
        if len(offsets) != len(specs):
            raise ValueError("the tree and the offsets disagree")
        arrays = []
        for spec, at in zip(specs, offsets):
            n = int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize
            if at < 0 or at + n > raw.size:
                raise ValueError("an array lies outside params.bin")
            view = raw[at:at + n].view(spec.dtype).reshape(spec.shape)
            arrays.append(jax.device_put(view, spec.sharding))
        params = jax.tree.unflatten(tree, arrays)
        tokenizer = tokenizing.result()
    if mf.tokenizer_digest(tokenizer, None) != info["tokenizer_digest"]:
        raise ValueError("the tokenizer does not match the one stored")
    arch = registry.get_architecture(info["architecture"])
    return LoadedModel(arch, _config(ModelConfig, info["config"]), params, tokenizer,
                       info["chat_template"], info["source"], info["dtype"], info["name"],
                       served_name=served_name)


def _map(path: str, size: int) -> np.ndarray:
    """The file's bytes mapped copy-on-write (page-aligned, as the kernels' weights must be):
    the arrays placed from it are the page cache's pages, not a copy. An entry is replaced by
    rename and removed by unlink, so a mapping outlives both. ValueError when the file is not
    `size` bytes long."""
    if os.path.getsize(path) != size:
        raise ValueError(f"{os.path.basename(path)} is not {size} bytes long")
    return np.memmap(path, np.uint8, mode="c", shape=(size,))


def _tokenizer(m: mf.Manifest, files: dict, cls: list[str]):
    """The stored tokenizer, by its own class (AutoTokenizer's import of every tokenizer
    module costs ~1.3 s)."""
    import importlib
    for rel, want in files.items():
        if rel != PARAMS and mf.file_sha256(m.file(rel)) != want["sha256"]:
            raise ValueError(f"{rel} fails its sha256 check (corrupt or modified)")
    if cls is None:
        return None
    module, name = cls
    if not module.startswith("transformers."):
        raise ValueError(f"tokenizer class {module}.{name} is not transformers'")
    return getattr(importlib.import_module(module), name).from_pretrained(m.file(TOKENIZER))
