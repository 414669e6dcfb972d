"""Scheduler with the mock model: budgets, chunking, ordering, preemption, abort, prefix cache, stops.

Every run checks after each schedule that the pool's invariants hold and that no step writes into a
page shared with another request or registered in the prefix cache, and at the end that every page
is free again and every output equals what the mock generates for that request alone.
"""
import random

import pytest

from maxjax.engine import block_manager as bm_mod
from maxjax.engine.block_manager import BlockManager
from maxjax.engine.config import EngineConfig
from mock_model import MockModel, drive, reference_generate
from maxjax.engine.request import Request, RequestStatus
from maxjax.engine.scheduler import Scheduler
from maxjax.engine.types import SamplingParams
from pool_check import check_pool

VOCAB = 1000


class Rig:
    def __init__(self, *, pages=64, page_size=4, budget=16, rows=8, max_length=256, chunked=True,
                 min_chunk=0, prefix=True, algo="fast", eos=()):
        cfg = EngineConfig(max_batch_size=rows, max_batch_input_tokens=budget,
                           enable_chunked_prefill=chunked, chunked_prefill_min_chunk_size=min_chunk,
                           enable_prefix_caching=prefix, kv_cache_page_size=page_size)
        self.bm = BlockManager(pages, page_size, prefix, algo)
        self.s = Scheduler(cfg, self.bm, max_length, eos)
        self.model = MockModel(page_size, VOCAB)
        self.plans = []

    def add(self, rid, prompt, n=4, **kw):
        r = Request(rid, list(prompt), SamplingParams(max_new_tokens=n, **kw))
        self.s.add(r)
        return r

    def check_plan(self, plan):
        live = self.s.running
        check_pool(self.bm, live)
        assert plan.num_tokens == sum(len(r.token_ids) for r in plan.rows)
        assert plan.num_tokens <= self.s.cfg.max_batch_input_tokens
        assert len(plan.rows) <= self.s.cfg.max_batch_size
        assert len(self.s.running) <= self.s.cfg.max_batch_size
        assert len({r.request.request_id for r in plan.rows}) == len(plan.rows)
        ps = self.bm.page_size
        for row in plan.rows:
            assert len(row.pages) <= self.s.max_pages_per_row
            assert len(row.token_ids) > 0 and row.start_pos == row.request.num_computed_tokens
            for pos in range(row.start_pos, row.start_pos + len(row.token_ids)):
                page = row.pages[pos // ps]
                assert self.bm.ref_count(page) == 1 and not self.bm.is_cached(page), (row, pos)
        self.plans.append(plan)

    def step(self, sampled=None):
        plan = self.s.schedule()
        if plan is not None:
            self.check_plan(plan)
            self.s.update(plan, self.model.run(plan.rows) if sampled is None else sampled)
        return plan

    def run(self):
        steps = drive(self.s, self.model, on_step=self.check_plan)
        self.done()
        return steps

    def done(self):
        assert not self.s.has_unfinished()
        check_pool(self.bm, [])
        assert self.bm.num_free_pages == self.bm.num_usable_pages


def expect(r):
    return reference_generate(r.prompt_token_ids, len(r.output_token_ids), VOCAB)


def rows_of(plan):
    return [(r.request.request_id, r.start_pos, len(r.token_ids), r.sample) for r in plan.rows]


def test_prompt_of_exactly_the_budget_goes_in_one_step():
    g = Rig(budget=8)
    a = g.add("a", range(8), n=3)
    assert rows_of(g.step()) == [("a", 0, 8, True)]
    g.run()
    assert a.output_token_ids == expect(a) and len(a.output_token_ids) == 3
    assert a.finish_reason == "length"


def test_one_over_the_budget_is_chunked():
    g = Rig(budget=8)
    a = g.add("a", range(9), n=2)
    assert rows_of(g.step()) == [("a", 0, 8, False)]
    assert a.output_token_ids == []
    assert rows_of(g.step()) == [("a", 8, 1, True)]
    g.run()
    assert a.output_token_ids == expect(a)


@pytest.mark.parametrize("n, m, chunks", [
    (10, 3, [7, 3]),        # the remainder is kept >= m
    (9, 3, [6, 3]),
    (11, 3, [8, 3]),
    (20, 3, [8, 8, 4]),
    (10, 6, [8, 2]),        # 10 < 2m: no split keeps both >= m; a full-budget chunk it is
    (10, 0, [8, 2]),
])
def test_min_chunk_size(n, m, chunks):
    g = Rig(budget=8, min_chunk=m)
    a = g.add("a", range(n), n=2)
    got = []
    while a.num_computed_tokens < n:
        got.append(len(g.step().rows[0].token_ids))
    assert got == chunks
    g.run()
    assert a.output_token_ids == expect(a)


def test_min_chunk_waits_for_budget_left_by_decodes():
    g = Rig(budget=8, min_chunk=4)
    d = [g.add(f"d{i}", [i + 1], n=3) for i in range(5)]
    g.step()                                     # 5 one-token prompts
    a = g.add("a", range(12), n=2)
    plan = g.step()                              # 5 decodes leave 3 < 4: a waits
    assert [r.request.request_id for r in plan.rows] == [f"d{i}" for i in range(5)]
    assert a.status is RequestStatus.WAITING
    g.run()
    assert all(r.output_token_ids == expect(r) for r in d + [a])


def test_row_budget():
    g = Rig(rows=2)
    rs = [g.add(c, [ord(c)], n=2) for c in "abc"]
    assert [r[0] for r in rows_of(g.step())] == ["a", "b"]
    assert [r[0] for r in rows_of(g.step())] == ["a", "b"]   # decodes first, c still waits
    g.run()
    assert all(r.output_token_ids == expect(r) for r in rs)


def test_decodes_first_then_partial_prefills_then_admissions():
    g = Rig(budget=10)
    a = g.add("a", range(3), n=5)
    g.step()                                     # a prefilled
    b = g.add("b", range(100, 120), n=2)
    assert rows_of(g.step()) == [("a", 3, 1, True), ("b", 0, 9, False)]
    c = g.add("c", range(200, 203), n=2)
    # b's next chunk comes before c's admission, after a's decode.
    assert rows_of(g.step()) == [("a", 4, 1, True), ("b", 9, 9, False)]
    assert rows_of(g.step()) == [("a", 5, 1, True), ("b", 18, 2, True), ("c", 0, 3, True)]
    g.run()
    assert all(r.output_token_ids == expect(r) for r in (a, b, c))


def test_mixed_step_exactly_fills_the_budget():
    g = Rig(budget=8)
    a, b = g.add("a", [1], n=4), g.add("b", [2], n=4)
    g.step()
    c = g.add("c", range(6), n=2)
    plan = g.step()
    assert rows_of(plan) == [("a", 1, 1, True), ("b", 1, 1, True), ("c", 0, 6, True)]
    assert plan.num_tokens == 8
    g.run()
    assert all(r.output_token_ids == expect(r) for r in (a, b, c))


def test_chunking_off_prompt_goes_in_whole_or_waits():
    g = Rig(budget=8, chunked=False)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        g.add("big", range(9))
    a = g.add("a", [1], n=3)
    g.step()
    b = g.add("b", range(8), n=2)                # 8 tokens, but a's decode leaves 7
    assert rows_of(g.step()) == [("a", 1, 1, True)]
    assert rows_of(g.step()) == [("a", 2, 1, True)]
    assert rows_of(g.step()) == [("b", 0, 8, True)]  # a finished: b fits whole
    g.run()
    assert all(r.output_token_ids == expect(r) for r in (a, b))


def test_fcfs_a_big_request_is_not_overtaken():
    g = Rig(pages=7, page_size=4, budget=32, prefix=False)    # 6 usable pages
    a = g.add("a", range(14), n=6)               # 4 pages after its prefill, 5 at the end
    g.step()
    big = g.add("big", range(100, 112), n=2)     # needs 3 pages, 2 are free
    small = g.add("small", [5], n=2)             # would fit, but comes after big
    while a.status is not RequestStatus.FINISHED:
        g.step()
        assert big.status is small.status is RequestStatus.WAITING or a.is_finished
    plan = g.step()
    assert [r[0] for r in rows_of(plan)] == ["big", "small"]
    g.run()
    assert all(r.output_token_ids == expect(r) for r in (a, big, small))


def test_running_requests_are_capped_at_max_batch_size():
    g = Rig(budget=16, rows=2, min_chunk=4)
    a = g.add("a", range(30), n=3)
    b = g.add("b", [1], n=3)
    c = g.add("c", [2], n=3)
    while not a.is_finished:
        g.step()
        assert g.s.num_running <= 2
    g.run()
    assert all(r.output_token_ids == expect(r) for r in (a, b, c))


def test_add_rejects_what_can_never_run():
    """The pool's limits; those of the request itself (empty, longer than max_length) are the
    validator's (tests/test_sampling_params.py)."""
    g = Rig(pages=5, page_size=4, max_length=32)  # 4 usable pages = 16 tokens of KV
    with pytest.raises(ValueError, match="KV pages") as e:
        g.add("b", range(10), n=8)               # 17 tokens of KV
    assert e.value.param == "max_new_tokens"
    with pytest.raises(ValueError, match="KV pages") as e:
        g.add("c", range(20), n=1)
    assert e.value.param == "prompt"
    ok = g.add("d", range(10), n=7)              # 16 tokens of KV: exactly the pool
    with pytest.raises(ValueError, match="already in use"):
        g.add("d", [1])
    g.run()
    assert ok.output_token_ids == expect(ok) and len(ok.output_token_ids) == 7


def test_max_length_clamps_output():
    g = Rig(max_length=12)
    a = g.add("a", range(8), n=100)
    g.run()
    assert a.num_tokens == 12 and a.finish_reason == "length"
    assert a.output_token_ids == expect(a)


def test_preemption_by_recompute_gives_the_same_outputs():
    prompts = [[i * 10 + j for j in range(5 + i)] for i in range(6)]
    free = Rig(pages=200)
    roomy = [free.add(str(i), p, n=20) for i, p in enumerate(prompts)]
    free.run()
    assert free.s.num_preemptions == 0
    tight = Rig(pages=16)                        # 15 pages of 4 for six requests of ~30 tokens
    rs = [tight.add(str(i), p, n=20) for i, p in enumerate(prompts)]
    tight.run()
    assert tight.s.num_preemptions > 0 and any(r.num_preemptions for r in rs)
    for r, r0 in zip(rs, roomy):
        assert r.output_token_ids == r0.output_token_ids == expect(r)
        assert len(r.output_token_ids) == 20


def test_newest_is_preempted_to_the_queue_front_and_recomputed_from_prompt_and_outputs():
    g = Rig(pages=7, page_size=4, budget=24, prefix=False)     # 6 usable pages
    a, b, c = (g.add(x, range(i * 10, i * 10 + 6), n=8) for i, x in enumerate("abc"))
    g.step()                                     # all prefilled: 2 pages each, pool full
    d = g.add("d", [1, 2], n=2)
    while c.status is not RequestStatus.PREEMPTED:
        plan = g.step()
        assert d.status is RequestStatus.WAITING
    assert plan.preempted == [c] and list(g.s.waiting) == [c, d]
    assert a.status is b.status is RequestStatus.RUNNING and len(a.pages) == 3
    assert c.pages == [] and c.num_computed_tokens == 0 and c.num_output_tokens > 0
    n_before = c.num_tokens
    while c.status is not RequestStatus.RUNNING:
        plan = g.step()
    assert ("c", 0, n_before, True) in rows_of(plan)      # prompt + outputs re-prefilled
    g.run()
    assert all(r.output_token_ids == expect(r) for r in (a, b, c, d))


def test_preempted_sequence_longer_than_a_step_is_chunked_even_with_chunking_off():
    g = Rig(pages=7, page_size=4, budget=8, chunked=False)
    a = g.add("a", range(3), n=14)
    b = g.add("b", range(20, 24), n=14)
    g.run()
    assert b.num_preemptions > 0
    assert any(r.request is b and r.start_pos > 0 and len(r.token_ids) > 1
               for p in g.plans for r in p.rows)
    assert a.output_token_ids == expect(a) and b.output_token_ids == expect(b)


def test_partial_prefills_competing_for_pages_do_not_deadlock():
    g = Rig(pages=9, page_size=4, budget=6, rows=4)   # 8 usable pages
    rs = [g.add(str(i), range(i * 100, i * 100 + 20), n=6) for i in range(3)]
    g.run()
    assert all(r.output_token_ids == expect(r) for r in rs)


def test_abort_while_waiting_mid_prefill_and_decoding():
    g = Rig(budget=8)
    dec = g.add("dec", [1, 2], n=50)
    g.step()
    mid = g.add("mid", range(40), n=5)
    g.step()
    assert mid.status is RequestStatus.RUNNING and 0 < mid.num_computed_tokens < 40
    wait = g.add("wait", range(3), n=5)
    keep = g.add("keep", range(7, 10), n=5)
    used = g.bm.num_used_pages
    assert g.s.abort("mid") is mid and mid.pages == []
    assert g.bm.num_used_pages < used
    assert g.s.abort("wait") is wait and wait.status is RequestStatus.FINISHED
    g.step()
    g.step()
    assert g.s.abort("dec").finish_reason == "abort"
    assert g.s.abort("dec") is None and g.s.abort("nope") is None
    g.run()
    assert keep.output_token_ids == expect(keep) and keep.finish_reason == "length"
    assert wait.output_token_ids == [] and g.s.num_running == 0


def test_abort_between_schedule_and_update_skips_the_row():
    g = Rig()
    a, b = g.add("a", range(5), n=3), g.add("b", range(9, 14), n=3)
    plan = g.s.schedule()
    g.s.abort("a")
    updated = g.s.update(plan, g.model.run(plan.rows))
    assert [u.request for u in updated] == [b] and a.output_token_ids == []
    g.run()
    assert b.output_token_ids == expect(b)


def test_finish_for_a_stop_string_frees_pages():
    g = Rig()
    a = g.add("a", range(5), n=30)
    g.step()
    g.step()
    assert g.s.finish("a", "stop") is a
    assert a.finish_reason == "stop" and a.num_output_tokens == 2
    g.done()


def test_pool_exhaustion_with_many_requests():
    rnd = random.Random(1)
    g = Rig(pages=24, page_size=4, budget=32, rows=16)
    rs = [g.add(str(i), [rnd.randrange(VOCAB) for _ in range(rnd.randint(1, 30))],
                n=rnd.randint(1, 25)) for i in range(60)]
    g.run()
    assert g.s.num_preemptions > 0
    for r in rs:
        assert r.output_token_ids == expect(r)
        assert len(r.output_token_ids) == r.sampling.max_new_tokens


def test_prefix_cache_hit_reuses_three_pages_with_the_same_outputs():
    shared = list(range(500, 512))               # 3 pages of 4
    g = Rig()
    a = g.add("a", shared + [1, 2], n=5)
    g.run()
    a_pages = [r.pages for p in g.plans for r in p.rows if r.request is a][0][:3]
    b = g.add("b", shared + [3, 4, 5], n=5)
    plan = g.step()
    assert rows_of(plan) == [("b", 12, 3, True)]
    assert plan.rows[0].pages[:3] == a_pages
    assert b.num_cached_tokens == 12 and g.bm.prefix_hit_pages == 3
    g.run()
    assert a.output_token_ids == expect(a) and b.output_token_ids == expect(b)


def test_prefix_shared_by_running_requests():
    shared = list(range(300, 316))
    g = Rig(budget=32)
    a = g.add("a", shared + [1], n=6)
    g.step()                                     # a's pages cached after its prefill
    rs = [g.add(f"b{i}", shared + [i, i], n=6) for i in range(4)]
    g.step()
    assert all(r.num_cached_tokens == 16 for r in rs)
    g.run()
    assert all(r.output_token_ids == expect(r) for r in [a] + rs)


def test_different_cache_salt_reuses_nothing():
    g = Rig()
    a = g.add("a", range(13), n=2)
    a.cache_salt = "alice"
    g.run()
    b = Request("b", list(range(13)), SamplingParams(max_new_tokens=2), cache_salt="bob")
    g.s.add(b)
    c = Request("c", list(range(13)), SamplingParams(max_new_tokens=2), cache_salt="alice")
    g.s.add(c)
    g.run()
    assert b.num_cached_tokens == 0 and c.num_cached_tokens == 12
    assert b.output_token_ids == c.output_token_ids == expect(b)


def test_forced_hash_collisions_keep_outputs_right(monkeypatch):
    monkeypatch.setattr(bm_mod, "_hash_fast", lambda prev, salt, tokens: 7)
    rnd = random.Random(3)
    g = Rig(pages=40)
    rs = [g.add(str(i), [rnd.randrange(4) for _ in range(rnd.randint(5, 20))], n=8)
          for i in range(20)]
    g.run()
    assert all(r.output_token_ids == expect(r) for r in rs)


@pytest.mark.parametrize("algo", ["fast", "sha256"])
def test_hash_algos_behave_the_same(algo):
    rnd = random.Random(5)
    base = [rnd.randrange(VOCAB) for _ in range(10)]
    g = Rig(pages=30, algo=algo)
    rs = [g.add(str(i), base[:rnd.randint(4, 10)] + [i], n=6) for i in range(12)]
    steps = g.run()
    assert all(r.output_token_ids == expect(r) for r in rs)
    summary = (steps, [r.num_cached_tokens for r in rs], g.bm.evictions, g.s.num_preemptions)
    assert summary == _hash_summary.setdefault("x", summary)


_hash_summary = {}


def test_batch_invariance():
    rnd = random.Random(7)
    prompts = [[rnd.randrange(VOCAB) for _ in range(rnd.randint(1, 40))] for _ in range(24)]
    together = Rig(pages=48, budget=24, rows=6)
    rs = [together.add(str(i), p, n=12) for i, p in enumerate(prompts)]
    together.run()
    for i, p in enumerate(prompts):
        alone = Rig(pages=48, budget=24, rows=6)
        r = alone.add("x", p, n=12)
        alone.run()
        assert rs[i].output_token_ids == r.output_token_ids == expect(r)


def test_stop_conditions():
    prompt = list(range(10, 16))
    ref = reference_generate(prompt, 8, VOCAB)
    eos = ref[2]
    k = ref.index(eos)                           # first time eos is generated
    g = Rig(eos=[eos])
    a = g.add("eos", prompt, n=8)
    b = g.add("ignore", prompt, n=8, ignore_eos=True)
    c = g.add("min", prompt, n=8, min_tokens=k + 2)
    d = g.add("stop_id", prompt, n=8, stop_token_ids=[ref[4]], ignore_eos=True)
    g.run()
    assert a.output_token_ids == ref[:k + 1] and a.finish_reason == "stop"
    assert b.output_token_ids == ref and b.finish_reason == "length"
    later = [j for j in range(k + 1, 8) if ref[j] == eos]   # min_tokens = k + 2 outputs
    assert c.output_token_ids == (ref[:later[0] + 1] if later else ref)
    assert d.output_token_ids == ref[:ref.index(ref[4]) + 1] and d.finish_reason == "stop"


def test_update_accepts_tokens_for_sampling_rows_only():
    g = Rig(budget=9)
    b = g.add("b", [1], n=2)
    a = g.add("a", range(12), n=2)
    plan = g.s.schedule()
    assert rows_of(plan) == [("b", 0, 1, True), ("a", 0, 8, False)]
    out = g.model.run(plan.rows)
    assert [u.request for u in g.s.update(plan, [out[0]])] == [b]
    assert b.output_token_ids == expect(b) and a.num_computed_tokens == 8
    with pytest.raises(ValueError, match="sampled tokens"):
        g.s.update(g.s.schedule(), [])
    g.s.abort("a")
    g.s.abort("b")
    g.done()


@pytest.mark.parametrize("seed", range(12))
def test_random_configs(seed):
    rnd = random.Random(seed)
    ps = rnd.choice([1, 2, 4, 8])
    budget = rnd.randint(4, 24)
    g = Rig(pages=rnd.randint(8, 40) * 4 // ps + 1, page_size=ps, budget=budget,
            rows=rnd.randint(1, 8), chunked=rnd.random() < 0.8,
            min_chunk=rnd.choice([0, 0, 1, 2, budget // 2]), prefix=rnd.random() < 0.7,
            max_length=64)
    prefix = [rnd.randrange(VOCAB) for _ in range(12)]
    rs = []
    for i in range(rnd.randint(5, 25)):
        plen = rnd.randint(1, budget if not g.s.cfg.enable_chunked_prefill else 40)
        p = (prefix[:rnd.randint(0, 12)] + [rnd.randrange(VOCAB) for _ in range(plen)])[:plen]
        try:
            rs.append(g.add(str(i), p, n=rnd.randint(1, 20)))
        except ValueError:
            continue
        if rnd.random() < 0.3:
            g.step()
        if rnd.random() < 0.1 and rs:
            g.s.abort(rnd.choice(rs).request_id)
    g.run()
    for r in rs:
        assert r.output_token_ids == expect(r)
        if r.finish_reason != "abort":
            assert r.finish_reason == "length"
            assert len(r.output_token_ids) == r.sampling.max_new_tokens or r.num_tokens == 64


def test_mock_model_notices_wrong_pages():
    from mock_model import MockModel
    from maxjax.graphs.step import RowSlice
    prompt = list(range(10))
    ref = reference_generate(prompt, 1, VOCAB)
    m = MockModel(4, VOCAB)
    assert m.run([RowSlice(prompt, 0, [1, 2, 3])]) == ref
    m.run([RowSlice([9, 9, 9, 9], 0, [4])])       # another sequence's first page
    assert m.run([RowSlice(prompt[8:], 8, [4, 2, 3])]) != ref   # reuses the wrong first page
    with pytest.raises(AssertionError, match="unwritten"):
        m.run([RowSlice([1], 8, [1, 6, 5])])


def test_plan_rows_pack_into_step_inputs():
    from maxjax.graphs.step import build_step_inputs
    g = Rig(budget=16)
    g.add("a", range(3), n=4)
    g.step()
    g.add("b", range(20, 30), n=2)
    plan = g.s.schedule()
    step = build_step_inputs(plan.rows, 16, 4, g.s.max_pages_per_row, 4)
    assert list(step.positions[:11]) == [3] + list(range(10))
    assert list(step.sample_idx[:2]) == [0, 10]
    g.s.update(plan, g.model.run(plan))
    g.run()
