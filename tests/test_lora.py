"""Multi-LoRA on a tiny random Llama against transformers + peft (the reference): logits of the
graph with each adapter's slot, greedy tokens of the engine alone and in one mixed batch, prefix-
cache isolation between adapters, loading and unloading at run time without a compile, and the
errors for adapters that do not fit."""
from __future__ import annotations

import json
import re
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from maxjax import LLM
from maxjax.engine.core import make_lora_manager
from maxjax.engine.plan import lora_path_items
from maxjax.engine.config import EngineConfig
from maxjax.engine.types import SamplingParams
from maxjax.errors import RequestError, UserError
from maxjax.models.loader import load_model
from lora_adapters import hf_model, write_peft_adapter
from paged_harness import paged_greedy
from pool_check import check_pool
from reference import assert_logits_close, hf_greedy
from tiny_llama import write_tiny_llama

PROMPT = [5, 7, 9, 11, 3, 8, 20, 31, 4, 9, 100, 7, 2, 12, 40, 41, 42, 43, 44, 45]   # 2+ pages
NEW = 8
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    model_dir = write_tiny_llama(d / "model")
    adapters = {
        "a": write_peft_adapter(model_dir, d / "a", seed=1, r=4, alpha=8.0),
        "b": write_peft_adapter(model_dir, d / "b", seed=2, r=8, alpha=4.0, use_rslora=True,
                                targets=("q_proj", "v_proj", "down_proj")),
        "c": write_peft_adapter(model_dir, d / "c", seed=3, r=2, alpha=2.0,
                                targets=("k_proj", "o_proj", "up_proj")),
    }
    refs = {None: hf_greedy(hf_model(model_dir), PROMPT, NEW)}
    refs.update({k: hf_greedy(m, PROMPT, NEW) for k, (_, m) in adapters.items()})
    paths = {k: p for k, (p, _) in adapters.items()}
    model = load_model(model_dir, "float32", progress=False)
    llm = LLM(model, max_batch_size=4, max_batch_input_tokens=32, max_length=64, num_kv_pages=40,
              kv_cache_page_size=8, enable_lora=True, max_num_loras=2, max_lora_rank=8,
              lora_paths=[f"a={paths['a']}", f"b={paths['b']}"])
    core = llm.core
    while core.prime_next():
        pass
    return SimpleNamespace(llm=llm, core=core, model=model, refs=refs, paths=paths, dir=d)


@pytest.fixture(autouse=True)
def no_leaks(setup):
    yield
    core = setup.core
    assert not core.has_unfinished()
    check_pool(core.block_manager)
    assert core.block_manager.num_used_pages == 0
    assert core.step_compiles == 0
    assert all(r == 0 for r in core.lora.refs)


def run(core, requests: dict) -> dict:
    """request id -> (prompt, lora) run together to the end: id -> (tokens, cached tokens)."""
    for rid, (prompt, lora) in requests.items():
        core.add_request(rid, prompt, GREEDY, lora=lora)
    got = {rid: ([], 0) for rid in requests}
    while core.has_unfinished():
        for out in core.step():
            toks, cached = got[out.request_id]
            got[out.request_id] = (toks + out.new_token_ids, max(cached, out.cached_tokens))
    return got


def test_graph_logits_match_peft_per_slot(setup):
    core = setup.core
    lora = core.lora
    pins = {k: SimpleNamespace(adapter_id=lora.resolve(k), lora_slot=0) for k in ("a", "b")}
    for p in pins.values():
        lora.acquire(p)
    try:
        params = {**setup.model.params, "lora": lora.device}
        names = [None, "a", "b", "a"]
        slots = [0 if n is None else pins[n].lora_slot for n in names]
        logits, tokens = paged_greedy(setup.model.arch, setup.model.config, params,
                                      [PROMPT] * len(names), chunk=7, new_tokens=NEW,
                                      page_size=8, lora_slots=slots)
    finally:
        for p in pins.values():
            lora.release(p)
    for name, lg, tk in zip(names, logits, tokens):
        ref_logits, ref_tokens = setup.refs[name]
        assert_logits_close(lg, ref_logits, rel=1e-4)
        assert tk == ref_tokens, name
    assert not np.allclose(setup.refs["a"][0], setup.refs[None][0])   # the adapters do something


def test_mixed_batch_matches_each_alone_and_peft(setup):
    core = setup.core
    alone = {k: run(core, {k or "base": (PROMPT, k)})[k or "base"][0] for k in (None, "a", "b")}
    for k, toks in alone.items():
        assert toks == setup.refs[k][1], k
    core.block_manager.reset_prefix_cache()
    mixed = run(core, {"base": (PROMPT, None), "a": (PROMPT, "a"), "b": (PROMPT, "b"),
                       "a2": (PROMPT[:9], "a")})
    for k in ("a", "b"):
        assert mixed[k][0] == alone[k]
    assert mixed["base"][0] == alone[None]


def test_offline_generate_takes_a_lora_per_prompt(setup):
    outs = setup.llm.generate([PROMPT] * 3, GREEDY, lora=["b", None, "a"])
    assert [o.token_ids for o in outs] == [setup.refs[k][1] for k in ("b", None, "a")]
    with pytest.raises(RequestError, match="not loaded"):
        setup.llm.generate(PROMPT, GREEDY, lora="zzz")


def test_prefix_cache_is_keyed_by_adapter(setup):
    core = setup.core
    core.block_manager.reset_prefix_cache()
    first = run(core, {"x": (PROMPT, "a")})["x"]
    again = run(core, {"y": (PROMPT, "a")})["y"]
    other = run(core, {"z": (PROMPT, "b")})["z"]
    base = run(core, {"w": (PROMPT, None)})["w"]
    assert first[1] == 0 and again[1] > 0            # the cache works within an adapter
    assert other[1] == 0 and base[1] == 0            # and never across adapters
    assert other[0] == setup.refs["b"][1] and base[0] == setup.refs[None][1]


def test_load_use_unload_without_compiling(setup):
    core = setup.core
    swaps = core.lora.swaps
    core.load_lora("c", setup.paths["c"])
    got = run(core, {"c1": (PROMPT, "c"), "a1": (PROMPT, "a")})
    assert got["c1"][0] == setup.refs["c"][1] and got["a1"][0] == setup.refs["a"][1]
    got = run(core, {"b1": (PROMPT, "b")})            # 3 adapters, 2 slots: b swaps back in
    assert got["b1"][0] == setup.refs["b"][1]
    assert core.lora.swaps > swaps
    core.add_request("busy", PROMPT, GREEDY, lora="c")
    busy = [t for out in core.step() for t in out.new_token_ids]
    uid = core.unload_lora("c")                      # busy goes on; new requests are refused
    with pytest.raises(RequestError, match="not loaded") as e:
        core.add_request("gone", PROMPT, GREEDY, lora="c")
    assert e.value.param == "model"
    assert core.lora_names() == ["a", "b"] and core.lora_users(uid) == 1
    while core.has_unfinished():
        busy += [t for out in core.step() for t in out.new_token_ids]
    assert busy == setup.refs["c"][1] and core.lora_users(uid) == 0
    assert uid not in core.lora.entries
    core.load_lora("c", setup.paths["c"])            # the same name again: a fresh load id
    assert run(core, {"c2": (PROMPT, "c")})["c2"][0] == setup.refs["c"][1]
    core.unload_lora("c")


def test_host_cap_evicts_and_reads_an_adapter_again(setup):
    """--max-cpu-loras 1: each adapter named pushes the other out of host memory; read again
    from its path, it gives peft's tokens (a second engine of the same shapes: the compile
    cache's graphs)."""
    llm = LLM(setup.model, max_batch_size=4, max_batch_input_tokens=32, max_length=64,
              num_kv_pages=40, kv_cache_page_size=8, enable_lora=True, max_num_loras=2,
              max_lora_rank=8, max_cpu_loras=1,
              lora_paths=[f"a={setup.paths['a']}", f"b={setup.paths['b']}"])
    assert llm.core.lora_names() == ["a", "b"] and llm.core.lora.evictions == 1
    for name in ("a", "b", "a"):
        assert llm.generate(PROMPT, GREEDY, lora=name)[0].token_ids == setup.refs[name][1]
    assert llm.core.lora.evictions == 4 and llm.core.step_compiles == 0


def _broken_copy(src, dst, edit):
    import shutil
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    f = os.path.join(dst, "adapter_model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)
    return str(dst)


def test_mismatched_adapters_are_refused(setup):
    core, d = setup.core, setup.dir
    big, _ = write_peft_adapter(write_tiny_llama(d / "model2"), d / "big", seed=4, r=16)
    cases = {
        big: "rank 16 is above --max-lora-rank 8",
        _broken_copy(setup.paths["a"], d / "shape", lambda t: t.update(
            {k: np.zeros((4, 32), np.float32) for k in t if "q_proj.lora_A" in k})):
            "needs [r, 64]",
        _broken_copy(setup.paths["a"], d / "halfpair", lambda t: [
            t.pop(k) for k in list(t) if "layers.1.mlp.up_proj.lora_B" in k]): "lora_B is missing",
        str(d / "missing"): "no adapter_config.json",
    }
    os.makedirs(d / "missing", exist_ok=True)
    for path, message in cases.items():
        with pytest.raises(RequestError, match=re.escape(message)) as e:
            core.load_lora("bad", path)
        assert e.value.param == "lora_path"
    with open(os.path.join(setup.paths["a"], "adapter_config.json")) as f:
        conf = json.load(f)
    dora = d / "dora"
    os.makedirs(dora)
    with open(dora / "adapter_config.json", "w") as f:
        json.dump({**conf, "use_dora": True}, f)
    with pytest.raises(RequestError, match="use_dora"):
        core.load_lora("bad", str(dora))
    ranked = d / "ranked"                   # its tensors are rank 4
    os.makedirs(ranked)
    shutil.copy(os.path.join(setup.paths["a"], "adapter_model.safetensors"), ranked)
    with open(ranked / "adapter_config.json", "w") as f:
        json.dump({**conf, "r": 8}, f)
    with pytest.raises(RequestError, match="rank 4, but adapter_config.json says r=8"):
        core.load_lora("bad", str(ranked))
    assert core.lora_names() == ["a", "b"]
    with pytest.raises(RequestError, match="already loaded"):
        core.load_lora("a", setup.paths["a"])


def test_flag_errors_are_one_line(setup):
    cfg = EngineConfig(enable_lora=True, max_lora_rank=8, lora_paths=[f"x={setup.dir}/missing"])
    with pytest.raises(UserError, match=r"^--lora-paths x: \S+missing: no adapter_config.json") as e:
        make_lora_manager(cfg, setup.model, lora_path_items(cfg))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="PATH or NAME=PATH"):
        lora_path_items(EngineConfig(enable_lora=True, lora_paths=["=x"]))
    # a bare path, as max serve's --lora-paths takes it: the adapter is named by the path
    bare_cfg = EngineConfig(enable_lora=True, max_lora_rank=8, lora_paths=[setup.paths["a"]])
    bare = make_lora_manager(bare_cfg, setup.model, lora_path_items(bare_cfg))
    assert bare.resolve(setup.paths["a"]) is not None
    from maxjax.engine.plan import check_flags
    with pytest.raises(UserError, match="needs --enable-lora"):
        check_flags(EngineConfig(lora_paths=["a=b"]))
