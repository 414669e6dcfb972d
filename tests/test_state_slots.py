"""A hybrid model's request-state slots (maxjax/engine/state_slots.py) and the scheduler that
hands them out: one slot per running request, from its first scheduled step to its finish,
abort or preemption, never two running requests on one slot. The scheduler runs with a mock
whose per-slot "state" is a hash of the request's tokens so far, carried from step to step in
its slot as the graphs carry theirs (graphs/recurrent.py): a slot handed to two requests, or
read at the wrong time, changes the outputs or raises. The prefix cache's state snapshots
(Snapshots) likewise: the mock restores a row's `state_from` into its slot and saves its final
state to `state_save` as graphs/snapshots.py does, so a hit resumed from a wrong or stale
snapshot breaks the state's equality with the page chain."""
import random

import pytest

from maxjax.engine.block_manager import BlockManager
from maxjax.engine.config import EngineConfig
from maxjax.engine.request import Request, RequestStatus
from maxjax.engine.scheduler import Scheduler
from maxjax.engine.state_slots import Snapshots, StateSlots, cut_at_page
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
            if row.state_from:
                self.state[slot] = self.state[row.state_from]
            state = 0 if row.start_pos == 0 else self.state[slot]
            for k, tok in enumerate(row.token_ids[:len(row.token_ids) - len(row.draft_token_ids)]):
                state = kv_value(state, tok, row.start_pos + k)
            self.state[slot] = state
            if row.state_save:
                self.state[row.state_save] = state
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


# ---- the prefix cache's state snapshots ------------------------------------------------------

def test_snapshots_bind_to_cached_pages_and_go_with_them():
    bm = BlockManager(6, 4)
    snaps = Snapshots(3, 2, bm)            # slots 3 and 4, after 2 requests' slots + scratch
    a = Request("a", list(range(10, 23)))  # 13 tokens: 3 full pages
    assert bm.allocate(a, 8)
    assert snaps.claim(a, 6) == 0          # not a page boundary
    assert snaps.claim(a, 8) == 3 and snaps.num_pending == 1 and snaps.num_free == 1
    a.num_computed_tokens = 8
    bm.cache_full_pages(a)
    snaps.bind(a)
    assert snaps.num_pending == 0 and snaps.slot_of(a.pages[1]) == 3 and snaps.num_bound == 1
    assert snaps.slot_of(a.pages[0]) == 0  # its first page ended inside the chunk: no state
    b = Request("b", list(range(10, 23)))
    prefix, slot = snaps.restore_point(bm.match_prefix(b))
    assert prefix.pages == a.pages[:2] and slot == 3
    c = Request("c", [9] + list(range(11, 23)))          # diverges in the first page
    assert snaps.restore_point(bm.match_prefix(c)) == (([], []), 0)
    # pending: freed when its request ends before its step is taken in
    assert bm.allocate(a, 4) and snaps.claim(a, 12) == 4
    snaps.release(a)
    assert snaps.num_pending == 0 and snaps.num_free == 1
    # a page evicted from the cache frees its snapshot
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    assert snaps.num_bound == 0 and snaps.num_free == 2 and snaps.slot_of(prefix.pages[1]) == 0


def test_out_of_snapshot_slots_the_least_recently_used_goes():
    bm = BlockManager(20, 2)
    snaps = Snapshots(2, 2, bm)
    reqs = [Request(str(i), [i + 3] * 5) for i in range(3)]
    for r in reqs:
        assert bm.allocate(r, 4)
        slot = snaps.claim(r, 4)
        r.num_computed_tokens = 4
        bm.cache_full_pages(r)
        snaps.bind(r)
        assert slot and snaps.slot_of(r.pages[1]) == slot
    assert snaps.evictions == 1 and snaps.num_bound == 2
    assert snaps.slot_of(reqs[0].pages[1]) == 0          # the oldest: its page stays cached
    assert bm.is_cached(reqs[0].pages[1])
    assert snaps.restore_point(bm.match_prefix(Request("x", [3] * 5))) == (([], []), 0)
    with pytest.raises(ValueError):
        Snapshots(0, 2, bm)


@pytest.mark.parametrize("start,chunk,n,want", [
    (0, 16, 14, 12),     # the prompt's last full page boundary ends a chunk; the tail its own
    (12, 2, 14, 2),      # the tail
    (0, 10, 30, 8),      # a chunk that does not end the prompt ends on a page boundary
    (1, 2, 30, 2),       # no boundary inside: as it is
    (0, 16, 16, 12),     # 16 tokens: the last token is computed, so 12 is the last hit's end
    (0, 9, 13, 8),       # the last boundary (12) past its end: the one inside it
])
def test_chunks_end_on_page_boundaries(start, chunk, n, want):
    assert cut_at_page(start, chunk, n, 4) == want


def _snap_rig(pages, rows=4, budget=16, page_size=4, snapshots=4):
    cfg = EngineConfig(max_batch_size=rows, max_batch_input_tokens=budget,
                       kv_cache_page_size=page_size)
    bm = BlockManager(pages, page_size, True)
    slots = StateSlots(rows + 1)
    snaps = Snapshots(rows + 1, snapshots, bm)
    s = Scheduler(cfg, bm, 256, (), state_slots=slots, snapshots=snaps)
    return s, bm, slots, snaps, StateMock(page_size)


def _check_snapshots(s, bm, slots, snaps, rows_seen=None):
    base = _check(s, bm, slots)

    def on_step(plan):
        base(plan)
        held = {r.state_slot for r in s.running}
        for row in plan.rows:
            assert row.state_save not in held and row.state_from not in held
            if row.state_save:
                assert (row.start_pos + len(row.token_ids)) % bm.page_size == 0
            if rows_seen is not None:
                rows_seen.append((row.request.request_id, row.start_pos, len(row.token_ids),
                                  row.state_from, row.state_save))
        for page, slot in snaps._page_slot.items():      # every snapshot's page is cached
            assert bm.is_cached(page) and snaps.first <= slot < snaps.first + snaps.count
        assert snaps.num_free + snaps.num_bound + snaps.num_pending == snaps.count
    return on_step


def test_a_shared_prefix_resumes_from_its_snapshot():
    s, bm, slots, snaps, model = _snap_rig(pages=64)
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(12)]             # 3 pages of 4
    a = Request("a", shared + [5, 6], SamplingParams(max_new_tokens=6))
    s.add(a)
    seen = []
    drive(s, model, on_step=_check_snapshots(s, bm, slots, snaps, seen))
    assert ("a", 0, 12, 0, snaps.first) in seen       # cut at the last full page's end, saved
    b = Request("b", shared + [7, 8, 9], SamplingParams(max_new_tokens=6))
    c = Request("c", [shared[0] + 1] + shared[1:] + [5, 6], SamplingParams(max_new_tokens=6))
    s.add(b)
    drive(s, model, on_step=_check_snapshots(s, bm, slots, snaps, seen))
    s.add(c)
    drive(s, model, on_step=_check_snapshots(s, bm, slots, snaps, seen))
    assert b.num_cached_tokens == 12 and c.num_cached_tokens == 0
    assert [x for x in seen if x[0] == "b"][0][1:4] == (12, 3, snaps.first)
    assert all(x[3] == 0 for x in seen if x[0] == "c")
    for r in (a, b, c):
        assert r.output_token_ids == reference_generate(r.prompt_token_ids, 6, VOCAB)
    assert slots.num_free == 4 and snaps.num_pending == 0


def test_snapshots_are_freed_with_their_pages_and_none_leak_through_preemption():
    """Prompts sharing prefixes in a pool too small for them all: cached pages are evicted
    (their snapshots with them), the 2 snapshot slots are reused LRU, requests are preempted
    and recomputed; every output equals the mock's reference, and at the end no slot is held
    but by a cached page."""
    rng = random.Random(5)
    stems = [[rng.randrange(3, VOCAB) for _ in range(rng.choice((8, 12, 16)))] for _ in range(3)]
    prompts = [rng.choice(stems) + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 9))]
               for _ in range(14)]
    s, bm, slots, snaps, model = _snap_rig(pages=16, snapshots=2)
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=10)) for i, p in enumerate(prompts)]
    check = _check_snapshots(s, bm, slots, snaps)
    for r in reqs[:7]:
        s.add(r)
    drive(s, model, on_step=check)
    for r in reqs[7:]:
        s.add(r)
    drive(s, model, on_step=check)
    assert s.num_preemptions > 0 and bm.evictions > 0 and snaps.evictions > 0
    assert sum(r.num_cached_tokens for r in reqs) > 0
    for r in reqs:
        assert r.output_token_ids == reference_generate(r.prompt_token_ids, 10, VOCAB), r
    assert slots.num_free == 4 and snaps.num_pending == 0
    assert snaps.num_free + snaps.num_bound == 2
    bm.reset_prefix_cache()
    assert snaps.num_free == 2 and snaps.num_bound == 0
