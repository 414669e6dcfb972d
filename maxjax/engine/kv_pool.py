"""The KV pool's initializer: one program per pool shape and dtype in this process, running
graphs/decoder.py's init_kv, so the pool is made on the device by XLA, without a compile when
artifacts hold the program.

ModelRunner makes its pool with `zeros`. maxjax/aot/load.py `provide`s the initializer it loaded
from artifacts (a serialized executable is deserialized, not compiled) before the engine is
built; otherwise `zeros` compiles it once. Zeros put from the host would need no compile either,
but measured on the CPU (SmolLM2's 7.6 GB default pool) they took 3.6-5.9 s against 2.3-3.4 s,
jax aliases an aligned numpy buffer there, which a donated step then copies instead of updating
in place (twice the memory), and on a GPU the pool would cross the host link.
"""
from __future__ import annotations

import threading
from functools import partial
from typing import Callable

import jax
import numpy as np

from maxjax.graphs.decoder import KV, init_kv, kv_specs

_lock = threading.Lock()
_initializers: dict[tuple, Callable[[], KV]] = {}


def _key(cfg, num_pages: int, page_size: int, dtype) -> tuple:
    return tuple((s.shape, np.dtype(s.dtype).name)
                 for s in jax.tree.leaves(kv_specs(cfg, num_pages, page_size, dtype)))


def provide(cfg, num_pages: int, page_size: int, dtype, initializer: Callable[[], KV]) -> None:
    """Make pools of this shape and dtype with `initializer` (loaded from artifacts)."""
    with _lock:
        _initializers[_key(cfg, num_pages, page_size, dtype)] = initializer


def zeros(cfg, num_pages: int, page_size: int, dtype) -> KV:
    """A zero KV pool, from the initializer provided for its shape, else one compiled now."""
    key = _key(cfg, num_pages, page_size, dtype)
    with _lock:
        if key not in _initializers:
            _initializers[key] = jax.jit(partial(init_kv, cfg, num_pages, page_size,
                                                 dtype)).lower().compile()
        initializer = _initializers[key]
    return initializer()
