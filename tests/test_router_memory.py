"""The memory cap of a server of several models (server/router.py with
maxjax/engine/model_memory.py), on engines that are stand-ins (no model): which models a load
unloads under the budget and the count cap, that an unload waits for the model's requests, and
that a model whose plan alone exceeds the budget is a 503 naming it and its bytes. The real
engines' test is tests/test_multi_model_memory.py."""
from __future__ import annotations

import asyncio

import pytest

from maxjax.engine.model_memory import ModelMemory
from maxjax.engine.stats import EngineStats
from maxjax.errors import UserError
from maxjax.server.config import ServeConfig
from maxjax.server.protocol import APIError
from maxjax.server.router import ModelRouter, ModelSlot, RoutedState

MiB = 1 << 20


class StandIn:
    """An engine as the router sees one: stats (idle), shutdown."""

    def __init__(self, name: str, events: list):
        self.name, self.events = name, events
        events.append(("load", name))

    def stats(self) -> EngineStats:
        return EngineStats()

    def shutdown(self) -> None:
        self.events.append(("unload", self.name))

    def lora_adapters(self) -> dict:
        return {}


def router_of(sizes: dict[str, int], budget: int | None, max_loaded: int | None = None):
    events: list = []
    cfg = ServeConfig()
    slots = [ModelSlot(name, (lambda n=name: StandIn(n, events)), cfg,
                       memory=ModelMemory(mib * MiB, 0, 0, 0, False))
             for name, mib in sizes.items()]
    router = ModelRouter(slots, max_loaded, budget)
    RoutedState(router, cfg)        # attaches the server's side
    return router, events


def loaded(router) -> set[str]:
    return {s.name for s in router.slots.values() if s.loaded}


def test_a_load_unloads_the_least_recently_used_until_it_fits():
    async def run():
        router, events = router_of({"a": 40, "b": 40, "c": 40, "big": 70}, budget=100 * MiB)
        for name in ("a", "b"):
            await router.load(name)
        await router.load("a")              # b is now the least recently used
        await router.load("c")              # 120 MiB > 100: b goes, a stays
        assert loaded(router) == {"a", "c"}
        assert events[-2:] == [("unload", "b"), ("load", "c")]
        await router.load("big")            # 70 + 40 > 100 with either: both go
        assert loaded(router) == {"big"}
        assert events[-3:] == [("unload", "a"), ("unload", "c"), ("load", "big")]
    asyncio.run(run())


def test_the_count_cap_still_holds_under_a_large_budget():
    async def run():
        router, events = router_of({"a": 1, "b": 1, "c": 1}, budget=1 << 40, max_loaded=2)
        for name in ("a", "b", "c"):
            await router.load(name)
        assert loaded(router) == {"b", "c"}
        assert ("unload", "a") in events
        # no budget at all (an unplanned server): the count alone
        router, _ = router_of({"a": 1, "b": 1}, budget=None, max_loaded=1)
        await router.load("a")
        await router.load("b")
        assert loaded(router) == {"b"}
    asyncio.run(run())


def test_an_unload_waits_for_the_models_requests():
    async def run():
        router, events = router_of({"a": 60, "b": 60}, budget=100 * MiB)
        held = await router.acquire("a")        # a request in flight on a
        loading = asyncio.ensure_future(router.load("b"))
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not loading.done() and loaded(router) == {"a"}
        assert router.slots["a"].draining
        router.release(held)                    # its request ends: a unloads, b loads
        await asyncio.wait_for(loading, 60)
        assert loaded(router) == {"b"}
        assert events == [("load", "a"), ("unload", "a"), ("load", "b")]
    asyncio.run(run())


def test_a_model_bigger_than_the_budget_alone_is_a_503_naming_it_and_its_bytes():
    async def run():
        router, events = router_of({"a": 10, "huge": 200}, budget=100 * MiB)
        await router.load("a")
        with pytest.raises(APIError) as e:
            await router.load("huge")
        err = e.value
        assert err.status == 503 and err.code == "model_too_large" and err.param == "model"
        assert "'huge'" in err.message and str(200 * MiB) in err.message
        assert str(100 * MiB) in err.message
        assert loaded(router) == {"a"}          # nothing was unloaded for it
        assert events == [("load", "a")]
        assert err.body()["error"]["type"] == "service_unavailable_error"
    asyncio.run(run())


def test_a_first_model_bigger_than_the_budget_stops_the_start():
    router, events = router_of({"huge": 200, "a": 10}, budget=100 * MiB)
    with pytest.raises(UserError, match="'huge' needs"):
        router.start_first()
    assert events == []


def test_the_budget_flag_is_a_size():
    assert ServeConfig(models_memory_budget="1.5G").models_memory_budget == "1.5G"
    for bad in ("lots", "-1G", "0"):
        with pytest.raises(UserError, match="--models-memory-budget"):
            ServeConfig(models_memory_budget=bad)
