"""`--data-parallel-degree 2` x TP=2 on the 4 host devices tests/conftest.py forces, behind one
real server: completions equal the single-device run's, concurrent requests land on both
replicas, a repeated prefix goes to the replica caching it, /metrics labels each replica, and a
replica that fails ends its requests with an error while the other goes on serving."""
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from maxjax.cli.args import ModelOptions
from maxjax.cli.serve import build_engine
from maxjax.engine.config import EngineConfig
from maxjax.engine.replicas import ReplicatedEngine
from maxjax.engine.stats import ReplicaStats
from maxjax.engine.types import SamplingParams
from maxjax.llm import LLM
from maxjax.server.config import ServeConfig
from server_harness import ServerThread
from tiny_llama import write_tiny_llama

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

ENGINE = dict(max_batch_size=4, max_batch_input_tokens=16, max_length=64, num_kv_pages=24,
              kv_cache_page_size=8)
PROMPTS = [" ".join(f"w{(7 * i + j) % 500 + 3}" for j in range(5 + i)) for i in range(6)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny4dp"), num_kv_heads=4)


@pytest.fixture(scope="module")
def server(tiny_path):
    engine = build_engine(ModelOptions(model_path=tiny_path),
                          EngineConfig(devices="cpu:4", data_parallel_degree=2, **ENGINE),
                          ServeConfig(), progress=False)
    assert isinstance(engine, ReplicatedEngine)
    srv = ServerThread(engine)
    yield srv
    srv.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_path):
    llm = LLM(tiny_path, quantization_encoding="float32", **ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    return [o.text for o in outs]


def complete(srv, prompt: str, max_tokens: int = 16) -> dict:
    body = json.dumps({"model": srv.engine.model_name, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(srv.url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, **json.loads(e.read())}


def replica_stats(srv) -> tuple[ReplicaStats, ...]:
    return srv.engine.stats().replicas


def test_replicas_sit_on_disjoint_devices(server):
    meshes = [r.core.layout.mesh for r in server.engine.replicas]
    assert [m.size for m in meshes] == [2, 2]
    assert not set(meshes[0].devices.flat) & set(meshes[1].devices.flat)


def test_concurrent_requests_use_both_replicas_and_match_one_device(server, reference):
    before = [s.routed for s in replica_stats(server)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: complete(server, p), PROMPTS))
    assert [o["choices"][0]["text"] for o in outs] == reference
    routed = [s.routed - b for s, b in zip(replica_stats(server), before)]
    assert sum(routed) == len(PROMPTS) and min(routed) >= 2, routed
    assert all(r.core.step_compiles == 0 for r in server.engine.replicas)
    assert all(s.engine.kv.pages_used == 0 for s in replica_stats(server))


def test_a_repeated_prefix_goes_to_the_replica_that_cached_it(server):
    prefix = " ".join(f"w{i}" for i in range(100, 133))        # 33 tokens: 4 full pages
    complete(server, prefix, 4)
    stats = replica_stats(server)
    holder = max(range(2), key=lambda i: stats[i].engine.kv.pages_cached)
    assert stats[holder].engine.kv.pages_cached >= 4
    for _ in range(3):       # the other replica has routed fewer: load alone would pick it
        before = [s.prefix_routed for s in replica_stats(server)]
        complete(server, prefix + " w7 w8", 4)
        after = [s.prefix_routed for s in replica_stats(server)]
        assert after[holder] == before[holder] + 1 and after[1 - holder] == before[1 - holder]


def test_metrics_label_each_replica(server):
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    for i in (0, 1):
        assert f'maxjax_replica_up{{replica="{i}"}} 1.0' in text
        assert f'maxjax_replica_requests_routed_total{{replica="{i}"}}' in text


def test_a_failed_replica_ends_its_requests_and_the_other_serves(server, reference):
    engine = server.engine
    broken = min(range(2), key=lambda i: (engine.in_flight[i], engine.routed[i], i))
    core = engine.replicas[broken].core

    def lost_device():
        raise RuntimeError("device lost")
    core.step = lost_device
    failed = complete(server, PROMPTS[0])          # routed to `broken`: fewest routed
    assert failed.get("status", 200) >= 500 or \
        failed["choices"][0]["finish_reason"] == "error", failed
    for prompt, want in zip(PROMPTS, reference):
        assert complete(server, prompt)["choices"][0]["text"] == want
    stats = replica_stats(server)
    assert not stats[broken].up and stats[1 - broken].up
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        assert f'maxjax_replica_up{{replica="{broken}"}} 0.0' in r.read().decode()


def test_a_second_start_loads_every_replica_from_the_compile_cache(server, tiny_path, caplog):
    """A replica of two devices (TP=2) runs executables compiled for its own mesh: each keeps
    its own compile cache entry (one replica's entry used to be refused by the next and compiled
    again on every start). One-device replicas share one: tests/test_kernels_default.py."""
    import logging

    from maxjax.engine import compile_counter
    before = compile_counter.count()
    with caplog.at_level(logging.WARNING, logger="maxjax.cache"):
        engine = build_engine(ModelOptions(model_path=tiny_path),
                              EngineConfig(devices="cpu:4", data_parallel_degree=2, **ENGINE),
                              ServeConfig(), progress=False)
    try:
        assert "refused" not in caplog.text
        assert compile_counter.count() == before
    finally:
        engine.shutdown()
