"""The overlap scheduler (--enable-overlap-scheduler): EngineCore.step when it is on. While step N
runs on the device, the host schedules step N+1, builds its inputs and queues it, and only then
waits for step N's tokens, takes them in (stop checks, grammars, detokenizing: the outputs it
returns) and leaves N+1 on the device for the next call; JAX dispatches asynchronously, so the
device goes from N to N+1 without waiting for the host (vLLM v1's async scheduling, SGLang's
overlap scheduler).

How N+1 is made before N's tokens are known: the scheduler `advance`s N once it is queued (its
rows' tokens count as computed, a sampling row's request ends with a PLACEHOLDER token), and
N+1's rows that continue from N take their token from N's sampled ids on the device
(ModelRunner.launch's feed). A request that finishes in N (EOS, a stop token or string) has had
one more token scheduled in N+1: its row's result is dropped (the request is no longer running)
and its pages go back when N is taken in; N+1 still writes that token's K/V into them, but the
device runs N+2, which may reuse them, after N+1. A request whose last token by length is in
flight is not scheduled again. Nothing is preempted while a step is in flight.

Where N+1's inputs need N's tokens on the host, N is taken in first and N+1 is built then (its
PLACEHOLDERs are real tokens by then): a row under a grammar (its mask follows the token N
sampled), a row with penalties (its history), a plan that had to leave a row out rather than
preempt (`Scheduler.short`: that plan also runs to its end, so the next one may preempt).
The planner turns overlap off with speculative decoding, several devices or processes, and for
hybrid models (maxjax/engine/overlap_plan.py). Outputs equal the synchronous engine's.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from maxjax.engine import compile_counter
from maxjax.engine.request import PLACEHOLDER
from maxjax.engine.step_io import StepOutput, StepPlan
from maxjax.engine.types import RequestOutput

log = logging.getLogger("maxjax.engine")


@dataclass
class InFlight:
    """A step queued on the device and advanced in the scheduler, its tokens not read yet."""
    plan: StepPlan
    launched: object                  # ModelRunner.launch's Launched; None: nothing launched
    rows: list                        # the plan rows launched, in order
    failed: list[RequestOutput] = field(default_factory=list)
    slot_of: dict[str, int] = field(default_factory=dict)   # request id -> its sample slot


class OverlapLoop:
    def __init__(self, core):
        self.core = core
        self.pending: InFlight | None = None
        self._poisoned = False

    def step(self) -> list[RequestOutput]:
        core, sched = self.core, self.core.scheduler
        plan = core._schedule()
        pend, self.pending = self.pending, None
        if plan is None:
            return self._take(pend) if pend else []
        ahead = None
        if pend is not None and not sched.short and self._feedable(plan):
            ahead = self._launch(plan, pend)       # before pend's tokens are read back
        outs = self._take(pend) if pend is not None else []
        if self._poisoned:            # pend failed on the device: this plan is not run
            if ahead is not None and ahead.launched is not None:
                self._drop(ahead)
            return outs
        if ahead is None:
            _fill_placeholders(plan)
            ahead = self._launch(plan, None)
        if ahead.launched is None:    # the runner raised: the synchronous step, at fault
            _fill_placeholders(plan)
            return outs + ahead.failed + core.take(plan, core._run(plan.rows))
        if sched.short:               # it left a row out: to its end, so the next may preempt
            return outs + self._take(ahead, advanced=False)
        sched.advance(plan)
        self.pending = ahead
        return outs

    @staticmethod
    def _feedable(plan: StepPlan) -> bool:
        """Whether every row that continues from the step in flight needs only its token."""
        for row in plan.rows:
            if row.token_ids and row.token_ids[0] == PLACEHOLDER:
                req = row.request
                sp = req.sampling
                if req.grammar is not None or sp.frequency_penalty or sp.presence_penalty \
                        or sp.repetition_penalty != 1.0:
                    return False
        return True

    def _launch(self, plan: StepPlan, pend: InFlight | None) -> InFlight | None:
        """`plan` queued on the device (fed from `pend`'s tokens); an InFlight whose launched
        is None if the runner raised (the step then runs synchronously); None if a row of
        the plan cannot be fed (nothing launched)."""
        core = self.core
        inputs, failed = core.inputs(plan.rows)
        rows = [row for row, _ in inputs]
        src = None
        if pend is not None:
            src = [pend.slot_of.get(row.request.request_id)
                   if row.token_ids[0] == PLACEHOLDER else None for row in rows]
            if any(s is None and row.token_ids[0] == PLACEHOLDER for s, row in zip(src, rows)):
                return None
        before = compile_counter.count()
        try:
            launched = core.runner.launch([x for _, x in inputs], src and (pend.launched, src))
        except Exception:
            log.exception("launching a step failed: it runs again synchronously")
            return InFlight(plan, None, rows, failed)
        finally:
            core.step_compiles += compile_counter.count() - before
        core.profile["build_inputs"] += launched.build_seconds
        slot_of, s = {}, 0
        for row, x in inputs:
            if x.slice.num_samples:
                slot_of[row.request.request_id] = s
            s += x.slice.num_samples
        return InFlight(plan, launched, rows, failed, slot_of)

    def _take(self, pend: InFlight, advanced: bool = True) -> list[RequestOutput]:
        """`pend`'s tokens read back and taken in: its outputs. A device fault fails its
        requests and sets `_poisoned`."""
        core = self.core
        self._poisoned = False
        try:
            result = core.runner.collect(pend.launched)
        except Exception as e:       # a device fault: the step's requests fail
            self._poisoned = True
            core.scheduler.in_flight = False
            failed = [core.fail(row.request, "the model step", e) for row in pend.rows
                      if not row.request.is_finished]
            if core.kv_lost():
                core.replace_kv()
            return pend.failed + failed
        core.profile["device_step"] += result.timing["device_step"]
        got = dict(zip(map(id, pend.rows), result.rows))
        out = StepOutput([got.get(id(row)) for row in pend.plan.rows], pend.failed,
                         result.bucket, result.timing["device_step"])
        return core.take(pend.plan, out, advanced)

    def _drop(self, ahead: InFlight) -> list[RequestOutput]:
        """A step launched on a failed one's tokens: its results are not used; the pool it
        donated into is replaced and the running requests are recomputed."""
        try:
            self.core.runner.collect(ahead.launched)
        except Exception:
            pass
        self.core.replace_kv()
        return ahead.failed


def _fill_placeholders(plan: StepPlan) -> None:
    """The rows' PLACEHOLDERs, now that the step in flight was taken in, as its tokens."""
    for row in plan.rows:
        req = row.request
        if row.token_ids and row.token_ids[0] == PLACEHOLDER and not req.is_finished:
            row.token_ids = req.all_token_ids[row.start_pos:row.start_pos + len(row.token_ids)]
