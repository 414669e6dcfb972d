"""The memory plan of several models in one server (server/router.py): the budget the loaded
models share, each model's KV pool when --num-kv-pages is not given, and what each model needs
once loaded, all decided at start-up before any model loads.

- The budget: --models-memory-budget, else the free memory at start (engine/memory.py
  `device_free_bytes`: a device's free bytes, the host's MemAvailable on the CPU) x
  --device-memory-utilization (the smallest the models give).
- A model's need: its plan's weights (in its encoding) + KV pool + request-state pools, as
  `maxjax suggest` reports them (planned from the checkpoint's header, nothing loaded).
- A model without --num-kv-pages has its pool planned as one model's is (engine/memory.py),
  from an even share of the budget: budget / the models that may be loaded at once
  (--max-loaded-models, else all), in place of the free memory x utilization, so that those
  models fit together; the pages are then pinned, so every load of the model builds the same
  graphs (its compile cache entry) whatever else is loaded at the time.
"""
from __future__ import annotations

from dataclasses import dataclass

from maxjax.engine import memory
from maxjax.engine.config import EngineConfig

GiB = float(1 << 30)


@dataclass(frozen=True)
class MemoryBudget:
    bytes: int
    how: str                # where it comes from, for the start-up log
    loaded_at_once: int     # the models a default pool's share divides it among

    @property
    def share(self) -> int:
        return self.bytes // self.loaded_at_once

    def line(self) -> str:
        return (f"models memory budget {self.bytes / GiB:.3f} GiB ({self.how}); a default KV "
                f"pool is planned from 1/{self.loaded_at_once} of it "
                f"({self.share / GiB:.3f} GiB)")


@dataclass(frozen=True)
class ModelMemory:
    """One model's planned bytes once loaded."""
    weights: int
    kv_pool: int
    state: int
    num_kv_pages: int
    shared: bool            # its pool was planned from the budget's share

    @property
    def bytes(self) -> int:
        return self.weights + self.kv_pool + self.state

    def line(self) -> str:
        pool = "a share of the budget" if self.shared else "--num-kv-pages"
        state = f" + state pools {self.state / GiB:.3f} GiB" if self.state else ""
        return (f"{self.bytes / GiB:.3f} GiB: weights {self.weights / GiB:.3f} GiB + KV pool "
                f"{self.num_kv_pages} pages {self.kv_pool / GiB:.3f} GiB ({pool}){state}")


def budget(flag_bytes: int | None, utilizations, models: int,
           max_loaded: int | None) -> MemoryBudget:
    """The budget of `models` models (`flag_bytes`: --models-memory-budget's, None: unset)."""
    at_once = min(max_loaded or models, models)
    if flag_bytes is not None:
        return MemoryBudget(flag_bytes, "--models-memory-budget", at_once)
    util = min(utilizations)
    free = memory.device_free_bytes()
    return MemoryBudget(int(free * util), f"{free / GiB:.1f} GiB free x "
                                          f"--device-memory-utilization {util:.2f}", at_once)


def share_flags(cfg: EngineConfig, b: MemoryBudget) -> EngineConfig:
    """The flags a model's default pool is planned with: its utilization the budget's share of
    the free memory now (the memory planner then plans share - weights - activations, as one
    model's from free x utilization); `cfg` as it is when --num-kv-pages sets the pool."""
    if cfg.num_kv_pages is not None:
        return cfg
    free = memory.device_free_bytes()
    return cfg.replace(device_memory_utilization=max(min(1.0, b.share / free), 1e-9))


def pinned(cfg: EngineConfig, num_kv_pages: int) -> EngineConfig:
    """`cfg` with the pool its share was planned at, for every load of the model."""
    return cfg if cfg.num_kv_pages is not None else cfg.replace(num_kv_pages=num_kv_pages)


def model_memory(report: dict, shared: bool) -> ModelMemory:
    """The need of a model from `maxjax suggest`'s report of its plan (maxjax/cli/suggest.py
    `plan_into`)."""
    plan = report["plan"]
    state = (plan.get("request_state") or {}).get("bytes", 0)
    return ModelMemory(report["weights"]["bytes"], plan["kv_pool_bytes"], state,
                       plan["num_kv_pages"], shared)
