"""Where the compile cache lives and whether it is on: read by maxjax/aot/cache.py and by what
runs before jax is imported (maxjax/transformers_index.py)."""
import os

from maxjax.errors import UserError


def directory() -> str:
    """$MAXJAX_CACHE_DIR, else $XDG_CACHE_HOME/maxjax, else ~/.cache/maxjax."""
    explicit = os.environ.get("MAXJAX_CACHE_DIR")
    if explicit:
        return os.path.abspath(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "maxjax")


def enabled(flag: bool | None = None) -> bool:
    """The flag when given (False: --no-compile-cache), else not MAXJAX_NO_COMPILE_CACHE=1."""
    if flag is not None and not flag:
        return False
    return os.environ.get("MAXJAX_NO_COMPILE_CACHE", "").lower() not in ("1", "true", "yes")


def check(flag: bool | None = None) -> None:
    """With the cache on: a one-line UserError where its directory cannot be one."""
    path = directory()
    if enabled(flag) and os.path.exists(path) and not os.path.isdir(path):
        name = "$MAXJAX_CACHE_DIR" if os.environ.get("MAXJAX_CACHE_DIR") else "the cache directory"
        raise UserError(f"{name} {path}: not a directory (point it at one, or turn the cache "
                        f"off with --no-compile-cache)")
