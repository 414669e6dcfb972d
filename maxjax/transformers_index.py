"""`import transformers` builds its lazy index by reading every file under transformers/models/
(2,600 files, 46 MB in 5.x): 0.2 s of each start, spent under the interpreter lock while the
tokenizer loads. The index is a pure function of those files, so it is kept in the compile cache
(`$MAXJAX_CACHE_DIR/.transformers-index-<key>.pickle`, the key naming transformers' version, its
location and its files' times) and read back on the next start. `install()` hooks the one module
that builds it; where transformers is already imported, or changed what it calls, it does nothing.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import os
import pickle
import sys
import tempfile

from maxjax import cache_home

_MODULE = "transformers.utils.import_utils"
_FUNCTION = "define_import_structure"


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec and spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            real = getattr(module, _FUNCTION, None)
            if callable(real):
                setattr(module, _FUNCTION, _cached(real))
        loader.exec_module = exec_module
        return spec


_finder = _Finder()


def install(compile_cache: bool | None = None) -> None:
    """Before transformers is imported, with the compile cache on (`compile_cache`: the flag)."""
    if cache_home.enabled(compile_cache) and _MODULE not in sys.modules and \
            _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def _cached(real):
    def define_import_structure(module_path, prefix=None):
        path = _entry(module_path, prefix)
        if path is None:
            return real(module_path, prefix)
        try:
            with open(path, "rb") as f:
                return pickle.load(f)
        except Exception:   # noqa: BLE001: missing or damaged, it is scanned and written again
            pass
        index = real(module_path, prefix)
        _store(path, index)
        return index
    define_import_structure.__wrapped__ = real
    return define_import_structure


def _entry(module_path, prefix) -> str | None:
    """The cache file for this call; None where it is not the whole models/ tree's or
    transformers' version is unknown."""
    module_path = os.fspath(module_path)
    version = getattr(sys.modules.get("transformers"), "__version__", None)
    if prefix != "models" or not os.path.isdir(module_path) or version is None:
        return None
    try:
        # a reinstall, or a file added or removed, changes a directory's time
        stamps = [os.stat(module_path).st_mtime_ns]
        with os.scandir(module_path) as entries:
            stamps += sorted((e.name, e.stat().st_mtime_ns) for e in entries if e.is_dir())
    except OSError:
        return None
    key = hashlib.sha256(repr((version, os.path.realpath(module_path), stamps)).encode())
    name = f".transformers-index-{key.hexdigest()[:32]}.pickle"
    return os.path.join(cache_home.directory(), name)


def _store(path: str, index) -> None:
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-index-")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(index, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except OSError:     # a read-only or full cache: the next start scans again
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
