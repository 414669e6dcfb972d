"""The overlap scheduler (maxjax/engine/overlap.py) on the mock model, nothing compiled: an
EngineCore whose runner is a mock "device" that computes a step when it is launched and hands
its tokens over only when they are collected, recording both. With overlap on, step N+1 is
launched before step N's tokens are read (the host never waits on the device to build the next
step), every output equals what the mock generates for the request alone and the synchronous
engine's, requests ending early (EOS, stop tokens, max_tokens) free every page, and rows that
need step N's token on the host (penalties) wait for it."""
from __future__ import annotations

import pytest

from maxjax.engine.block_manager import BlockManager
from maxjax.engine.config import EngineConfig
from maxjax.engine.core import EngineCore
from maxjax.engine.output import OutputProcessor, merge_outputs
from maxjax.engine.overlap import OverlapLoop
from maxjax.engine.request import PLACEHOLDER
from maxjax.engine.runner import RowResult, Sample
from maxjax.engine.scheduler import Scheduler
from maxjax.engine.types import SamplingParams
from mock_model import MockModel, reference_generate
from pool_check import check_pool

VOCAB = 1000
EOS = 7


class MockDevice:
    """ModelRunner's launch/collect on the mock model. A fed row's first token is the one the
    step it is fed from sampled, which only this "device" knows until that step is collected."""

    def __init__(self, page_size: int):
        self.model = MockModel(page_size, VOCAB)
        self.events: list[tuple[str, int]] = []
        self.launches = 0

    def launch(self, rows, feed=None):
        self.launches += 1
        slices = [r.slice for r in rows]
        if feed is not None:
            prev, src = feed
            for s, i in zip(slices, src):
                if i is not None:
                    assert s.token_ids == [PLACEHOLDER]
                    s.token_ids = [prev.tokens[i]]
        assert all(PLACEHOLDER not in s.token_ids for s in slices), "an unfed placeholder"
        out = self.model.run(slices)
        tokens = []
        for s, t in zip(slices, out):
            tokens += [t] * s.num_samples
        self.events.append(("launch", self.launches))
        return _Launched(self.launches, rows, tokens)

    def collect(self, launched):
        self.events.append(("read", launched.n))
        rows, i = [], 0
        for r in launched.rows:
            k = r.slice.num_samples
            rows.append(RowResult([Sample(t, 0.0, [], []) for t in launched.tokens[i:i + k]]))
            i += k
        return _Result(rows, None, {"device_step": 0.0})

    def run(self, rows):
        return self.collect(self.launch(rows))


class _Launched:
    def __init__(self, n, rows, tokens):
        self.n, self.rows, self.tokens, self.build_seconds = n, rows, tokens, 0.0


class _Result:
    def __init__(self, rows, bucket, timing):
        self.rows, self.bucket, self.timing = rows, bucket, timing


def mock_core(overlap: bool, pages=40, page_size=4, budget=16, rows=4) -> EngineCore:
    """An EngineCore built around the mock device, its scheduler and output processor real."""
    cfg = EngineConfig(max_batch_size=rows, max_batch_input_tokens=budget,
                       kv_cache_page_size=page_size)
    core = EngineCore.__new__(EngineCore)
    core.cfg = cfg
    core.block_manager = BlockManager(pages, page_size, True, "fast")
    core.scheduler = Scheduler(cfg, core.block_manager, 256, (EOS,))
    core.runner = MockDevice(page_size)
    core.output = OutputProcessor(None)
    core.speculator = core.grammars = core.lora = core.images = core.kv_events = None
    core.step_compiles = core.grammar_faults = 0
    core._ce_waited = False
    core.profile = {k: 0.0 for k in ("schedule", "build_inputs", "device_step", "update",
                                     "detokenize", "steps", "tokens")}
    core.overlap = OverlapLoop(core) if overlap else None
    return core


def run(core, requests: dict) -> dict:
    from maxjax.engine.request import Request
    for rid, (prompt, params) in requests.items():
        core.scheduler.add(Request(rid, list(prompt), params))
    got = {rid: [] for rid in requests}
    steps = 0
    while core.has_unfinished():
        for out in core.step():
            got[out.request_id].append(out)
        steps += 1
        assert steps < 10_000
    assert all(outs[-1].finished for outs in got.values())
    check_pool(core.block_manager)
    assert core.block_manager.num_used_pages == 0
    return {rid: merge_outputs(outs) for rid, outs in got.items()}


def workload(n=10, **params):
    return {f"r{i}": ([11 + i, 30 + 2 * i, 5 + i][:1 + i % 3] * (1 + i % 4),
                      SamplingParams(max_new_tokens=3 + 2 * i, **params)) for i in range(n)}


def expected(requests, eos=EOS) -> dict:
    """Each request's tokens alone: cut after EOS / a stop token, or at max_new_tokens."""
    out = {}
    for rid, (prompt, p) in requests.items():
        toks = reference_generate(prompt, p.max_new_tokens, VOCAB)
        for i, t in enumerate(toks):
            if (t == eos and not p.ignore_eos) or t in p.stop_token_ids:
                toks = toks[:i + 1]
                break
        out[rid] = toks
    return out


def test_the_next_step_is_launched_before_this_one_is_read():
    core = mock_core(True)
    reqs = workload(ignore_eos=True)
    got = run(core, reqs)
    assert {r: o.new_token_ids for r, o in got.items()} == expected(reqs)
    ev = core.runner.events
    pos = {e: i for i, e in enumerate(ev)}
    # every step but the last was still unread when the next one was launched
    overlapped = [n for n in range(1, core.runner.launches)
                  if pos[("launch", n + 1)] < pos[("read", n)]]
    assert len(overlapped) == core.runner.launches - 1, ev


def test_same_outputs_as_the_synchronous_engine_with_early_ends():
    """EOS and stop tokens end requests whose next token is already in flight: it is dropped,
    nothing leaks, and the completion counts are the synchronous engine's."""
    reqs = workload(12)
    stops = expected({r: (p, SamplingParams(max_new_tokens=sp.max_new_tokens, ignore_eos=True))
                      for r, (p, sp) in reqs.items()})
    for i, (rid, (prompt, sp)) in enumerate(reqs.items()):     # a stop token from its own output
        if i % 3 == 0 and len(stops[rid]) > 2:
            reqs[rid] = (prompt, SamplingParams(max_new_tokens=sp.max_new_tokens,
                                                stop_token_ids=[stops[rid][2]]))
    sync, over = run(mock_core(False), reqs), run(mock_core(True), reqs)
    want = expected(reqs)
    assert any(len(want[r]) < reqs[r][1].max_new_tokens for r in reqs)    # some end early
    for rid in reqs:
        assert over[rid].new_token_ids == sync[rid].new_token_ids == want[rid], rid
        assert over[rid].finish_reason == sync[rid].finish_reason
        assert over[rid].completion_tokens == sync[rid].completion_tokens == len(want[rid])


def test_a_short_pool_preempts_only_between_steps_and_keeps_outputs():
    reqs = workload(8, ignore_eos=True)
    sync, over = mock_core(False, pages=9), mock_core(True, pages=9)
    a, b = run(sync, reqs), run(over, reqs)
    assert sync.scheduler.num_preemptions > 0 and over.scheduler.num_preemptions > 0
    assert {r: o.new_token_ids for r, o in b.items()} == \
        {r: o.new_token_ids for r, o in a.items()} == expected(reqs)


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.2), dict(presence_penalty=0.5)])
def test_a_row_with_penalties_waits_for_the_token_it_follows(penalty):
    """Its sampling history needs step N's token on the host: N is read before N+1 launches."""
    core = mock_core(True)
    reqs = {"p": ([3, 4, 5], SamplingParams(max_new_tokens=6, ignore_eos=True, **penalty))}
    got = run(core, reqs)
    assert got["p"].new_token_ids == expected(reqs)["p"]
    pos = {e: i for i, e in enumerate(core.runner.events)}
    assert all(pos[("read", n)] < pos[("launch", n + 1)] for n in range(1, core.runner.launches))


def test_an_abort_while_a_step_is_in_flight_frees_everything():
    """The aborted request's in-flight token is never emitted nor counted."""
    core = mock_core(True)
    from maxjax.engine.request import Request
    core.scheduler.add(Request("a", [1, 2, 3], SamplingParams(max_new_tokens=50, ignore_eos=True)))
    core.scheduler.add(Request("b", [4, 5], SamplingParams(max_new_tokens=8, ignore_eos=True)))
    emitted = []
    for _ in range(4):
        emitted += [t for o in core.step() if o.request_id == "a" for t in o.new_token_ids]
    assert core.overlap.pending is not None and core.scheduler.requests["a"].has_placeholder
    last = core.abort("a")
    assert last.finished and last.completion_tokens == len(emitted) > 0
    assert emitted == reference_generate([1, 2, 3], len(emitted), VOCAB)
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert [o.request_id for o in outs if o.finished] == ["b"]
    check_pool(core.block_manager)
    assert core.block_manager.num_used_pages == 0
