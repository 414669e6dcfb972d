"""One artifact directory written by every process of a multi-host group (`maxjax warm-cache
--coordinator-address H:P --num-processes N --process-id I --artifacts-dir DIR`, on every
process), and which of its files each process loads.

Every process traces, exports and compiles the same graphs for the global mesh (XLA compiles a
multi-process program in each process, for its own devices), so each writes its own compiled
executables (`NAME.PLATFORM-KIND.pI.xlaexe`); process 0 alone writes the portable exports; orbax
writes every process's shards of the weights (maxjax/aot/weights.py). The directory is built in
`.warm-cache-NAME.group` beside DIR, which every process shares (a shared filesystem, as orbax
requires of multi-host checkpoints); once every process has written its files (a barrier of
jax.distributed), process 0 hashes them, writes the manifest and renames the directory into
place. A process's executables are listed as `executable` (process 0) and `executable.pI` in
the graph's `files`, and maxjax/aot/load.py loads its own.

Called by maxjax/aot/export.py (writing) and maxjax/aot/load.py (`executable_key`).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

import jax
import numpy as np


def size() -> int:
    return jax.process_count()


def is_leader() -> bool:
    return jax.process_index() == 0


def executable_key(process: int | None = None) -> str:
    """The `files` key of process `process`'s (default: this one's) executable of a graph."""
    process = jax.process_index() if process is None else process
    return "executable" if process == 0 else f"executable.p{process}"


def executable_suffix() -> str:
    """What this process adds to its executables' file names in a group ('' alone)."""
    return f".p{jax.process_index()}" if size() > 1 else ""


def barrier(name: str) -> None:
    if size() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def from_leader(values: list[int]) -> list[int]:
    """Process 0's `values` on every process (the layout it planned: free memory differs)."""
    if size() == 1:
        return values
    from jax.experimental import multihost_utils
    return [int(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(values, np.int64))]


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            return int(next(ln for ln in f if ln.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError):
        return 0o022


def temp_dir(parent: str, directory: str) -> str:
    """Where the artifact directory is built: a fresh temp directory alone; in a group the one
    every process names alike, made empty by process 0 before any process writes."""
    if size() == 1:
        tmp = tempfile.mkdtemp(prefix=".warm-cache-", dir=parent)
        os.chmod(tmp, 0o777 & ~_umask())   # mkdtemp's 0700 would keep them from other users
        return tmp
    tmp = os.path.join(parent, f".warm-cache-{os.path.basename(directory)}.group")
    if is_leader():
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier("maxjax-warm-cache-start")
    return tmp


def add_executables(directory: str, graphs: list[dict]) -> None:
    """Process 0, after every process wrote: the other processes' executables into the graphs'
    `files` (named like process 0's with its process suffix)."""
    if not is_leader():
        return
    for g in graphs:
        mine = g["files"].get("executable")
        if mine is None:
            continue
        for p in range(1, size()):
            name = mine["path"].replace(".p0.xlaexe", f".p{p}.xlaexe")
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    blob = f.read()
                g["files"][executable_key(p)] = {"path": name, "bytes": len(blob),
                                                 "sha256": hashlib.sha256(blob).hexdigest()}
