"""The compile cache: the graphs an engine compiles, kept per user, so that the next start with the
same model, engine configuration, versions and device loads them instead of compiling.

Called by maxjax/engine/build.py (every entry point: serve, generate, maxjax.LLM; each process
of a multi-host group with an entry of its own, named by its process too), by `maxjax
warm-cache` without --artifacts-dir, and by `maxjax cache list | clear`.

An entry is an artifact directory (one format, one loader: maxjax/aot/export.py writes it,
maxjax/aot/load.py verifies every sha256 and signature before it deserializes anything) named by
a digest of all that decides its bytes: the model and engine fingerprints (the engine's covers
every bucket, so a new kind of bucket misses by itself), the maxjax/jax/jaxlib versions, the
graph code digest, the device and the format version. Unlike --precompiled-artifacts, which is
strict, an entry that fails any check is logged as a warning, removed and rebuilt: never
loaded, never fatal.

Writes are atomic: an entry is built in a temp directory of the cache and renamed into place,
so a crash leaves only a `.tmp-*` directory that nothing loads (eviction removes it later);
when another process renamed its entry first, its entry stays and ours is dropped. Removal
renames an entry away before deleting it, so a reader sees a whole entry or none. The size is
bounded: after each write the least recently used entries (a hit touches its directory) go until
the cache fits $MAXJAX_CACHE_MAX_SIZE / --compile-cache-max-size.
"""
from __future__ import annotations

import logging
import os
import re
import shutil

from maxjax.aot import group
from maxjax.aot import manifest as mf
from maxjax.aot.store import (WEIGHTS_KIND, Donors, Entry, clear, entries,  # noqa: F401 (API)
                              evict, new_tmp, publish, remove, touch)
from maxjax.cache_home import directory, enabled  # noqa: F401 (this module's API)
from maxjax.errors import UserError

log = logging.getLogger("maxjax.cache")
DEFAULT_MAX_SIZE = "10G"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def max_bytes(flag: str | None = None) -> int:
    """The size cap: the flag, else $MAXJAX_CACHE_MAX_SIZE, else 10G (bytes, or K/M/G/T)."""
    name = "--compile-cache-max-size" if flag else "MAXJAX_CACHE_MAX_SIZE"
    return size_bytes(flag or os.environ.get("MAXJAX_CACHE_MAX_SIZE") or DEFAULT_MAX_SIZE, name)


def size_bytes(text, name: str) -> int:
    """A size flag's bytes: a number of bytes, or with K/M/G/T (powers of 1024); a UserError
    naming `name` otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(text), re.I)
    if not m:
        raise UserError(f"{name} {text!r}: expected a size such as 500M or 10G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def entry_key(model_fp: dict, engine_fp: dict, device_ids: list[int] = (0,)) -> str:
    """`device_ids`: the devices the executables run on, [0] where they load onto any
    (maxjax/aot/graphs.movable: one CPU device, so one-device data-parallel replicas share an
    entry); a mesh's executables load onto the devices they were compiled for only."""
    key = {"format_version": mf.FORMAT_VERSION, "model": model_fp["fingerprint"],
           "engine": engine_fp["fingerprint"], "versions": mf.versions(),
           "code": mf.code_digest(), "device": mf.local_device(), "xla_flags": mf.codegen_flags()}
    if list(device_ids) != [0]:
        key["device_ids"] = list(device_ids)
    if group.size() > 1:    # each process of a group keeps an entry of its own executables
        key["process"] = group.executable_key()
    return mf.digest(key)


def entry_path(model, plan, root: str | None = None) -> str:
    """Where the entry for this model, engine layout, versions and device lives (named by the
    key alone: a model's name or path shapes no graph; `maxjax cache list` shows it)."""
    from maxjax.aot.graphs import execution_devices, movable
    devices = execution_devices(plan.layout)
    key = entry_key(mf.model_fingerprint(model),
                    mf.engine_fingerprint(plan.layout, plan.config, model.dtype),
                    [0] if movable(devices) else [d.id for d in devices])
    return os.path.join(root or directory(), key[:32])


def load(path: str, model, plan, preloaded: dict | None = None):
    """load_for_engine's (executables, kv_init) for `plan` from the entry at `path`; None when there
    is none, or when it fails a check or does not load (then it is removed, with a warning).
    `preloaded`: executables maxjax/aot/prefetch.py deserialized from it already."""
    from maxjax.aot import load as aot_load
    if not os.path.isdir(path):
        return None
    try:
        arts = aot_load.open_artifacts([path], model, plan.config, require_compiled=True)
        loaded = aot_load.load_for_engine(arts, model, plan, require_compiled=True,
                                          preloaded=preloaded)
    except Exception as e:     # a bad entry is rebuilt, whatever broke in it
        # the artifacts' own advice ("; recreate them with: maxjax warm-cache ...") is what
        # happens next here
        why = re.sub(r"[;(,]?\s*(?:re)?create\b[^;]*?\bmaxjax warm-cache.*$", "",
                     str(e).split("\n")[0])
        log.warning("compile cache: entry %s refused (%s); removing it and compiling again",
                    os.path.basename(path), why.rstrip(" :")[:300])
        remove(path)
        return None
    touch(path)
    return loaded


def fill(path: str, model, plan, platforms: list[str], jobs: int,
         on_graph=None, replace: bool = False) -> tuple[dict, dict]:
    """Build the entry at `path` (export + compile every graph, in a temp directory renamed into
    place): build_entry's (manifest, compiled executables). `replace`: an entry already there
    goes (warm-cache refreshes it); else the first one renamed into place stays."""
    from maxjax.aot import export
    tmp = new_tmp(os.path.dirname(path))
    try:
        data, compiled = export.build_entry(tmp, model, plan, platforms, jobs, on_graph,
                                            donor_root=os.path.dirname(path))
        served = [g["name"] for g in data["graphs"] if group.executable_key() not in g["files"]]
        if served:      # see export.py: such executables do not serialize again
            log.warning("compile cache: not stored: %d graphs came from JAX's persistent "
                        "compilation cache (JAX_COMPILATION_CACHE_DIR), whose executables "
                        "cannot be saved again; unset it to use maxjax's cache", len(served))
            return data, compiled
        if replace:
            remove(path)
        publish(tmp, path)
        return data, compiled
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
