"""A hybrid model's request state through the real engine (issue 58 item 1), on the toy hybrid of
tests/toy_hybrid.py (registered as --custom-architectures modules are): the plan's state pools
(max batch size + 1 slots and as many prefix-cache snapshots, their bytes out of the memory
budget, --state-pool-dtype; speculation: tests/test_hybrid_speculative.py), and greedy tokens
served batched, in chunks whose boundaries fall inside the prompts, and after a preemption, equal to
tests/paged_harness.py driving the same graph with one slot a prompt (the prefix cache on:
later tests' prompts resume from the earlier ones' snapshots); the prefix cache's state
snapshots (tests/hybrid_prefix.py)."""
import json
import os

import jax
import numpy as np
import pytest

from maxjax.engine.config import EngineConfig
from maxjax.engine.types import SamplingParams
from maxjax.errors import UserError
from engine_runs import run_preempting
from hybrid_prefix import check_mixed_with_preemption, check_shared_prefix
from paged_harness import load_checkpoint, paged_greedy

pytestmark = pytest.mark.slow

TOY = os.path.join(os.path.dirname(__file__), "toy_hybrid.py")
NEW_TOKENS = 24
# 4 rows, 16 tokens a step: the 29- and 21-token prompts are cut inside, and so is the batch's
ENGINE = dict(max_batch_size=4, max_batch_input_tokens=16, max_length=96, num_kv_pages=48,
              kv_cache_page_size=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from toy_hybrid import register, write_toy_hybrid
    register()
    return write_toy_hybrid(tmp_path_factory.mktemp("toy_hybrid"))


@pytest.fixture(scope="module")
def model(checkpoint):
    from maxjax.models.loader import load_model
    return load_model(checkpoint, "float32", progress=False)


@pytest.fixture(scope="module")
def core(model):
    from maxjax.engine.build import build_core
    return build_core(model, EngineConfig(**ENGINE))


def _prompts():
    rng = np.random.default_rng(1)
    return [list(map(int, rng.integers(3, 256, n))) for n in (5, 13, 29, 21)]


@pytest.fixture(scope="module")
def expected(checkpoint):
    arch, cfg, params = load_checkpoint(checkpoint)
    _, tokens = paged_greedy(arch, cfg, params, _prompts(), chunk=7, new_tokens=NEW_TOKENS,
                             page_size=8)
    return tokens


def _greedy():
    return SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def test_the_engine_holds_state_pools_of_batch_size_plus_one_slots_and_snapshots(core, model):
    from maxjax.graphs.state import conv_channels
    mc = model.config
    assert mc.state_layers == (False, True, True)
    k, v, conv, rec = jax.tree.leaves(core.runner.kv)
    assert k.shape[0] == 1 and v.shape[0] == 1           # one paged layer: the attention one
    assert conv.shape == (2, 9, conv_channels(mc), mc.ssm_conv_kernel - 1)
    assert rec.shape == (2, 9, mc.ssm_heads, mc.ssm_state_dim, mc.ssm_head_dim)
    assert conv.dtype == rec.dtype == np.float32
    assert core.layout.state_slots == 9 and core.cfg.enable_prefix_caching
    assert core.state_slots.num_free == 4 and core.state_slots.num_slots == 5
    assert (core.snapshots.first, core.snapshots.count) == (5, 4)      # after the requests'


def test_batched_chunked_equals_the_paged_harness(core, expected):
    prompts = _prompts()
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, _greedy())
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    starts = set()
    while core.has_unfinished():
        for r in core.scheduler.running:
            starts.add((r.request_id, r.num_computed_tokens))
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    # chunks began inside the 29- and 21-token prompts (not only at their starts)
    assert any(rid == "r2" and 0 < n < 29 for rid, n in starts)
    assert any(rid == "r3" and 0 < n < 21 for rid, n in starts)
    for i in range(len(prompts)):
        assert tokens[f"r{i}"] == expected[i], i
    assert core.state_slots.num_free == 4


def test_recomputed_after_preemption_equals_the_paged_harness(core, expected):
    """Requests preempted mid-decode give their slots back and restart at position 0 with
    whichever slot they get again: the graphs start them from zero state."""
    prompts = _prompts()

    def slots_back():
        assert core.state_slots.num_free == 4
    tokens = run_preempting(core, {f"p{i}": prompts[i] for i in (2, 1, 0)}, _greedy(), "p2",
                            on_preempt=slots_back)
    for i in (2, 1, 0):
        assert tokens[f"p{i}"] == expected[i], i


def test_parallel_requests_of_one_prompt_each_keep_their_state(core, expected):
    """n > 1 is n requests of one prompt: each its own slot, none shares another's state."""
    prompt = _prompts()[3]
    for j in range(3):
        core.add_request(f"n{j}", prompt, _greedy())
    tokens = {f"n{j}": [] for j in range(3)}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert all(t == expected[3] for t in tokens.values())


def test_a_shared_prefix_resumes_from_its_state_snapshot(core):
    check_shared_prefix(core, 256, NEW_TOKENS)


def test_mixed_workload_with_preemption_leaks_no_slot(core):
    check_mixed_with_preemption(core, 256, 12)


def test_the_plan(model, monkeypatch):
    from maxjax.engine import memory
    from maxjax.engine.plan import plan_engine
    from maxjax.graphs.state import RECURRENT
    per = RECURRENT.values_per_request(model.config)
    plan = plan_engine(EngineConfig(**ENGINE), model)
    lay = plan.layout
    assert (lay.state_slots, lay.state_snapshots, lay.state_dtype) == (9, 4, "float32")
    assert plan.config.enable_prefix_caching
    snap_mib = f"{4 * per * 4 / (1 << 20):.2f} MiB"
    assert f"9 slots (4 requests + 4 prefix-cache snapshots of {snap_mib} + scratch)" in \
        lay.state_report
    off = plan_engine(EngineConfig(**ENGINE, enable_prefix_caching=False), model)
    assert not off.config.enable_prefix_caching
    assert (off.layout.state_slots, off.layout.state_snapshots) == (5, 0)
    assert "no prefix-cache snapshots (--no-enable-prefix-caching)" in off.layout.state_report
    bf16 = plan_engine(EngineConfig(**ENGINE, state_pool_dtype="bfloat16"), model).layout
    assert bf16.state_dtype == "bfloat16" and bf16.kv_dtype == "float32"
    from maxjax.aot.graphs import pool_specs          # what the graphs and artifacts take
    assert [str(s.dtype) for s in pool_specs(model, bf16)] == ["float32"] * 2 + ["bfloat16"] * 2
    from maxjax.aot.manifest import engine_fingerprint
    fps = [engine_fingerprint(x, plan.config, "float32") for x in (lay, bf16)]
    assert fps[0]["state_pool_dtype"] == "float32" and fps[0]["state_slots"] == 9
    assert fps[0]["fingerprint"] != fps[1]["fingerprint"]
    big = plan_engine(EngineConfig(**{**ENGINE, "max_batch_size": 8}), model).layout
    assert big.state_slots == 17
    spec = plan_engine(EngineConfig(**ENGINE, speculative_method="ngram",
                                    num_speculative_tokens=2), model).layout
    assert (spec.state_slots, spec.state_spec) == (17, 8)    # 4 x 2 to roll speculation back
    with pytest.raises(UserError, match="--state-pool-dtype 'float16': one of bfloat16, float32"):
        plan_engine(EngineConfig(**ENGINE, state_pool_dtype="float16"), model)
    # the state pools' bytes come out of the budget before the pages are sized
    monkeypatch.setattr(memory, "device_free_bytes", lambda device=None: 8 << 30)
    page = memory.page_bytes(model.config, 8, 4)
    state = 9 * per * 4
    pools = []
    for reserve in (0, state):
        pools.append(memory.plan_pool(model.config, model.params, 8, 0.9, list(lay.buckets),
                                      10 ** 9, state_bytes=reserve))
    assert pools[0].fit - pools[1].fit in (state // page, state // page + 1)
    assert "request state" in pools[1].report() and "request state" not in pools[0].report()


def test_a_model_without_state_layers_ignores_the_flag(tmp_path):
    from maxjax.engine.plan import plan_engine
    from maxjax.models.loader import load_model
    from tiny_llama import write_tiny_llama
    llama = load_model(write_tiny_llama(tmp_path / "llama"), "float32", progress=False)
    plan = plan_engine(EngineConfig(**ENGINE, state_pool_dtype="bfloat16"), llama)
    assert plan.layout.state_slots == 0 and plan.layout.state_report == ""
    assert plan.config.enable_prefix_caching


def test_suggest_and_list_show_the_state(checkpoint, capsys):
    from maxjax import cli
    from maxjax.graphs.state import RECURRENT
    code = cli.main(["suggest", "--json", "--model", checkpoint, "--custom-architectures", TOY,
                     "--max-batch-size", "4", "--num-kv-pages", "48", "--max-length", "96",
                     "--kv-cache-page-size", "8", "--state-pool-dtype", "bfloat16"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report["notes"]
    st = report["plan"]["request_state"]
    assert st["slots"] == 9 and st["state_pool_dtype"] == "bfloat16"
    assert st["bytes"] == 9 * st["bytes_per_request"] and st["kind"] == RECURRENT.name
    assert st["snapshots"] == 4 and st["snapshot_bytes"] == 4 * st["bytes_per_request"]
    assert "4 prefix-cache snapshots" in st["line"]
    assert not any("prefix cache off" in n for n in report["notes"])
    assert "--state-pool-dtype bfloat16" in report["command"]
    assert cli.main(["list", "--json"]) == 0         # registered in this process already
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["ToyHybridForCausalLM"]["request_state"] == RECURRENT.name
    assert rows["LlamaForCausalLM"]["request_state"] == ""
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert f"state: kv + {RECURRENT.name} a request" in out.split("ToyHybridForCausalLM")[1]
