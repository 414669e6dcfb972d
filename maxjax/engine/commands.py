"""The commands callers send AsyncEngine's engine thread (maxjax/engine/async_engine.py), one
frozen type each, dispatched by type there. `done`: the caller's future, settled with the engine
call's result or its exception."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Callable

from maxjax.engine.types import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """A generation request (EngineCore.add_request), waiting in the intake until handed over."""
    request_id: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None
    grammar: Any                # its compiled grammar, None without one
    lora: str | None
    images: list | None
    done: concurrent.futures.Future


@dataclass(frozen=True)
class AddEmbedding:
    """An embedding request (EngineCore.add_embedding), waiting in the intake like AddRequest."""
    request_id: str
    prompt: list[int]
    pooling_type: str | None
    lora: str | None
    done: concurrent.futures.Future


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Call:
    """Run `fn(*args)` on the engine thread (LoRA loading and unloading)."""
    fn: Callable
    args: tuple
    done: concurrent.futures.Future


@dataclass(frozen=True)
class Wake:
    """Nothing to do: wakes a loop that waits for commands (shutdown)."""


Intake = AddRequest | AddEmbedding
Command = AddRequest | AddEmbedding | Abort | Call | Wake
