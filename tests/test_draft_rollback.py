"""Draft tokens through the scheduler with the mock model: several sample slots per row, accepted
drafts, rollback of the rejected ones (pages back to the pool, nothing rolled back in the prefix
cache), and outputs equal to what the mock generates alone."""
import pytest

from maxjax.engine.block_manager import BlockManager
from maxjax.engine.config import EngineConfig
from maxjax.engine.request import Request
from maxjax.engine.accept import accept_drafts
from maxjax.engine.scheduler import Scheduler
from maxjax.engine.types import SamplingParams
from mock_model import MockModel, reference_generate
from pool_check import check_pool

VOCAB, PAGE = 1000, 4


def rig(max_draft=3, pages=64, budget=16):
    cfg = EngineConfig(max_batch_size=4, max_batch_input_tokens=budget, kv_cache_page_size=PAGE)
    bm = BlockManager(pages, PAGE, True)
    return bm, Scheduler(cfg, bm, 256, (), max_draft_tokens=max_draft), MockModel(PAGE, VOCAB)


def test_accept_drafts():
    assert accept_drafts([], [5]) == [5]
    assert accept_drafts([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]       # all accepted + bonus
    assert accept_drafts([5, 6, 7], [5, 9, 7, 8]) == [5, 9]             # second rejected
    assert accept_drafts([5, 6], [4, 6, 1]) == [4]                      # none accepted


def cached_chunks(bm):
    return {e.tokens for e in bm._entry if e is not None}


@pytest.mark.parametrize("wrong_at", [None, 0, 1, 2])
def test_drafts_keep_outputs_and_roll_back_rejected_tokens(wrong_at):
    bm, s, model = rig()
    prompt = list(range(30, 41))
    n = 24
    ref = reference_generate(prompt, n, VOCAB)
    req = Request("a", prompt, SamplingParams(max_new_tokens=n))
    s.add(req)
    steps = 0
    while s.has_unfinished():
        if not req.is_prefilling:
            done = req.num_output_tokens
            drafts = list(ref[done:done + 3])
            if wrong_at is not None and wrong_at < len(drafts):
                drafts[wrong_at] = (drafts[wrong_at] + 1) % VOCAB
            req.draft_token_ids = drafts
        plan = s.schedule()
        [row] = plan.rows
        assert row.num_samples == (1 + len(row.draft_token_ids) if row.sample else 0)
        before = bm.num_free_pages
        s.update(plan, model.run(plan.rows))
        steps += 1
        if s.has_unfinished():
            # a rollback gives back every page past the final tokens
            assert len(req.pages) == bm.pages_for(req.num_computed_tokens)
            assert bm.num_free_pages >= before - len(req.pages)
            check_pool(bm, [req])
        final = req.all_token_ids
        finals = {tuple(final[i:i + PAGE]) for i in range(0, len(final) - PAGE + 1, PAGE)}
        assert cached_chunks(bm) <= finals       # only final tokens ever enter the prefix cache
    assert req.output_token_ids == ref and req.finish_reason == "length"
    if wrong_at is None:
        assert steps < n // 2                    # several tokens per step
    check_pool(bm, [])
    assert bm.num_used_pages == 0


def test_drafts_fit_the_budget_and_the_remaining_length():
    bm, s, model = rig(max_draft=5, budget=4)
    req = Request("a", [1, 2, 3], SamplingParams(max_new_tokens=4))
    s.add(req)
    plan = s.schedule()
    s.update(plan, model.run(plan.rows))           # prefill: one token
    req.draft_token_ids = [9, 9, 9, 9, 9]
    plan = s.schedule()
    assert len(plan.rows[0].draft_token_ids) == 2  # max_new_tokens 4: 1 emitted, 1 + 2 to go
    s.update(plan, model.run(plan.rows))
    assert req.draft_token_ids == []


def test_drafts_that_need_a_missing_page_are_dropped_not_preempting():
    bm, s, model = rig(max_draft=3, pages=4)        # 3 usable pages of 4 tokens
    a = Request("a", list(range(7)), SamplingParams(max_new_tokens=4))
    b = Request("b", list(range(50, 53)), SamplingParams(max_new_tokens=2))
    s.add(a)
    s.add(b)
    plan = s.schedule()
    s.update(plan, model.run(plan.rows))
    assert bm.num_free_pages == 0
    a.draft_token_ids = [1, 2, 3]                   # would need a third page for a
    plan = s.schedule()
    assert [(r.request.request_id, r.draft_token_ids) for r in plan.rows] == [("a", []), ("b", [])]
    assert not plan.preempted
