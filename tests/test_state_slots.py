"""A hybrid model's request-state slots (maxjax/engine/state_slots.py) and the scheduler that
hands them out: one slot per running request, from its first scheduled step to its finish,
abort or preemption, never two running requests on one slot. The scheduler runs with a mock
whose per-slot "state" is a hash of the request's tokens so far, carried from step to step in
its slot as the graphs carry theirs (graphs/recurrent.py): a slot handed to two requests, or
read at the wrong time, changes the outputs or raises."""
import random

import pytest

from maxjax.engine.block_manager import BlockManager
from maxjax.engine.config import EngineConfig
from maxjax.engine.request import Request, RequestStatus
from maxjax.engine.scheduler import Scheduler
from maxjax.engine.state_slots import StateSlots
from maxjax.engine.types import SamplingParams
from mock_model import MockModel, drive, kv_value, reference_generate
from pool_check import check_pool

VOCAB = 1000


def test_slots_are_handed_out_once_and_taken_back():
    slots = StateSlots(3)
    a, b, c = (Request(x, [1]) for x in "abc")
    assert {slots.acquire(a), slots.acquire(b)} == {1, 2} and slots.num_free == 0
    assert slots.holder(a.state_slot) == "a"
    with pytest.raises(AssertionError, match="no request-state slot free"):
        slots.acquire(c)
    with pytest.raises(AssertionError, match="already holds"):
        slots.acquire(a)
    held = a.state_slot
    slots.release(a)
    assert a.state_slot == 0 and slots.holder(held) is None
    slots.release(a)                        # holding none: nothing to give back
    assert slots.acquire(c) == held and slots.num_free == 0
    with pytest.raises(ValueError):
        StateSlots(1)


class StateMock(MockModel):
    """MockModel plus a state per slot: a row starting at position 0 starts from zero, else
    from its slot, which must hold the K/V chain's value at the position before the row."""
    def __init__(self, page_size):
        super().__init__(page_size, VOCAB)
        self.state: dict[int, int] = {}

    def run(self, rows):
        for row in rows:
            req = row.request
            slot = req.state_slot
            assert slot != 0, f"{req.request_id} runs without a state slot"
            state = 0 if row.start_pos == 0 else self.state[slot]
            for k, tok in enumerate(row.token_ids[:len(row.token_ids) - len(row.draft_token_ids)]):
                state = kv_value(state, tok, row.start_pos + k)
            self.state[slot] = state
        out = super().run(rows)
        for row in rows:       # the state equals the page chain: the slot carried this request
            n = row.start_pos + len(row.token_ids) - 1
            assert self.state[row.request.state_slot] == self._read(row.pages, n), row
        return out


def _rig(pages, rows=4, budget=16, page_size=4):
    cfg = EngineConfig(max_batch_size=rows, max_batch_input_tokens=budget,
                       enable_prefix_caching=False, kv_cache_page_size=page_size)
    bm = BlockManager(pages, page_size, False)
    slots = StateSlots(rows + 1)
    return Scheduler(cfg, bm, 256, (), state_slots=slots), bm, slots, StateMock(page_size)


def _check(s, bm, slots):
    def on_step(plan):
        check_pool(bm, s.running)
        held = [r.state_slot for r in s.running]
        assert 0 not in held and len(set(held)) == len(held), held
        assert all(slots.holder(r.state_slot) == r.request_id for r in s.running)
        assert all(r.state_slot == 0 for r in s.waiting)
        assert slots.num_free == slots.num_slots - 1 - len(s.running)
    return on_step


def test_slots_follow_requests_through_chunks_preemption_and_finish():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(10)]
    s, bm, slots, model = _rig(pages=14)         # 13 pages of 4 tokens: preemptions
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=12)) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add(r)
    drive(s, model, on_step=_check(s, bm, slots))
    assert s.num_preemptions > 0
    assert slots.num_free == slots.num_slots - 1
    for r in reqs:
        assert r.state_slot == 0
        assert r.output_token_ids == reference_generate(r.prompt_token_ids, 12, VOCAB)


def test_abort_and_finish_give_the_slot_back():
    s, bm, slots, model = _rig(pages=64, budget=32)
    a, b, c = (Request(x, list(range(5, 15)), SamplingParams(max_new_tokens=8)) for x in "abc")
    for r in (a, b, c):
        s.add(r)
    plan = s.schedule()
    s.update(plan, model.run(plan.rows))
    assert {a.state_slot, b.state_slot, c.state_slot} == {1, 2, 3}
    held = b.state_slot
    s.abort("b")
    assert b.state_slot == 0 and slots.holder(held) is None
    d = Request("d", [7, 8, 9], SamplingParams(max_new_tokens=3))
    s.add(d)
    drive(s, model, on_step=_check(s, bm, slots))
    assert d.status is RequestStatus.FINISHED and d.output_token_ids == reference_generate(
        [7, 8, 9], 3, VOCAB)
    assert slots.num_free == 4


def test_more_requests_than_rows_never_run_out_of_slots():
    s, bm, slots, model = _rig(pages=200, rows=3, budget=32)
    reqs = [Request(str(i), [i + 3] * (i % 7 + 2), SamplingParams(max_new_tokens=i % 5 + 1))
            for i in range(20)]
    for r in reqs:
        s.add(r)
    drive(s, model, on_step=_check(s, bm, slots))
    for r in reqs:
        want = reference_generate(r.prompt_token_ids, r.sampling.max_new_tokens, VOCAB)
        assert r.output_token_ids == want
