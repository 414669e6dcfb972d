"""A warm start deserializes its executables while the weights load.

The compile cache's key (maxjax/aot/cache.py) digests the loaded model, so it is known only once
the weights are converted. A start therefore also records, under a key of what it was asked
for (`request_key`: the model's files, every engine flag, the versions, the graph code and the
device), which entry it loaded: `$MAXJAX_CACHE_DIR/.requests/<request key>` holds the entry's
name. The next start with the same request reads the pointer before loading the model and
deserializes that entry's executables on a thread, after the entry's manifest seal and every
file's sha256 passed (the model and engine checks come later, in load.py, as always: an
executable that does not pass them is discarded, never run). `Prefetch.take(path)` hands them
to the loader when `path` is the entry the model's own key names; it always waits for the
thread first. The executables deserialize on up to four threads at once (maxjax/aot/load.py
keeps one: see the note there).
One device and one process only (a mesh's or a group's executables load as before).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import tempfile

import jax

from maxjax.aot import group
from maxjax.aot import manifest as mf

log = logging.getLogger("maxjax.cache")
REQUESTS = ".requests"


def request_key(model_path: str, engine_cfg, chat_template: str | None,
                source: dict | None = None) -> str:
    """What a start asks for, known before its model loads: the checkpoint's files (names,
    sizes, modification times), the model source's other flags (`source`: ModelSource.options),
    every engine flag, the versions, graph code and device."""
    from maxjax.graphs import cpu_kernels
    model = [model_path, file_stats(model_path)] + ([source] if source else [])
    return mf.digest({"model": model, "chat_template": chat_template,
                      "engine": dataclasses.asdict(engine_cfg), "versions": mf.versions(),
                      "code": mf.code_digest(), "device": mf.local_device(),
                      "xla_flags": mf.codegen_flags(), "kernel_isa": cpu_kernels.isa()})[:32]


def file_stats(path: str) -> list:
    """(name, size, modification time) of the file at `path`, or of each file in the directory."""
    files = []
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path))
    return [(os.path.basename(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files
            if os.path.isfile(f)]


def remember(root: str, request: str, entry: str) -> None:
    """Point `request` at the entry directory `entry` (atomically; the last start wins)."""
    d = os.path.join(root, REQUESTS)
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(os.path.basename(entry))
        os.replace(tmp, os.path.join(d, request))
    except OSError as e:
        log.debug("compile cache: cannot record the entry of this start (%s)", e)


def start(root: str, request: str) -> Prefetch | None:
    """The prefetch of the entry `request` loaded last; None without one (or in a group)."""
    if group.size() > 1:
        return None
    try:
        with open(os.path.join(root, REQUESTS, request)) as f:
            name = f.read().strip()
    except OSError:
        return None
    path = os.path.join(root, name)
    return Prefetch(path) if name and os.path.isdir(path) else None


def of_artifacts(dirs) -> Prefetch | None:
    """The prefetch of --precompiled-artifacts' first directory (None in a group, or where it
    has no manifest: loading it says why)."""
    if group.size() > 1 or not dirs:
        return None
    path = os.path.abspath(dirs if isinstance(dirs, str) else dirs[0])
    return Prefetch(path) if os.path.isfile(os.path.join(path, mf.MANIFEST)) else None


class Prefetch:
    def __init__(self, path: str):
        self.path = path
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="maxjax-prefetch")
        self._future = self._pool.submit(_deserialize, path)
        self._pool.shutdown(wait=False)

    def take(self, path: str) -> dict:
        """{graph name: (sha256, executable)} when `path` is this prefetch's entry, else {};
        returns once the thread is done either way."""
        try:
            got = self._future.result()
        except Exception as e:      # a bad entry: load.py finds and reports what is wrong
            log.debug("compile cache: prefetch of %s failed (%s)", self.path, e)
            return {}
        return got if os.path.abspath(path) == os.path.abspath(self.path) else {}


def _deserialize(path: str) -> dict:
    from maxjax.aot import graphs
    m = mf.read_manifest(path, "maxjax warm-cache")      # the seal
    if m.data.get("compiled_for") != mf.local_device() or m.data.get("engine", {}).get("mesh"):
        return {}
    mf.check_files(m, "maxjax warm-cache")               # every sha256, before any deserializing
    device = jax.devices()[0]

    def one(g: dict, entry: dict):
        with open(m.file(entry["path"]), "rb") as f:
            blob = f.read()
        if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
            return None
        sig = g.get("signature", {})
        groups = [len(sig["in"][k]) for k in g.get("args", [])]
        in_tree = jax.tree.structure((tuple(tuple(0 for _ in range(n)) for n in groups), {}))
        out_tree = jax.tree.structure((tuple(0 for _ in range(g["sample_outputs"])),
                                       tuple(0 for _ in sig["out"]["kv"])))
        return entry["sha256"], graphs.load_executable(blob, in_tree, out_tree, [device])

    todo = [(g, g["files"]["executable"]) for g in m.data.get("graphs", [])
            if g["files"].get("executable") is not None]
    # The largest first, on as many threads as cores (at most 4): deserializing is native code
    # that releases the GIL, and it is most of a warm start's critical path.
    todo.sort(key=lambda t: -t[1].get("bytes", 0))
    with concurrent.futures.ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)),
                                               thread_name_prefix="maxjax-deserialize") as pool:
        got = {g["name"]: pool.submit(one, g, entry) for g, entry in todo}
    done = {name: f.result() for name, f in got.items()}
    return {name: exe for name, exe in done.items() if exe is not None}
