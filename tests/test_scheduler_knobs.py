"""The `max serve` step-composition flags (maxjax/engine/step_policy.py and the Scheduler's token
caps) with the mock model: each test fails if its flag is ignored, every run's outputs equal what
the mock generates for each request alone, and bad values are one-line UserErrors."""
import pytest

from maxjax.engine.block_manager import BlockManager
from maxjax.engine.config import EngineConfig
from maxjax.engine.request import Request
from maxjax.engine.scheduler import Scheduler
from maxjax.engine.plan import check_flags
from maxjax.engine.types import SamplingParams
from maxjax.errors import RequestError, UserError
from mock_model import MockModel, reference_generate
from pool_check import check_pool

VOCAB = 1000


class Run:
    """A Scheduler and the mock model; `step()` records each plan as (index, rows) where a row is
    (request id, "d" for a decode or "p" for a prefill chunk, tokens)."""

    def __init__(self, *, pages=128, page_size=4, budget=16, rows=8, max_length=256, **knobs):
        cfg = self.config(page_size=page_size, budget=budget, rows=rows, **knobs)
        check_flags(cfg)            # as the engine's plan does before it builds a Scheduler
        self.bm = BlockManager(pages, page_size, True, "fast")
        self.s = Scheduler(cfg, self.bm, max_length)
        self.model = MockModel(page_size, VOCAB)
        self.plans, self.reqs, self.running_sizes = [], {}, []

    @staticmethod
    def config(*, page_size=4, budget=16, rows=8, **knobs) -> EngineConfig:
        return EngineConfig(max_batch_size=rows, max_batch_input_tokens=budget,
                            kv_cache_page_size=page_size, **knobs)

    def add(self, rid, n_prompt=8, n_out=4):
        r = Request(rid, [(hash(rid) + 7 * i) % VOCAB for i in range(n_prompt)],
                    SamplingParams(max_new_tokens=n_out))
        self.s.add(r)
        self.reqs[rid] = r
        return r

    def step(self):
        plan = self.s.schedule()
        assert plan is not None, "idle with unfinished requests"
        check_pool(self.bm, self.s.running)
        rows = [(r.request.request_id, "d" if r.request.num_output_tokens else "p",
                 len(r.token_ids)) for r in plan.rows]
        self.plans.append((len(self.plans), rows, plan))
        self.running_sizes.append(len(self.s.running))
        self.s.update(plan, self.model.run(plan.rows))
        return rows

    def drain(self, max_steps=1000):
        while self.s.has_unfinished():
            self.step()
            assert len(self.plans) < max_steps
        for r in self.reqs.values():
            if r.finish_reason != "abort":
                assert r.output_token_ids == reference_generate(
                    r.prompt_token_ids, len(r.output_token_ids), VOCAB)
        assert self.bm.num_free_pages == self.bm.num_usable_pages

    def kinds(self):
        """Per plan: the set of row kinds ("d", "p")."""
        return [{k for _, k, _ in rows} for _, rows, _ in self.plans]

    def first_step_of(self, rid):
        return next(i for i, rows, _ in self.plans if any(r == rid for r, _, _ in rows))


def aligned_total(plan, page_size):
    return sum(-(-(r.start_pos + len(r.token_ids)) // page_size) * page_size for r in plan.rows)


# ---- --max-batch-total-tokens -------------------------------------------------------------------
@pytest.mark.parametrize("cap", [None, 16])
def test_max_batch_total_tokens_caps_the_steps_aligned_context(cap):
    run = Run(budget=64, max_batch_total_tokens=cap)
    for i in range(4):
        run.add(f"r{i}", n_prompt=6, n_out=4)      # final context 9: 3 pages, 12 tokens
    run.drain()
    peak = max(aligned_total(p, 4) for _, _, p in run.plans)
    if cap is None:
        assert peak > 16          # the flag is what keeps the steps under it
    else:
        assert peak <= cap


def test_max_batch_total_tokens_refuses_a_prompt_that_alone_exceeds_it_and_stops_outputs():
    run = Run(max_batch_total_tokens=16)
    with pytest.raises(RequestError) as e:
        run.add("big", n_prompt=17)
    assert e.value.param == "prompt" and "--max-batch-total-tokens 16" in str(e.value)
    r = run.add("long", n_prompt=6, n_out=100)
    run.drain()
    # Its context may grow to 16 tokens: 6 prompt + 10 fed back + the last sampled one.
    assert r.finish_reason == "length" and r.num_tokens == 17


def test_max_batch_total_tokens_below_one_page_is_refused_at_start_up():
    with pytest.raises(UserError, match=r"^--max-batch-total-tokens 3: less than one KV page"):
        Run(page_size=4, max_batch_total_tokens=3)


# ---- --max-request-input-tokens -----------------------------------------------------------------
@pytest.mark.parametrize("cap", [0, 8])
def test_max_request_input_tokens_caps_one_requests_chunk(cap):
    run = Run(budget=32, max_request_input_tokens=cap)
    run.add("long", n_prompt=30)
    run.add("short", n_prompt=5)
    first = run.step()
    run.drain()
    chunks = [n for _, rows, _ in run.plans for _, k, n in rows if k == "p"]
    if cap:
        assert max(chunks) <= cap
        assert [r for r, _, _ in first] == ["long", "short"]   # the short one rides along
    else:
        assert first[0] == ("long", "p", 30)


@pytest.mark.parametrize("knobs, message", [
    (dict(max_request_input_tokens=-1), r"^--max-request-input-tokens -1: must be >= 0$"),
    (dict(max_request_input_tokens=8, enable_chunked_prefill=False),
     r"^--max-request-input-tokens 8: requires chunked prefill"),
    (dict(max_request_input_tokens=8, chunked_prefill_min_chunk_size=12),
     r"^--max-request-input-tokens 8: below --chunked-prefill-min-chunk-size 12"),
])
def test_max_request_input_tokens_refusals(knobs, message):
    with pytest.raises(UserError, match=message):
        Run(**knobs)


# ---- --enable-in-flight-batching / --enable-prioritize-first-decode --------------------------------
@pytest.mark.parametrize("ifb", [True, False])
def test_in_flight_batching_off_never_mixes_decode_and_prefill(ifb):
    run = Run(enable_in_flight_batching=ifb)
    run.add("a", n_prompt=5, n_out=8)
    run.step()
    run.add("b", n_prompt=5, n_out=8)
    run.add("c", n_prompt=20, n_out=3)
    run.drain()
    mixed = [k for k in run.kinds() if k == {"d", "p"}]
    assert bool(mixed) == ifb


@pytest.mark.parametrize("first_decode", [False, True])
def test_prioritize_first_decode_runs_their_decode_next(first_decode):
    run = Run(budget=8, enable_in_flight_batching=False,
              enable_prioritize_first_decode=first_decode)
    for rid in "abc":
        run.add(rid, n_prompt=8, n_out=3)
    run.drain()
    steps = [sorted(rows) for _, rows, _ in run.plans[:4]]
    if first_decode:   # CE a, TG a, CE b, TG a+b
        assert steps == [[("a", "p", 8)], [("a", "d", 1)], [("b", "p", 8)],
                         [("a", "d", 1), ("b", "d", 1)]]
    else:              # the prompts first, while the decode batch is under its floor
        assert steps[:3] == [[("a", "p", 8)], [("b", "p", 8)], [("c", "p", 8)]]


@pytest.mark.parametrize("first_decode", [False, True])
def test_with_in_flight_batching_the_next_step_already_carries_the_first_decode(first_decode):
    run = Run(budget=8, enable_prioritize_first_decode=first_decode)
    for rid in "ab":
        run.add(rid, n_prompt=8, n_out=3)
    assert run.step() == [("a", "p", 8)]
    assert run.step()[0] == ("a", "d", 1)
    run.drain()


# ---- --max-queue-size-tg / --min-batch-size-tg ---------------------------------------------------
@pytest.mark.parametrize("ifb", [True, False])
@pytest.mark.parametrize("tg", [None, 2])
def test_max_queue_size_tg_caps_the_requests_running(ifb, tg):
    run = Run(budget=64, enable_in_flight_batching=ifb, max_queue_size_tg=tg)
    for i in range(5):
        run.add(f"r{i}", n_prompt=4, n_out=5)
    run.drain()
    assert max(run.running_sizes) == (5 if tg is None else 2)


def test_min_batch_size_tg_keeps_decoding_above_the_floor_without_in_flight_batching():
    run = Run(budget=8, enable_in_flight_batching=False, min_batch_size_tg=1)
    for rid in "abc":
        run.add(rid, n_prompt=8, n_out=3)
    run.drain()
    # a decodes alone to its end before b is admitted (default floor: b and c come first)
    assert [sorted(rows) for _, rows, _ in run.plans[:4]] == [
        [("a", "p", 8)], [("a", "d", 1)], [("a", "d", 1)], [("b", "p", 8)]]


@pytest.mark.parametrize("floor", [None, 2])
def test_min_batch_size_tg_with_in_flight_batching_admits_only_below_the_floor(floor):
    run = Run(budget=64, min_batch_size_tg=floor)
    for rid in "ab":
        run.add(rid, n_prompt=4, n_out=6)
    run.step()
    run.add("c", n_prompt=4, n_out=6)
    run.drain()
    c_in = run.first_step_of("c")
    if floor is None:
        assert c_in == 1
    else:      # a and b decode (2 >= the floor) until they finish
        assert c_in == 6 and all(run.reqs[r].is_finished for r in "ab")


@pytest.mark.parametrize("knobs, message", [
    (dict(max_queue_size_tg=0), r"^--max-queue-size-tg 0: must be >= 1$"),
    (dict(max_queue_size_tg=9), r"^--max-queue-size-tg 9: more than --max-batch-size 8"),
    (dict(min_batch_size_tg=-1), r"^--min-batch-size-tg -1: must be >= 0$"),
])
def test_tg_queue_refusals(knobs, message):
    with pytest.raises(UserError, match=message):
        Run(**knobs)


# ---- --prefill-coalesce-min-pending / --prefill-coalesce-max-held-steps --------------------------
def test_coalescing_holds_fresh_prompts_until_enough_are_queued():
    run = Run(budget=64, prefill_coalesce_min_pending=3, prefill_coalesce_max_held_steps=50)
    run.add("a", n_prompt=4, n_out=20)
    assert run.step() == [("a", "p", 4)]         # no decode work: admitted at once
    run.add("b")
    run.step(), run.step()
    run.add("c")
    assert [r for r, _, _ in run.step()] == ["a"]
    run.add("d")
    assert [r for r, _, _ in run.step()] == ["a", "b", "c", "d"]   # three released together
    run.drain()


@pytest.mark.parametrize("max_held, released_after", [(0, 3), (2, 2)])
def test_coalescing_releases_a_held_prompt_after_its_deadline(max_held, released_after):
    run = Run(prefill_coalesce_min_pending=3, prefill_coalesce_max_held_steps=max_held)
    run.add("a", n_prompt=4, n_out=20)
    run.step()
    run.add("b")
    held = 0
    while "b" not in [r for r, _, _ in run.step()]:
        held += 1
    assert held == released_after
    run.drain()


def test_coalescing_off_admits_at_once():
    run = Run()
    run.add("a", n_prompt=4, n_out=20)
    run.step()
    run.add("b")
    assert "b" in [r for r, _, _ in run.step()]
    run.drain()


# ---- --prefill-schedule-interval -----------------------------------------------------------------
@pytest.mark.parametrize("interval", [1, 3])
def test_prefill_schedule_interval_confines_prefill_to_every_nth_step(interval):
    run = Run(budget=8, prefill_schedule_interval=interval)
    run.add("a", n_prompt=4, n_out=30)
    run.step()
    run.add("b", n_prompt=30, n_out=2)          # chunked over several steps
    run.drain()
    prefill_steps = [i for i, rows, _ in run.plans if any(k == "p" for _, k, _ in rows)]
    decoding_steps = [i for i, rows, _ in run.plans if any(k == "d" for _, k, _ in rows)]
    with_decodes = [i for i in prefill_steps if i in decoding_steps]
    if interval == 1:
        assert any(i % 3 for i in with_decodes)
    else:
        assert with_decodes and all(i % 3 == 0 for i in with_decodes)


def test_prefill_schedule_interval_without_decode_work_prefills_at_once():
    run = Run(prefill_schedule_interval=3)
    run.add("a", n_prompt=4, n_out=1)
    run.step()                                   # step 0: a prefilled and done
    run.add("b", n_prompt=4, n_out=1)
    assert run.step() == [("b", "p", 4)]        # step 1: nothing decodes, so no empty step
    run.drain()


@pytest.mark.parametrize("knobs, message", [
    (dict(prefill_schedule_interval=0), r"^--prefill-schedule-interval 0: must be >= 1$"),
    (dict(prefill_coalesce_min_pending=-2), r"^--prefill-coalesce-min-pending -2: must be >= 0$"),
    (dict(prefill_coalesce_max_held_steps=-1),
     r"^--prefill-coalesce-max-held-steps -1: must be >= 0$"),
    (dict(ce_delay_ms=-5.0), r"^--ce-delay-ms -5.0: must be >= 0$"),
])
def test_prefill_gate_refusals(knobs, message):
    with pytest.raises(UserError, match=message):
        check_flags(EngineConfig(**knobs))


# ---- --ce-delay-ms: when a step begins a prefill batch --------------------------------------------
def test_begins_prefill_says_when_the_next_step_admits():
    run = Run(prefill_coalesce_min_pending=2, prefill_coalesce_max_held_steps=50)
    assert not run.s.begins_prefill()
    run.add("a", n_prompt=4, n_out=10)
    assert run.s.begins_prefill()
    run.step()
    assert not run.s.begins_prefill()            # decodes only
    run.add("b")
    assert not run.s.begins_prefill()            # held by the coalescing gate
    run.add("c")
    assert run.s.begins_prefill()
    run.drain()


def test_defaults_keep_every_knob_off():
    cfg = EngineConfig()
    assert (cfg.max_batch_total_tokens, cfg.max_request_input_tokens, cfg.enable_in_flight_batching,
            cfg.enable_prioritize_first_decode, cfg.max_queue_size_tg, cfg.min_batch_size_tg,
            cfg.prefill_coalesce_min_pending, cfg.prefill_coalesce_max_held_steps,
            cfg.prefill_schedule_interval, cfg.ce_delay_ms) == (None, 0, True, False, None, None,
                                                                0, 0, 1, 0.0)
