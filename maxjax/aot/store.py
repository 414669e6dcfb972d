"""The compile cache's directory of entries (maxjax/aot/cache.py names and fills them): listing,
atomic publishing and removal, eviction to the size cap, and the `Donors` that reuse executables
compiled before. Below both the cache and the exporter (maxjax/aot/export.py), which import it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from maxjax.aot import group
from maxjax.aot import manifest as mf
from maxjax.cache_home import directory
from maxjax.errors import UserError

log = logging.getLogger("maxjax.cache")
_STALE_TMP_SECONDS = 24 * 3600
WEIGHTS_KIND = "converted-weights"     # a manifest's kind: maxjax/aot/weight_cache.py


def touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


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
