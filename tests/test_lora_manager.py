"""LoraManager and the Scheduler's LoRA admission, on the tiny Llama's config with real PEFT
adapters and the mock model (its tokens ignore adapters, so every output has a hand-checkable
reference): a request waiting for a device slot is passed over and holds up no one behind it;
host memory (--max-cpu-loras) evicts the least recently used idle adapter, which a request
naming it reads again from its path; unloading refuses new requests at once and drops the
adapter when the last request using it ends."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from maxjax.engine.block_manager import BlockManager
from maxjax.engine.config import EngineConfig
from maxjax.engine.request import Request
from maxjax.engine.scheduler import Scheduler
from maxjax.engine.types import SamplingParams
from maxjax.errors import RequestError
from maxjax.lora.manager import LoraManager
from maxjax.models.loader import load_model
from lora_adapters import write_peft_adapter
from mock_model import MockModel, drive, reference_generate
from pool_check import check_pool
from tiny_llama import write_tiny_llama

VOCAB = 1000
PAGE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_manager")
    model_dir = write_tiny_llama(d / "model")
    paths = {k: write_peft_adapter(model_dir, d / k, seed=i, r=2, targets=("q_proj",))[0]
             for i, k in enumerate("abc")}
    return SimpleNamespace(cfg=load_model(model_dir, "float32", progress=False).config,
                           paths=paths, dir=d)


def manager(tiny, slots=1, host=16, names="ab") -> LoraManager:
    m = LoraManager(tiny.cfg, "float32", slots, 4, host)
    for n in names:
        m.load(n, tiny.paths[n])
    return m


def scheduler(lora, rows=4, budget=16) -> Scheduler:
    cfg = EngineConfig(max_batch_size=rows, max_batch_input_tokens=budget, kv_cache_page_size=PAGE)
    return Scheduler(cfg, BlockManager(64, PAGE, True), 128, lora=lora)


def add(s, lora, rid, prompt, n, adapter=None) -> Request:
    uid = None if adapter is None else lora.resolve(adapter)
    req = Request(rid, list(prompt), SamplingParams(max_new_tokens=n), adapter_id=uid)
    s.add(req)
    return req


def step(s, model):
    plan = s.schedule()
    s.update(plan, model.run(plan.rows))
    return [r.request.request_id for r in plan.rows]


def test_request_waiting_for_a_slot_holds_up_no_one(tiny):
    lora = manager(tiny, slots=1)
    s, model = scheduler(lora), MockModel(PAGE, VOCAB)
    reqs = [add(s, lora, "a1", range(1, 6), 12, "a")]
    assert step(s, model) == ["a1"]                  # a holds the one slot
    reqs += [add(s, lora, "b1", range(10, 14), 3, "b"), add(s, lora, "base", range(20, 25), 3),
             add(s, lora, "a2", range(30, 33), 3, "a")]
    assert step(s, model) == ["a1", "base", "a2"]    # b1 is passed over, keeps its place
    assert [r.request_id for r in s.waiting] == ["b1"] and reqs[1].lora_slot == 0
    add(s, lora, "late", range(40, 43), 2)
    assert step(s, model) == ["a1", "base", "a2", "late"]
    while "b1" not in step(s, model):
        pass
    assert reqs[0].is_finished and reqs[3].is_finished   # b1 ran once a1 and a2 freed the slot
    assert reqs[1].lora_slot == 1 and lora.slot_uid[1] == lora.resolve("b")
    drive(s, model)
    for r in reqs:
        assert r.output_token_ids == reference_generate(r.prompt_token_ids,
                                                        r.sampling.max_new_tokens, VOCAB)
    check_pool(s.bm, [])
    assert lora.refs == [0, 0] and all(e.users == 0 for e in lora.entries.values())


def test_host_cap_evicts_the_least_recently_used_idle_adapter(tiny):
    lora = manager(tiny, slots=2, host=2)
    a_uid = lora.resolve("a")                        # a is now more recent than b
    lora.load("c", tiny.paths["c"])                  # evicts b, the LRU idle one
    assert lora.names() == ["a", "b", "c"] and lora.evictions == 1
    assert lora.served["b"].adapter is None and lora.served["a"].adapter is not None
    s = scheduler(lora)
    add(s, lora, "r-c", range(1, 5), 2, "c")
    add(s, lora, "r-a", range(1, 5), 2, "a")         # a and c have users: neither may go
    with pytest.raises(RequestError, match=r"all 2 adapters in host memory \(--max-cpu-loras\) "
                                           r"are in use") as e:
        lora.resolve("b")
    assert e.value.param == "model"
    drive(s, MockModel(PAGE, VOCAB))
    assert lora.resolve("b") == "b#4"                # read again from its path, a new load id
    # c was named before a: it was the least recently used, so it made room for b
    assert lora.served["c"].adapter is None and lora.resolve("a") == a_uid
    assert lora.resolve("c") == "c#5" and lora.served["b"].adapter is None
    assert lora.evictions == 3


def test_evicted_adapter_whose_files_are_gone_is_a_clear_error(tiny):
    path = str(tiny.dir / "gone")
    shutil.copytree(tiny.paths["a"], path)
    lora = LoraManager(tiny.cfg, "float32", 1, 4, 1)
    lora.load("gone", path)
    lora.load("b", tiny.paths["b"])                  # evicts "gone"
    shutil.rmtree(path)
    with pytest.raises(RequestError, match=r"adapter 'gone' left host memory \(--max-cpu-loras "
                                           r"1\) and cannot be read again: .*no adapter_config"):
        lora.resolve("gone")
    assert lora.names() == ["gone", "b"]             # still served: restoring the files fixes it


def test_unload_refuses_new_requests_and_drops_after_the_last_user(tiny):
    lora = manager(tiny, slots=1)
    s, model = scheduler(lora), MockModel(PAGE, VOCAB)
    running = add(s, lora, "run", range(1, 6), 4, "a")
    step(s, model)
    queued = add(s, lora, "queued", range(7, 9), 2, "a")
    uid = lora.unload("a")
    assert lora.names() == ["b"] and lora.users(uid) == 2
    with pytest.raises(RequestError, match="'a' is not loaded") as e:
        lora.resolve("a")
    assert e.value.param == "model"
    lora.load("a", tiny.paths["a"])                  # the name again: another load, no clash
    assert lora.resolve("a") != uid
    drive(s, model)
    assert lora.users(uid) == 0 and uid not in lora.entries and uid not in lora.slot_uid
    for r in (running, queued):
        assert r.output_token_ids == reference_generate(r.prompt_token_ids,
                                                        r.sampling.max_new_tokens, VOCAB)
    with pytest.raises(RequestError, match="'zzz' is not loaded") as e:
        lora.unload("zzz")
    assert e.value.param == "lora_name"
