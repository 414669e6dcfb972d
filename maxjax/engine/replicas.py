"""ReplicatedEngine: `--data-parallel-degree D` engine replicas (each an AsyncEngine on its own
group of devices, maxjax/engine/devices.py) behind one EngineClient, so the server is unchanged.

Routing: a request goes to the replica whose prefix cache holds the longest run of its prompt's
pages, else (no replica holds any) to the one with the fewest requests in flight (then the
fewest routed so far). The prefix
lookup reads each replica's BlockManager from the caller's thread while the engine thread may
change it: `match_prefix` has no side effects and only reads dicts, so the worst a race gives
is a stale answer, which costs a cache miss, never a wrong output.

A replica whose step raised out of its EngineCore (a fault outside the per-request guards: a
lost device) is taken out of rotation and logged; its AsyncEngine has already ended its
requests with an error. The others keep serving; with none left, requests are refused.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import AsyncIterator

from maxjax.engine.async_engine import AsyncEngine
from maxjax.engine.core import EMBEDDING_SAMPLING
from maxjax.engine.request import Request
from maxjax.engine.stats import EngineStats, ReplicaStats
from maxjax.engine.types import RequestOutput, SamplingParams
from maxjax.errors import RequestError

log = logging.getLogger("maxjax.engine")


class ReplicatedEngine:
    def __init__(self, replicas: list[AsyncEngine]):
        self.replicas = replicas
        first = replicas[0]
        self.tokenizer, self.model_name = first.tokenizer, first.model_name
        self.model_aliases = first.model_aliases
        self.chat_template, self.max_length = first.chat_template, first.max_length
        self.vision, self.sampling_defaults = first.vision, first.sampling_defaults
        self.in_flight = [0] * len(replicas)
        self.routed = [0] * len(replicas)          # requests sent to each replica
        self.prefix_routed = [0] * len(replicas)   # ... of which for a cached prefix
        self.down: set[int] = set()
        self._owner: dict[str, int] = {}

    @property
    def is_ready(self) -> bool:
        self._check_health()
        up = [r for i, r in enumerate(self.replicas) if i not in self.down]
        return bool(up) and all(r.is_ready for r in up)

    @property
    def dead(self) -> BaseException | None:
        """The first replica's death once every replica's engine thread has died."""
        deaths = [r.dead for r in self.replicas]
        return deaths[0] if all(d is not None for d in deaths) else None

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            r.shutdown(timeout)

    # ---- routing ------------------------------------------------------------------------------
    def _check_health(self) -> None:
        for i, r in enumerate(self.replicas):
            if i not in self.down and (r.num_step_errors or r.dead is not None):
                self.down.add(i)
                log.error("replica %d failed (its engine step raised); its requests ended with "
                          "an error, the other %d replicas go on serving", i,
                          len(self.replicas) - len(self.down))

    def cached_tokens(self, replica: int, prompt: list[int], params: SamplingParams,
                      cache_salt: str | None) -> int:
        core = self.replicas[replica].core
        probe = Request("route", list(prompt), params, cache_salt=cache_salt)
        return len(core.block_manager.match_prefix(probe).pages) * core.layout.page_size

    def route(self, prompt: list[int], params: SamplingParams,
              cache_salt: str | None = None) -> int:
        self._check_health()
        live = [i for i in range(len(self.replicas)) if i not in self.down]
        if not live:
            raise RuntimeError("every engine replica has failed")
        cached = {i: self.cached_tokens(i, prompt, params, cache_salt) for i in live}
        best = max(live, key=lambda i: (cached[i], -self.in_flight[i], -i))
        if cached[best] == 0:     # ties go round: fewest routed so far
            best = min(live, key=lambda i: (self.in_flight[i], self.routed[i], i))
        else:
            self.prefix_routed[best] += 1
        self.routed[best] += 1
        return best

    # ---- EngineClient -------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None, lora: str | None = None,
                       images: list | None = None) -> AsyncIterator[RequestOutput]:
        if lora is not None:
            raise RequestError("model", "LoRA is off on this server (--enable-lora)")
        i = self.route(prompt_token_ids, params, cache_salt)
        self._owner[request_id] = i
        self.in_flight[i] += 1
        try:
            async for out in self.replicas[i].generate(request_id, prompt_token_ids, params,
                                                       cache_salt, images=images):
                yield out
        finally:
            self.in_flight[i] -= 1
            self._owner.pop(request_id, None)

    stream = generate

    async def embed(self, request_id: str, prompt_token_ids: list[int],
                    pooling_type: str | None = None, lora: str | None = None) -> list[float]:
        if lora is not None:
            raise RequestError("model", "LoRA is off on this server (--enable-lora)")
        i = self.route(prompt_token_ids, EMBEDDING_SAMPLING, None)
        self._owner[request_id] = i
        self.in_flight[i] += 1
        try:
            return await self.replicas[i].embed(request_id, prompt_token_ids, pooling_type)
        finally:
            self.in_flight[i] -= 1
            self._owner.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            self.replicas[i].abort(request_id)

    def lora_adapters(self) -> dict[str, str]:
        return {}

    async def load_lora(self, name: str, path: str) -> None:
        raise RequestError("lora_name", "LoRA is off on this server (--enable-lora)")

    unload_lora = load_lora

    def stats(self) -> EngineStats:
        """The replicas' stats summed, and each one's under `replicas`."""
        self._check_health()
        per = [r.stats() for r in self.replicas]
        each = tuple(ReplicaStats(s, up=i not in self.down, routed=self.routed[i],
                                  prefix_routed=self.prefix_routed[i], in_flight=self.in_flight[i])
                     for i, s in enumerate(per))
        return dataclasses.replace(EngineStats.total(per), replicas=each)

    def info(self) -> dict:
        info = self.replicas[0].info()
        info["data_parallel_degree"] = len(self.replicas)
        info["num_pages"] = sum(r.core.layout.num_pages for r in self.replicas)
        return info
