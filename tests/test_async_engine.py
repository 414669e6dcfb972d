"""AsyncEngine (its own thread, asyncio streams) on a tiny random Llama: executables primed while
idle, concurrent streams equal single ones, abort frees pages (and ends a stream still listened
to), stop strings, a failing request fails alone, per-phase step timing in stats."""
from __future__ import annotations

import asyncio
import time

import pytest

from maxjax.engine.async_engine import AsyncEngine
from maxjax.engine.core import EngineCore
from maxjax.engine.types import SamplingParams
from tiny_llama import tiny_core

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 7, 9], [11, 3, 8, 20, 31, 4, 9, 100, 7, 2, 12], [40, 41]]


def wait_until(cond, what: str, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    core = tiny_core(tmp_path_factory.mktemp("tiny"))
    eng = AsyncEngine(core, core.model.tokenizer, "tiny", None)
    eng.start()
    yield eng
    eng.shutdown()


async def collect(engine, rid, prompt, params=GREEDY):
    tokens, text = [], ""
    async for out in engine.generate(rid, prompt, params):
        tokens += out.new_token_ids
        text += out.new_text
    return tokens, text


def test_primes_every_executable_while_idle(engine):
    wait_until(lambda: engine.core.primed, "priming to finish")
    assert engine.stats().steps == 0               # priming is not an engine step
    assert engine.stats().xla_compiles_since_ready == 0


def test_concurrent_streams_equal_single_streams(engine):
    singles = [asyncio.run(collect(engine, f"s{i}", p)) for i, p in enumerate(PROMPTS)]

    async def together():
        return await asyncio.gather(*[collect(engine, f"t{i}", p) for i, p in enumerate(PROMPTS)])
    assert list(asyncio.run(together())) == singles
    assert all(len(t) == GREEDY.max_new_tokens and text for t, text in singles)
    wait_until(lambda: engine.stats().kv.pages_used == 0, "pages to return")
    stats = engine.stats()
    assert stats.steps > 0 and stats.xla_compiles_since_ready == 0
    phases = stats.step_seconds
    assert set(phases) >= {"schedule", "build_inputs", "device_step", "update", "detokenize"}
    assert phases["device_step"] > 0 and phases["detokenize"] > 0


def test_leaving_a_stream_aborts_and_frees_pages(engine):
    async def first_two():
        got = []
        async for out in engine.generate("long", PROMPTS[1], SamplingParams(max_new_tokens=40,
                                                                              ignore_eos=True)):
            got += out.new_token_ids
            if len(got) >= 2:
                break
        return got
    assert len(asyncio.run(first_two())) >= 2
    wait_until(lambda: engine.stats().kv.pages_used == 0 and engine.stats().scheduler.running == 0,
               "the aborted request's pages to return")



async def last_output(engine, rid, prompt, params=GREEDY):
    """(tokens, text, the last output) of one stream."""
    tokens, text = [], ""
    async for out in engine.generate(rid, prompt, params):
        tokens += out.new_token_ids
        text += out.new_text
    return tokens, text, out


def test_a_failing_request_fails_alone_and_serving_goes_on(engine, monkeypatch):
    singles = [asyncio.run(collect(engine, f"f{i}", p))[0] for i, p in enumerate(PROMPTS)]
    build = EngineCore._row_input

    def faulty(self, row):
        if row.request.request_id == "bad" and row.request.num_output_tokens >= 2:
            raise RuntimeError("injected fault")
        return build(self, row)
    monkeypatch.setattr(EngineCore, "_row_input", faulty)

    async def together():
        return await asyncio.gather(*[last_output(engine, "bad" if i == 1 else f"g{i}", p)
                                      for i, p in enumerate(PROMPTS)])
    (t0, _, o0), (t1, _, bad), (t2, _, o2) = asyncio.run(together())
    assert bad.finish_reason == "error" and "injected fault" in bad.error
    assert t1 == singles[1][:2]
    assert (t0, t2) == (singles[0], singles[2]) and o0.finish_reason == o2.finish_reason == "length"
    assert engine.num_step_errors == 0
    wait_until(lambda: engine.stats().kv.pages_used == 0, "pages to return")


def test_abort_ends_a_listened_stream_with_abort(engine):
    async def abort_after_first():
        outs = []
        async for out in engine.generate("ab", PROMPTS[0], SamplingParams(max_new_tokens=40,
                                                                            ignore_eos=True)):
            outs.append(out)
            if len(outs) == 1:
                engine.abort("ab")
        return outs
    outs = asyncio.run(abort_after_first())
    assert outs[-1].finish_reason == "abort" and sum(len(o.new_token_ids) for o in outs) < 40
    wait_until(lambda: engine.stats().kv.pages_used == 0, "the aborted request's pages")


def test_stop_string_ends_the_stream(engine):
    tokens, _ = asyncio.run(collect(engine, "full", PROMPTS[1]))
    tok = engine.tokenizer
    text = tok.decode(PROMPTS[1] + tokens)[len(tok.decode(PROMPTS[1])):]
    stop = f"w{tokens[4]}"
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    got, got_text, out = asyncio.run(last_output(engine, "stopped", PROMPTS[1], params))
    assert out.finish_reason == "stop" and got_text == text[:text.index(stop)]
    assert got == tokens[:len(got)] and len(got) <= 5
    wait_until(lambda: engine.stats().kv.pages_used == 0, "pages to return")


# ---- --max-pending-requests (backpressure) and --ce-delay-ms, on an engine of their own --------
CE_DELAY_MS = 300
MAX_PENDING = 2


@pytest.fixture(scope="module")
def paced(tmp_path_factory):
    core = tiny_core(tmp_path_factory.mktemp("tiny"), ce_delay_ms=CE_DELAY_MS)
    eng = AsyncEngine(core, core.model.tokenizer, "tiny", None, max_pending_requests=MAX_PENDING)
    plans, waiting = [], []
    schedule, add = core.scheduler.schedule, core.scheduler.add

    def recording_schedule():
        plan = schedule()
        if plan is not None and plan.num_admitted:
            plans.append([r.request.request_id for r in plan.rows])
        return plan

    def recording_add(req):
        add(req)
        waiting.append(core.scheduler.num_waiting)
    core.scheduler.schedule, core.scheduler.add = recording_schedule, recording_add
    eng.start()
    wait_until(lambda: core.primed, "priming to finish")
    yield eng, plans, waiting
    eng.shutdown()


def test_max_pending_requests_backs_the_queue_up_instead_of_refusing(paced, engine):
    eng, _, waiting = paced
    prompts = PROMPTS + [[3, 4, 5, 6], [7, 8]]
    singles = [asyncio.run(collect(engine, f"bp-single{i}", p)) for i, p in enumerate(prompts)]
    waiting.clear()

    async def together():
        return await asyncio.gather(*[collect(eng, f"bp{i}", p) for i, p in enumerate(prompts)])
    assert list(asyncio.run(together())) == singles        # none refused, none changed
    # All five arrive within the first step's --ce-delay-ms: without the cap all would wait.
    assert len(waiting) == len(prompts) and max(waiting) == MAX_PENDING
    wait_until(lambda: eng.stats().kv.pages_used == 0, "pages to return")


def test_max_pending_requests_below_one_is_refused():
    from maxjax.engine.async_engine import check_max_pending
    from maxjax.errors import UserError
    with pytest.raises(UserError, match=r"^--max-pending-requests 0: must be >= 1"):
        check_max_pending(0)


def test_ce_delay_waits_on_the_engine_thread_for_requests_to_join(paced):
    eng, plans, _ = paced
    plans.clear()
    gaps = []

    async def scenario():
        async def ticker():
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now
        tick = asyncio.create_task(ticker())
        t0 = time.monotonic()
        first = asyncio.create_task(collect(eng, "ce-x", PROMPTS[0]))
        await asyncio.sleep(CE_DELAY_MS / 3000)       # arrives inside the delay
        await collect(eng, "ce-y", PROMPTS[2])
        await first
        tick.cancel()
        return time.monotonic() - t0
    elapsed = asyncio.run(scenario())
    assert plans[0] == ["ce-x", "ce-y"]       # one prefill batch: the delay waited for y
    assert elapsed >= CE_DELAY_MS / 1000
    assert max(gaps) < 0.15                   # the event loop was never blocked by the wait
