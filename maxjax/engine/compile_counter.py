"""Counts XLA backend compilations in this process (jax.monitoring), for the no-recompile rule.

Counting starts when this module is imported: maxjax.engine.core imports it, and every entry
point (`maxjax serve`, `generate`, maxjax.LLM) imports the engine before it loads a model, so
the count covers weight loading and the KV pool too. Deserializing an executable from artifacts
is not a compilation.
"""
from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_count = 0
_installed = False


def _listener(event: str, duration: float, **_kw) -> None:
    global _count
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


def install() -> None:
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def count() -> int:
    return _count


install()
