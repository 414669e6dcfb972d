"""The executor seam: what makes a ModelRunner's calls of its step executables and its KV
initializer. `LocalExecutor` makes them in this process; multi-host process 0 wraps it in
maxjax/engine/distributed.py's `LeaderExecutor`, which first sends each call to the other
processes, whose follower loop hands it to their own LocalExecutor: every process runs the
same code path for a step."""
from __future__ import annotations

from typing import Callable, Protocol

import jax

from maxjax.engine.buckets import Bucket


class StepExecutor(Protocol):
    kv: tuple       # the KV pool every step executable donates and gets back updated

    def run(self, bucket_index: int, step, samp):
        """The outputs of bucket `bucket_index`'s executable on (step, samp) inputs."""

    def init_kv(self) -> None:
        """Replace the pool with a new zero one."""


class LocalExecutor:
    """Calls this process's executables (one per bucket) and owns the pool they update."""

    def __init__(self, buckets: list[Bucket], executables: dict[Bucket, Callable],
                 kv_init: Callable[[], tuple], params: Callable[[], dict]):
        """`executables`: shared with the runner, which adds those it compiles; `params`: what
        every call takes, read at each call (LoRA slots change between steps)."""
        self.buckets = buckets
        self.executables = executables
        self._kv_init = kv_init
        self.params = params
        self.kv = self._new_pool()

    def run(self, bucket_index: int, step, samp):
        exe = self.executables[self.buckets[bucket_index]]
        out, self.kv = exe(self.params(), self.kv, step, samp)
        return out

    def init_kv(self) -> None:
        self.kv = self._new_pool()

    def _new_pool(self) -> tuple:
        """The zero pool, made: on XLA's path (a mesh, --no-use-experimental-kernels, GPU)
        filling GiBs takes seconds on the CPU, and a start that did not wait for it would say
        ready while its first step still waited (a 17 GiB pool on --devices cpu:4: 15 s)."""
        return jax.block_until_ready(self._kv_init())
