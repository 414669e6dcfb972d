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

import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from maxjax.aot import group
from maxjax.aot import manifest as mf
from maxjax.cache_home import directory, enabled  # noqa: F401 (this module's API)
from maxjax.errors import UserError

log = logging.getLogger("maxjax.cache")
DEFAULT_MAX_SIZE = "10G"
_STALE_TMP_SECONDS = 24 * 3600
WEIGHTS_KIND = "converted-weights"     # a manifest's kind: maxjax/aot/weight_cache.py
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def max_bytes(flag: str | None = None) -> int:
    """The size cap: the flag, else $MAXJAX_CACHE_MAX_SIZE, else 10G (bytes, or K/M/G/T)."""
    name = "--compile-cache-max-size" if flag else "MAXJAX_CACHE_MAX_SIZE"
    text = flag or os.environ.get("MAXJAX_CACHE_MAX_SIZE") or DEFAULT_MAX_SIZE
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


def touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


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


class Donors:
    """Executables compiled before, by the sha256 of the export they were compiled from: a graph
    whose export is byte-identical to one compiled before (another model of the same shapes,
    another engine sharing a bucket or a sampler, a draft model's sampler) is loaded instead of
    compiled. They come from this process's recent compiles (`remember`, kept in memory up to
    MEMORY_BYTES) and from the cache's other entries built by this maxjax, jax and graph code,
    for this device under these XLA flags (`root` None: this process's alone). Only for
    executables that load onto any one CPU device (graphs.movable), in a single process; a donor
    entry's manifest seal and file sha256 are checked as for any entry."""

    MEMORY_BYTES = 64 << 20
    _memory: OrderedDict = OrderedDict()      # (context, export sha256) -> executable bytes
    _lock = threading.Lock()

    def __init__(self, root: str | None, devices: list):
        from maxjax.aot import graphs
        self.devices = devices
        self.by_export: dict[str, tuple[str, dict]] = {}
        self.context = None
        if not graphs.movable(devices) or group.size() > 1:
            return
        want = {"versions": mf.versions(), "code_digest": mf.code_digest(),
                "compiled_for": mf.local_device(), "xla_flags": mf.codegen_flags()}
        self.context = mf.digest(want)
        for e in entries(root, kind="graphs") if root else []:
            try:
                m = mf.read_manifest(e.path, "")
            except UserError:
                continue
            if any(m.data.get(k) != v for k, v in want.items()) or \
                    m.data.get("engine", {}).get("mesh") is not None:
                continue
            for g in m.data.get("graphs", []):
                files = g.get("files", {})
                if "executable" in files and "export" in files:
                    self.by_export.setdefault(files["export"]["sha256"],
                                              (m.file(files["executable"]["path"]),
                                               files["executable"]))

    def remember(self, export_sha256: str, blob: bytes) -> None:
        """Keep an executable this process compiled from that export (the oldest go first)."""
        if self.context is None:
            return
        with self._lock:
            self._memory[(self.context, export_sha256)] = blob
            total = sum(len(b) for b in self._memory.values())
            while total > self.MEMORY_BYTES and self._memory:
                total -= len(self._memory.popitem(last=False)[1])

    def _bytes(self, export_sha256: str) -> bytes | None:
        with self._lock:
            blob = self._memory.get((self.context, export_sha256))
        if blob is not None or export_sha256 not in self.by_export:
            return blob
        path, entry = self.by_export[export_sha256]
        with open(path, "rb") as f:
            blob = f.read()
        return blob if hashlib.sha256(blob).hexdigest() == entry["sha256"] else None

    def load(self, export_sha256: str, trees) -> tuple[bytes, object] | None:
        """(serialized executable, loaded) compiled from that export, or None."""
        from maxjax.aot import graphs
        if self.context is None:
            return None
        try:
            blob = self._bytes(export_sha256)
            return blob and (blob, graphs.load_executable(blob, *trees, self.devices))
        except Exception as e:      # a donor that does not load is only a missed shortcut
            log.warning("compile cache: reusing an executable failed (%s); compiling", e)
            return None


def publish(tmp: str, path: str) -> bool:
    """Rename the finished `tmp` into `path`; False (and `tmp` removed) when another process's
    entry is already there (both were built from the same inputs: theirs stays) or when `tmp`
    was removed meanwhile (`maxjax cache clear`)."""
    try:
        os.rename(tmp, path)
        return True
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(path):
            log.warning("compile cache: could not store %s (%s)", path, e)
        return False


def remove(path: str) -> None:
    """Rename away, then delete: a concurrent reader sees the whole entry or nothing."""
    trash = os.path.join(os.path.dirname(path), f".trash-{os.path.basename(path)}-{os.getpid()}")
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def new_tmp(root: str | None = None) -> str:
    root = root or directory()
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=".tmp-", dir=root)


@dataclass
class Entry:
    path: str
    bytes: int
    last_used: float
    model: str
    graphs: int
    device: str
    kind: str = "graphs"        # or "weights": converted weights (maxjax/aot/weight_cache.py)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def _size(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(base, f))
            except OSError:
                pass
    return total


def entries(root: str | None = None, kind: str | None = None) -> list[Entry]:
    """The cache's entries, least recently used first (temp and trash directories excluded);
    `kind` "graphs" or "weights": those alone."""
    import json
    root = root or directory()
    out = []
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, mf.MANIFEST)) as f:
                data = json.load(f)
            dev = data.get("compiled_for") or {}
            info = (data.get("model", {}).get("name", "?"), len(data.get("graphs", [])),
                    f"{dev.get('platform', '?')} {dev.get('device_kind', '?')}",
                    "weights" if data.get("kind") == WEIGHTS_KIND else "graphs")
        except (OSError, ValueError, AttributeError):
            info = ("? (unreadable manifest)", 0, "?", "graphs")
        if kind is not None and info[3] != kind:
            continue
        try:
            used = os.stat(path).st_mtime
        except OSError:
            continue
        out.append(Entry(path, _size(path), used, *info))
    return sorted(out, key=lambda e: e.last_used)


def evict(limit: int, keep: str | None = None, root: str | None = None) -> list[str]:
    """Remove least recently used entries (never `keep`) until the cache fits `limit` bytes, and
    temp directories a crashed writer left over a day ago; the names removed."""
    root = root or directory()
    now = time.time()
    for name in os.listdir(root) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if name.startswith((".tmp-", ".trash-")):
            try:
                if now - os.stat(path).st_mtime > _STALE_TMP_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass
    found = entries(root)
    total, removed = sum(e.bytes for e in found), []
    for e in found:
        if total <= limit:
            break
        if keep and os.path.abspath(e.path) == os.path.abspath(keep):
            continue
        remove(e.path)
        total -= e.bytes
        removed.append(e.name)
    if removed:
        log.info("compile cache: evicted %d least recently used entries (cap %.1f GB)",
                 len(removed), limit / 1e9)
    return removed


def clear(root: str | None = None) -> tuple[int, int]:
    """Remove every entry, temp directory and hidden file (transformers' index,
    maxjax/transformers_index.py): (entries removed, bytes freed)."""
    root = root or directory()
    found = entries(root)
    for e in found:
        remove(e.path)
    for name in os.listdir(root) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if name.startswith((".tmp-", ".trash-")):
            shutil.rmtree(path, ignore_errors=True)
        if name.startswith(".") and os.path.isfile(path):
            os.remove(path)
    return len(found), sum(e.bytes for e in found)
