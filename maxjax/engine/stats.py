"""The engine's counters and gauges as typed values, declared once: the block manager makes a
`KVCacheStats`, the scheduler a `SchedulerStats`, the speculator a `SpecStats`, and EngineCore
composes them into the `EngineStats` that AsyncEngine, ReplicatedEngine (`EngineStats.total` over
its replicas, each one's also under `replicas`) and `LLM.stats()` hand on unchanged. The server
reads them by attribute (server/metrics.py's table) for /metrics, and /stats shows that registry.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Mapping


@dataclass(frozen=True)
class KVCacheStats:
    """The KV page pool and its prefix cache (BlockManager)."""
    pages_total: int = 0          # usable pages
    pages_used: int = 0
    pages_free: int = 0
    pages_cached: int = 0         # free pages still holding a reusable prefix
    prefix_queries: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_pages: int = 0
    prefix_hit_pages: int = 0
    evictions: int = 0
    events_dropped: int = 0       # KV event batches the full publisher queue dropped

    @property
    def usage(self) -> float:
        """Pages in use over the pool's: vLLM's kv_cache_usage_perc (1.0 is full)."""
        return self.pages_used / self.pages_total if self.pages_total else 0.0


@dataclass(frozen=True)
class SchedulerStats:
    """The queues now and what has been scheduled so far."""
    waiting: int = 0
    running: int = 0
    preemptions: int = 0
    scheduled_tokens: int = 0
    scheduled_rows: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding's verification counters (all 0 without speculation)."""
    rows_verified: int = 0        # request rows that verified drafts in a step
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_at: tuple[int, ...] = ()     # by draft position (0: the first after the last token)
    accepted_at: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineStats:
    scheduler: SchedulerStats = SchedulerStats()
    kv: KVCacheStats = KVCacheStats()
    spec: SpecStats = SpecStats()
    steps: int = 0                       # engine steps run (priming runs are not steps)
    # since start, in this process: replicas in one process share it (total() takes it once)
    xla_compiles: int = field(default=0, metadata={"per_process": True})
    xla_compiles_since_ready: int = 0    # inside serving steps (must stay 0)
    grammar_faults: int = 0              # sampled tokens a grammar refused (must stay 0)
    step_seconds: Mapping[str, float] = field(default_factory=dict)   # phase -> seconds
    replicas: tuple[ReplicaStats, ...] = ()   # --data-parallel-degree: each replica's

    @classmethod
    def total(cls, stats: list[EngineStats]) -> EngineStats:
        """Every counter and gauge summed over `stats` (lists by position, phases by name);
        `replicas` left empty."""
        out = cls()
        for s in stats:
            out = _add(out, dataclasses.replace(s, replicas=()))
        return out


@dataclass(frozen=True)
class ReplicaStats:
    """One replica of a ReplicatedEngine: its engine's stats and how requests were routed."""
    engine: EngineStats = EngineStats()
    up: bool = True               # False once its engine step raised
    routed: int = 0               # requests sent to it
    prefix_routed: int = 0        # ... of which for a prefix it caches
    in_flight: int = 0            # routed, unfinished


def _add(a, b):
    if dataclasses.is_dataclass(a):
        return type(a)(**{f.name: max(getattr(a, f.name), getattr(b, f.name))
                          if f.metadata.get("per_process") else
                          _add(getattr(a, f.name), getattr(b, f.name))
                          for f in dataclasses.fields(a)})
    if isinstance(a, tuple):
        return tuple(x + y for x, y in zip_longest(a, b, fillvalue=0))
    if isinstance(a, Mapping):
        return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}
    return a + b
