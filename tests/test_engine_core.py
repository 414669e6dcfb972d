"""EngineCore on a tiny random Llama: per-request state lives on the Request, a stop string ends its
request inside the step that found it, and injected faults fail only the requests they hit: the
others finish with the tokens they get alone, and no page leaks."""
from __future__ import annotations

import jax
import pytest

from maxjax.engine import runner as runner_mod
from maxjax.engine.core import EngineCore
from maxjax.engine.output import merge_outputs
from maxjax.engine.types import SamplingParams
from engine_runs import run_to_end
from tiny_llama import tiny_core
from pool_check import check_pool

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
BAD_SEED = 4242          # marks the bad request's sample slots in the step arrays
BAD = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, seed=BAD_SEED)
PROMPTS = {"a": [5, 7, 9], "c": [11, 3, 8, 20, 31, 4, 9, 100, 7, 2, 12], "bad": [40, 41]}
FAIL_AT = 3              # the bad request fails once it has this many tokens


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    core = tiny_core(tmp_path_factory.mktemp("tiny"))
    while core.prime_next():
        pass
    return core


@pytest.fixture(scope="module")
def alone(core):
    return {rid: run_to_end(core, {rid: (p, GREEDY)})[rid].new_token_ids
            for rid, p in PROMPTS.items()}


@pytest.fixture(autouse=True)
def no_leaks(core):
    yield
    assert not core.has_unfinished()
    check_pool(core.block_manager)
    assert core.block_manager.num_used_pages == 0
    assert core.stats().xla_compiles_since_ready == 0


def together(core):
    return run_to_end(core, {rid: (p, BAD if rid == "bad" else GREEDY)
                             for rid, p in PROMPTS.items()})


def assert_only_bad_failed(outs, alone, match: str):
    bad = outs["bad"]
    assert bad.finish_reason == "error" and match in bad.error
    assert bad.new_token_ids == alone["bad"][:len(bad.new_token_ids)]
    for rid in ("a", "c"):
        assert outs[rid].finish_reason == "length"
        assert outs[rid].new_token_ids == alone[rid]


def test_request_carries_its_state(core):
    core.add_request("s", [5, 7], SamplingParams(seed=99, max_new_tokens=2))
    core.add_request("r", [5, 7], SamplingParams(max_new_tokens=2))
    reqs = core.scheduler.requests
    assert reqs["s"].seed == 99 and 0 <= reqs["r"].seed < 2**63
    core.step()
    assert reqs["s"].text is not None and reqs["s"].text.text
    assert not [k for k, v in vars(core).items() if isinstance(v, dict) and "s" in v]
    assert core.abort("s").finish_reason == "abort" and core.abort("r") is not None
    assert core.abort("r") is None


def test_stop_string_ends_the_request_in_its_step(core, alone):
    words = [f"w{t}" for t in alone["c"]]
    k = next(i for i in range(2, len(words)) if words[i] not in " ".join(words[:i]))
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop=[words[k]])
    core.add_request("stop", PROMPTS["c"], params)
    outs = []
    while not outs or not outs[-1].finished:
        outs += core.step()
        assert outs[-1].finished or core.block_manager.num_used_pages > 0
    out = merge_outputs(outs)
    assert out.finish_reason == "stop" and out.new_token_ids == alone["c"][:k + 1]
    tok = core.model.tokenizer
    text = tok.decode(PROMPTS["c"] + alone["c"])[len(tok.decode(PROMPTS["c"])):]
    assert out.new_text == text[:text.index(words[k])]
    assert "stop" not in core.scheduler.requests and core.block_manager.num_used_pages == 0


@pytest.mark.parametrize("where", ["row inputs", "runner inputs"])
def test_host_side_fault_fails_only_its_request(core, alone, monkeypatch, where):
    preemptions = core.scheduler.num_preemptions
    if where == "row inputs":
        build = EngineCore._row_input

        def faulty(self, row):
            req = row.request
            if req.request_id == "bad" and req.num_output_tokens >= FAIL_AT:
                raise RuntimeError("injected row fault")
            return build(self, row)
        monkeypatch.setattr(EngineCore, "_row_input", faulty)
    else:
        build = runner_mod.sampling.build_sampling_arrays

        def faulty(slots, *args, **kw):
            if any(s[3] == BAD_SEED and len(s[2]) >= FAIL_AT for s in slots):
                raise RuntimeError("injected row fault")
            return build(slots, *args, **kw)
        monkeypatch.setattr(runner_mod.sampling, "build_sampling_arrays", faulty)
    outs = together(core)
    assert_only_bad_failed(outs, alone, "injected row fault")
    assert len(outs["bad"].new_token_ids) == FAIL_AT
    assert core.scheduler.num_preemptions == preemptions      # nobody had to recompute


def fault_executables(core, monkeypatch, consume):
    """Every executable raises on a step holding the bad request's FAIL_AT-th sample; when
    `consume(n_rows)`, it first deletes the KV pool, as a call that took the donated pool would."""
    def wrap(exe):
        def call(params, kv, step, samp):
            rows = [r for r in range(len(samp.step)) if samp.seed[r][1] != 0]
            if any(samp.seed[r][1] == BAD_SEED and samp.step[r] >= FAIL_AT for r in rows):
                if consume(len(rows)):
                    for a in jax.tree.leaves(kv):
                        a.delete()
                raise RuntimeError("injected device fault")
            return exe(params, kv, step, samp)
        return call
    for bucket, exe in list(core.runner.executables.items()):
        monkeypatch.setitem(core.runner.executables, bucket, wrap(exe))


def test_device_fault_with_the_pool_intact_fails_only_its_request(core, alone, monkeypatch):
    fault_executables(core, monkeypatch, consume=lambda n: False)
    preemptions = core.scheduler.num_preemptions
    assert_only_bad_failed(together(core), alone, "injected device fault")
    assert core.scheduler.num_preemptions == preemptions


def test_lost_pool_is_replaced_and_the_others_recompute(core, alone, monkeypatch):
    # The batched call fails before it reaches the pool; the bad row, run alone, consumes it.
    fault_executables(core, monkeypatch, consume=lambda n: n == 1)
    old_pool = core.runner.kv
    preemptions = core.scheduler.num_preemptions
    assert_only_bad_failed(together(core), alone, "injected device fault")
    assert core.runner.kv is not old_pool
    assert core.scheduler.num_preemptions == preemptions + 2   # a and c went back to the queue


def test_lost_pool_in_a_batched_step_fails_that_step_and_serving_goes_on(core, alone,
                                                                        monkeypatch):
    run_to_end(core, {"cached": (PROMPTS["c"], GREEDY)})   # c's first page in the prefix cache
    assert core.block_manager.num_cached_pages > 0
    fault_executables(core, monkeypatch, consume=lambda n: True)
    outs = together(core)
    assert {o.finish_reason for o in outs.values()} == {"error"}   # all three were in that step
    assert core.block_manager.num_cached_pages == 0
    monkeypatch.undo()
    again = run_to_end(core, {rid: (p, GREEDY) for rid, p in PROMPTS.items()})
    assert {rid: o.new_token_ids for rid, o in again.items()} == alone
