"""The memory cap of a server of several models (server/router.py, maxjax/engine/model_memory.py,
maxjax/cli/multi_model.py `plan_memory`) on real engines: three tiny random Llamas and a fourth
whose KV pool alone is larger than --models-memory-budget, a budget that holds two of the three
by their plans. A request for the third waits for the least recently used one's stream to
finish, unloads it and loads the third from the compile cache (0 compiles); the big one is a 503
naming it and its bytes; /v1/models shows each model's planned bytes. And the default KV pool of
several models is planned from an even share of the budget, not from all the free memory."""
from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from server_harness import ServerThread, http
from tiny_llama import write_tiny_llama

from maxjax.cli.args import ModelOptions
from maxjax.cli.multi_model import ModelSpec, plan_memory, router_of
from maxjax.engine import compile_counter
from maxjax.engine.config import EngineConfig
from maxjax.server.config import ServeConfig

KEY = "memory-cap-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TINY = dict(max_length=128, max_batch_size=4, max_batch_input_tokens=16, kv_cache_page_size=8,
            num_kv_pages=24)
PROMPT = "w5 w6 w7"
GiB = 1 << 30
LONG = 100      # tokens of the stream that holds the least recently used model in use


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> list[ModelSpec]:
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    return [ModelSpec(name, ModelOptions(model_path=path), EngineConfig(**TINY), {})
            for name in ("a", "b", "c")] + [
        ModelSpec("huge", ModelOptions(model_path=path),
                  EngineConfig(**{**TINY, "num_kv_pages": 4000}), {})]


@pytest.fixture(scope="module")
def served(specs):
    planned, _ = plan_memory(specs, ServeConfig(models_memory_budget="1G"))
    needs = [p.memory for p in planned]
    one = needs[0].bytes
    assert [n.bytes for n in needs[:3]] == [one] * 3 and needs[3].bytes > 3 * one
    budget = 2 * one + one // 2                 # holds two of a, b, c
    cfg = ServeConfig(models_memory_budget=str(budget), api_key=KEY)
    router = router_of(specs, cfg)
    router.start_first()
    server = ServerThread(router, cfg)
    yield router, server, needs, budget
    server.close()
    router.shutdown()


def post(url: str, path: str, body: dict, timeout=300):
    return http("POST", url + path, body, headers=AUTH, timeout=timeout)


def complete(url: str, name: str) -> dict:
    r = post(url, "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 4,
                                      "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def models(url: str) -> dict:
    r = http("GET", url + "/v1/models", headers=AUTH)
    assert r.status_code == 200, r.text
    return {c["id"]: (c["loaded"], c["planned_bytes"]) for c in r.json()["data"]}


def test_models_list_their_planned_bytes(served):
    router, server, needs, budget = served
    want = [n.bytes for n in needs]
    assert models(server.url) == {"a": (True, want[0]), "b": (False, want[1]),
                                  "c": (False, want[2]), "huge": (False, want[3])}
    # the plan is what `maxjax suggest` reports: weights + KV pool (24 pages)
    assert needs[0].num_kv_pages == 24 and needs[0].bytes == needs[0].weights + needs[0].kv_pool
    assert needs[3].kv_pool == needs[0].kv_pool * 4000 // 24


def test_third_model_waits_unloads_lru_and_loads_from_the_cache(served):
    router, server, needs, budget = served
    complete(server.url, "b")
    assert {k: v[0] for k, v in models(server.url).items()} == {
        "a": True, "b": True, "c": False, "huge": False}
    # a streams a long answer; b is used after it, so a is the least recently used
    body = {"model": "a", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **AUTH})
    stream = urllib.request.urlopen(req, timeout=300)
    first = stream.readline()
    assert first.startswith(b"data: "), first
    complete(server.url, "b")
    compiles = compile_counter.count()
    third: dict = {}

    def ask_third():
        third["answer"] = complete(server.url, "c")
        third["models_after"] = models(server.url)

    asker = threading.Thread(target=ask_third)
    asker.start()
    lines = [first] + stream.readlines()        # the whole stream: a was not cut off
    stream.close()
    events = [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length"]
    assert [e["usage"]["completion_tokens"] for e in events if e.get("usage")] == [LONG]
    asker.join(300)
    assert "answer" in third, "the request for c did not finish"
    assert third["answer"]["choices"][0]["text"]
    assert {k: v[0] for k, v in third["models_after"].items()} == {
        "a": False, "b": True, "c": True, "huge": False}
    assert compile_counter.count() - compiles == 0      # from the compile cache


def test_a_model_too_big_for_the_budget_is_a_503_naming_it_and_its_bytes(served):
    router, server, needs, budget = served
    before = {k: v[0] for k, v in models(server.url).items()}
    r = post(server.url, "/v1/completions", {"model": "huge", "prompt": PROMPT, "max_tokens": 1})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "model_too_large" and err["param"] == "model"
    assert "'huge'" in err["message"] and str(needs[3].bytes) in err["message"]
    assert str(budget) in err["message"]
    r = post(server.url, "/v1/models/huge/load", {})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_too_large"
    assert {k: v[0] for k, v in models(server.url).items()} == before   # nothing unloaded
    complete(server.url, "b")                                           # the others serve


def test_default_pools_of_several_models_share_the_budget(specs):
    """Without --num-kv-pages each model's pool is planned from budget / the models loaded at
    once (here 2 of 2), less its weights, activations and (on the CPU) the compiler allowance
    of at most 1 GiB; one model alone plans its pool from all of it, so two such would not fit
    together."""
    from maxjax.engine import memory
    if memory.device_free_bytes() < 4 * GiB:
        pytest.skip("plans a 3 GiB budget: less than 4 GiB is free here")
    roomy = EngineConfig(max_length=512, max_batch_size=16384, max_batch_input_tokens=16,
                         kv_cache_page_size=8)
    budget = ServeConfig(models_memory_budget="3G")
    two = [ModelSpec(n, specs[0].model, roomy, {}) for n in ("x", "y")]
    planned, b = plan_memory(two, budget)
    needs = [p.memory for p in planned]
    assert b.bytes == 3 * GiB and b.loaded_at_once == 2
    assert all(n is not None and n.shared for n in needs)
    assert sum(n.bytes for n in needs) <= b.bytes
    # memory decided the pool, not the rows' cap (16384 rows of 512 tokens: 4 GiB)
    assert all(2 <= n.num_kv_pages < 16384 * 64 for n in needs)
    # and it is pinned: every load of the model builds the same graphs
    assert [p.spec.engine.num_kv_pages for p in planned] == [n.num_kv_pages for n in needs]
    [alone], _ = plan_memory(two[:1], budget)
    assert alone.memory.num_kv_pages > needs[0].num_kv_pages
    assert 2 * alone.memory.bytes > b.bytes


def test_suggest_prints_each_models_plan_and_the_budget(specs, capsys, tmp_path):
    """`maxjax suggest --models-file`: the plan serve logs at start, one line a model; --json
    the same numbers; 1 when the first model is over the budget (serve would not start)."""
    import yaml

    from maxjax import cli
    path = specs[0].model.model_path
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump([{"name": "a", "model": path, **TINY},
                                      {"name": "huge", "model": path,
                                       **{**TINY, "num_kv_pages": 4000}}]))
    planned, _ = plan_memory(specs, ServeConfig(models_memory_budget="1G"))
    small, huge = planned[0].memory, planned[3].memory
    budget = 2 * small.bytes
    assert cli.main(["suggest", "--models-file", str(models), "--models-memory-budget",
                     str(budget)]) == 0
    text = capsys.readouterr().out
    assert "--models-memory-budget" in text and "1/2 of it" in text
    assert f"model a: {small.line()}" in text
    assert f"model huge: {huge.line()} (over the budget alone" in text
    assert cli.main(["suggest", "--json", "--models-file", str(models), "--models-memory-budget",
                     str(budget), "--max-loaded-models", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["budget_bytes"] == budget and r["loaded_at_once"] == 1
    assert [(m["name"], m["planned_bytes"], m["fits_budget"]) for m in r["models"]] == [
        ("a", small.bytes, True), ("huge", huge.bytes, False)]
    models.write_text(yaml.safe_dump([{"name": "huge", "model": path,
                                       **{**TINY, "num_kv_pages": 4000}},
                                      {"name": "a", "model": path, **TINY}]))
    assert cli.main(["suggest", "--models-file", str(models), "--models-memory-budget",
                     str(budget)]) == 1
