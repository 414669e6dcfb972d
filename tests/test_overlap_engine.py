"""The overlap scheduler through the real engine on a tiny random Llama: greedy and seeded outputs
equal the synchronous engine's (one engine each, built as every entry point builds one),
including requests ended by stop tokens and max_tokens while their next token was in flight, a
pool short enough to preempt, and penalties (whose rows wait for the token they follow); no page
leaks and nothing compiles after warm-up (the token feed's graphs are compiled before). The
planner's choice: off unless asked where it did not measure faster, refused in one line with
speculative decoding."""
from __future__ import annotations

import pytest

from maxjax.engine.config import EngineConfig
from maxjax.engine.overlap_plan import plan_overlap
from maxjax.engine.plan import EngineLayout
from maxjax.engine.types import SamplingParams
from maxjax.errors import UserError
from engine_runs import run_to_end
from pool_check import check_pool
from tiny_llama import tiny_core


@pytest.fixture(scope="module")
def cores(tmp_path_factory):
    """{overlap on: EngineCore}, on a pool small enough that the workload preempts."""
    d = tmp_path_factory.mktemp("tiny")
    return {on: tiny_core(d / str(on), enable_overlap_scheduler=on, num_kv_pages=12)
            for on in (False, True)}


def run(core, requests: dict) -> dict:
    """run_to_end, then nothing left held and nothing compiled."""
    got = run_to_end(core, requests)
    check_pool(core.block_manager)
    assert core.block_manager.num_used_pages == 0
    assert core.stats().xla_compiles_since_ready == 0
    return got


def test_the_plan_keeps_the_flag(cores):
    assert {on: c.cfg.enable_overlap_scheduler for on, c in cores.items()} == \
        {False: False, True: True}
    assert cores[True].overlap is not None and cores[False].overlap is None


def workload(stop_token_ids=(), **extra):
    return {f"r{i}": ([5 + i, 7, 9 + i] * (i + 1),
                      SamplingParams(max_new_tokens=30 - 2 * i,
                                     temperature=0.0 if i % 2 else 0.8, seed=i,
                                     stop_token_ids=list(stop_token_ids), **extra))
            for i in range(8)}


def test_greedy_and_seeded_outputs_equal_the_synchronous_engine(cores):
    reqs = workload()
    base = run(cores[False], reqs)
    # stop tokens taken from the outputs themselves, so some requests end early
    stops = {base[r].new_token_ids[3] for r in ("r1", "r4", "r6")}
    reqs = workload(stops)
    sync, over = run(cores[False], reqs), run(cores[True], reqs)
    assert any(o.finish_reason == "stop" for o in sync.values())
    assert any(o.finish_reason == "length" for o in sync.values())
    assert cores[False].scheduler.num_preemptions > 0
    for rid in reqs:
        a, b = sync[rid], over[rid]
        assert (b.new_token_ids, b.finish_reason, b.completion_tokens, b.new_text) == \
            (a.new_token_ids, a.finish_reason, a.completion_tokens, a.new_text), rid


def test_penalties_and_logprobs_equal_the_synchronous_engine(cores):
    reqs = workload(repetition_penalty=1.3, frequency_penalty=0.4, logprobs=True,
                    top_logprobs=2)
    sync, over = run(cores[False], reqs), run(cores[True], reqs)
    for rid in reqs:
        assert over[rid].new_token_ids == sync[rid].new_token_ids, rid
        assert [lp.token_id for lp in over[rid].new_logprobs] == over[rid].new_token_ids
        assert [lp.logprob for lp in over[rid].new_logprobs] == \
            pytest.approx([lp.logprob for lp in sync[rid].new_logprobs], abs=1e-5)


def _layout(**kw):
    return EngineLayout(64, 8, 24, 8, **kw)


def test_the_planner_decides():
    flags = EngineConfig()
    assert plan_overlap(flags, _layout(platform="cpu"), 0) is False   # not measured faster
    assert plan_overlap(flags.replace(enable_overlap_scheduler=True), _layout(), 0) is True
    assert plan_overlap(flags.replace(enable_overlap_scheduler=False), _layout(), 0) is False
    assert plan_overlap(flags, _layout(), 3) is False
    with pytest.raises(UserError, match="--enable-overlap-scheduler: speculative decoding"):
        plan_overlap(flags.replace(enable_overlap_scheduler=True), _layout(), 3)
    with pytest.raises(UserError, match="hybrid model"):
        plan_overlap(flags.replace(enable_overlap_scheduler=True), _layout(state_slots=5), 0)
