"""Architecture registry: the built-ins, every module of graphs/ that defines ARCHITECTURE (so a
family is its file alone), plus any `--custom-architectures`."""
from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys

from maxjax import graphs
from maxjax.errors import UserError
from maxjax.graphs.arch import Architecture

_registry: dict[str, Architecture] = {}


def builtin_architectures() -> list[Architecture]:
    """The ARCHITECTURE of every module of the maxjax.graphs package, by module name (or its
    ARCHITECTURES: one family under several names, e.g. Qwen3.5's text and image-text ones)."""
    found = []
    for mod in pkgutil.iter_modules(graphs.__path__, graphs.__name__ + "."):
        module = importlib.import_module(mod.name)
        archs = [getattr(module, "ARCHITECTURE", None), *getattr(module, "ARCHITECTURES", ())]
        found.extend(a for a in archs if isinstance(a, Architecture))
    return found


def _ensure_builtins() -> None:
    if not _registry:
        _registry.update((arch.name, arch) for arch in builtin_architectures())


def architectures() -> dict[str, Architecture]:
    _ensure_builtins()
    return dict(_registry)


def get_architecture(name: str) -> Architecture:
    archs = architectures()
    if name not in archs:
        builtin = {a.name for a in builtin_architectures()}
        custom = len(set(archs) - builtin)
        more = f" and {custom} custom" if custom else ""
        raise UserError(f"unsupported architecture {name!r}: not found in registry (supported: "
                        f"{_grouped(builtin)}{more}; add one with --custom-architectures)")
    return archs[name]


def _grouped(names) -> str:
    """Architecture names by their suffix, one line: `Gemma3, Llama ...ForCausalLM`."""
    groups: dict[str, list[str]] = {}
    for n in sorted(names):
        stem, sep, suffix = n.partition("For")
        groups.setdefault(sep + suffix, []).append(stem)
    return "; ".join(f"{', '.join(stems)} ...{suffix}" for suffix, stems in groups.items())


def for_gguf_arch(gguf_arch: str) -> Architecture:
    for arch in architectures().values():
        if gguf_arch in arch.gguf_archs:
            return arch
    known = sorted(a for arch in architectures().values() for a in arch.gguf_archs)
    raise UserError(f"unsupported GGUF architecture {gguf_arch!r} (supported: {', '.join(known)})")


def _import_custom(spec: str):
    if os.path.isdir(spec) or spec.endswith(".py"):
        path = os.path.abspath(spec)
        if os.path.isdir(path):
            init = os.path.join(path, "__init__.py")
            if not os.path.isfile(init):
                raise UserError(f"--custom-architectures {spec}: directory has no __init__.py")
            name, location = os.path.basename(path.rstrip(os.sep)), init
        else:
            name, location = os.path.splitext(os.path.basename(path))[0], path
        module_name = f"maxjax_custom_{name}"
        mspec = importlib.util.spec_from_file_location(
            module_name, location, submodule_search_locations=[path] if os.path.isdir(path) else None)
        module = importlib.util.module_from_spec(mspec)
        sys.modules[module_name] = module
        mspec.loader.exec_module(module)
        return module
    if os.path.sep in spec or spec.startswith("."):
        raise UserError(f"--custom-architectures {spec}: no such directory or file")
    module_path, _, attr = spec.partition(":")
    module = importlib.import_module(module_path)
    return getattr(module, attr) if attr else module


def register_custom(spec: str) -> list[Architecture]:
    """Import a user package exposing ARCHITECTURES (a list of Architecture) and register it."""
    _ensure_builtins()
    try:
        module = _import_custom(spec)
    except UserError:
        raise
    except Exception as e:  # the user's code: any failure is a bad package, not our crash
        raise UserError(f"--custom-architectures {spec}: import failed: {type(e).__name__}: {e}") from e
    archs = getattr(module, "ARCHITECTURES", None)
    if not isinstance(archs, (list, tuple)) or not archs:
        raise UserError(f"--custom-architectures {spec}: module has no top-level ARCHITECTURES list")
    for arch in archs:
        if not isinstance(arch, Architecture):
            raise UserError(f"--custom-architectures {spec}: ARCHITECTURES holds {type(arch).__name__}, "
                            "expected maxjax.graphs.arch.Architecture")
        if arch.name in _registry:
            raise UserError(f"--custom-architectures {spec}: {arch.name!r} clashes with a registered "
                            "architecture")
    for arch in archs:
        _registry[arch.name] = arch
    return list(archs)
