"""Continuous batching: which tokens of which requests run in the next step. Called by the engine loop:

    plan = scheduler.schedule()                 # StepPlan or None when idle
    out = ...run the plan...                    # StepOutput: per row, a token per sample slot
    updates = scheduler.update_from_output(plan, out)   # prompt logprobs, pooled states; accept,
                                                        # append, check stop, roll back, cache

A request's tokens to compute are all_token_ids[num_computed_tokens:]: one while decoding, more while
prefilling (a prompt, or everything a preempted request had). Each step holds at most
max_batch_input_tokens tokens in at most max_batch_size rows, filled in this order:
  1. running decodes, one token each (oldest first);
  2. running partial prefills, the next chunk each;
  3. waiting requests, first come first served, while fewer than max_batch_size run: the cached
     prefix is reused, the rest is prefilled in chunks; admission stops at the first request whose
     chunk or pages do not fit, so a big request is never overtaken (no starvation). A request
     whose LoRA adapter finds every device slot held by running requests is passed over (it
     keeps its place and is admitted first once a slot frees): it holds up no one behind it.
The step policy (maxjax/engine/step_policy.py) may leave out some of these kinds of work in a
step (--no-enable-in-flight-batching, --min-batch-size-tg, prefill coalescing and interval), but
never leaves a step empty while work could run. --max-batch-total-tokens caps the sum of the rows'
page-aligned contexts (a decode that does not fit waits a step), --max-request-input-tokens one
row's prefill chunk, --max-queue-size-tg the running requests.
When a running request needs a page and none is left, the newest running request not yet in this
step is preempted by recompute: its pages are freed and it goes back to the front of the queue, its
generated tokens kept and re-prefilled with its prompt. add() rejects requests that could never fit.

Sample slots and rollback: a decode row may carry draft tokens (`Request.draft_token_ids`, set by
a proposer before schedule()): it computes [last token, d1..dk] and samples after each of them.
update() accepts the drafts the samples confirm (a draft is kept while it equals the token sampled
before it; the first differing sample, or the one after the last draft, is the bonus token) and
rolls the rest back: the rejected positions leave num_computed_tokens, pages past the final tokens
go back to the pool, and only pages whose tokens are all final are offered to the prefix cache.
A hybrid model's state rolls back too: the next row restores it from the slot that kept the state
after the last accepted token (state_slots.py StateSlots.verify_slots).

Embedding requests (`Request.pooling`) are prompts only: chunked and batched like any prefill,
they get no sample slot, no drafts and no prefix-cache pages, and they finish (pages freed, an
update with no tokens) in the update of their last chunk.

Overlap (maxjax/engine/overlap.py): `advance(plan)` takes a plan as computed while its step
is still on the device (maxjax/engine/in_flight.py), so the next plan is made before its tokens
are back; `update_from_output(plan, out, advanced=True)` fills them in. While a step is in
flight nothing is preempted: a row that would need it waits, and `short` says so.

Its helpers: maxjax/engine/step_budget.py (a step's budgets, chunk sizes, whether a request
fits), accept.py (a step's results read per row), state_slots.py RequestState (a hybrid
model's state slots and prefix-cache snapshots).

Not thread-safe: call abort()/finish() from the loop, between schedule() and the next schedule().
"""
from __future__ import annotations

from collections import deque

from maxjax.engine.accept import (accept_drafts, keep_results, row_tokens, sampled_by_row,
                                  take_tokens)
from maxjax.engine.block_manager import BlockManager
from maxjax.engine.config import EngineConfig
from maxjax.engine.in_flight import advance_rows, ends_in_flight
from maxjax.engine.request import Request, RequestStatus
from maxjax.engine.stats import SchedulerStats
from maxjax.engine.state_slots import RequestState
from maxjax.engine.step_budget import StepBudget, check_fits, fitting_drafts, prefill_chunk
from maxjax.engine.step_io import ScheduledRow, StepOutput, StepPlan, StepUpdate
from maxjax.engine.types import FinishReason
from maxjax.engine.step_policy import ALL, StepPolicy


class Scheduler:
    def __init__(self, engine_config: EngineConfig, block_manager: BlockManager, max_length: int,
                 eos_token_ids=(), max_draft_tokens: int = 0, lora=None, state_slots=None,
                 snapshots=None):
        """`lora`: the LoraManager (maxjax/lora/manager.py) whose device slots running requests
        hold, None without LoRA; `state_slots`: a hybrid model's StateSlots
        (maxjax/engine/state_slots.py), one held by each running request, None: none;
        `snapshots`: its prefix cache's state Snapshots there, None: none (then its prefill
        chunks are cut as any model's)."""
        cfg = engine_config      # its flags were checked by maxjax/engine/plan.py check_flags
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        self.cfg = cfg
        self.bm = block_manager
        self.max_length = max_length
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_draft_tokens = max_draft_tokens
        self.lora = lora
        self.request_state = RequestState(state_slots, snapshots, cfg.enable_chunked_prefill)
        self.policy = StepPolicy(cfg)
        total = cfg.max_batch_total_tokens
        ps = block_manager.page_size
        # With a cap on the step's context a request can grow only to what fits it alone.
        self.length_limit = max_length if total is None else min(max_length, total // ps * ps + 1)
        self.input_cap = cfg.max_request_input_tokens or cfg.max_batch_input_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # in admission order: the tail is preempted first
        self.requests: dict[str, Request] = {}    # every unfinished request
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0
        self.num_scheduled_rows = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.in_flight = False    # an advanced plan's tokens are not back yet: no preemption
        self.short = False        # the last schedule() left a row out rather than preempt

    # ---- queue ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request the validator (maxjax/engine/validate.py) accepted; RequestError if the
        engine's resources could never run it (a ValueError for a request id in use)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        check_fits(self.cfg, self.bm, req, self.length_limit)
        req.status = RequestStatus.WAITING
        if self.lora is not None and req.adapter_id is not None:
            self.lora.use(req.adapter_id)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request now (a stop string, an abort, an error): frees its pages. None if unknown
        or already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, reason)
        return req

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self._release(req)
        if self.lora is not None:
            self.lora.done(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]

    def _release(self, req: Request) -> None:
        """Give back what a request holds while running: its pages and its state slot."""
        req.drop_placeholder()
        self.bm.free(req)
        self.request_state.release(req)

    @property
    def max_pages_per_row(self) -> int:
        """The most pages any row can hold: the page-table width P the graphs need."""
        return self.bm.pages_for(self.max_length - 1)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step ---------------------------------------------------------------------------
    def _chunk(self, req: Request, budget: int, remaining: int) -> int:
        """step_budget.prefill_chunk, cut for a hybrid model's snapshots (RequestState.cut)."""
        chunk = prefill_chunk(self.cfg, req, budget, remaining)
        return self.request_state.cut(req, req.num_tokens - remaining, chunk)

    def _row(self, req: Request, n: int, drafts: list[int] = ()) -> ScheduledRow:
        s = req.num_computed_tokens
        row = ScheduledRow(req, s, req.all_token_ids[s:s + n] + list(drafts), list(req.pages),
                           s + n == req.num_tokens and not req.is_embedding, list(drafts))
        row.state_save = self.request_state.save_slot(req, s + n)
        row.state_from, row.state_keep = self.request_state.verify_slots(req, len(drafts))
        return row

    def _preempt_newest(self, scheduled: set, preempted: list) -> Request:
        for i in range(len(self.running) - 1, -1, -1):
            victim = self.running[i]
            if victim.request_id not in scheduled:
                break
        del self.running[i]
        self._release(victim)
        if self.lora is not None:
            self.lora.release(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        preempted.append(victim)
        return victim

    def preempt_running(self) -> None:
        """Send every running request back to the queue to be recomputed (the KV pool was lost)."""
        while self.running:
            self._preempt_newest(set(), [])

    def schedule(self) -> StepPlan | None:
        self.short = False
        kinds = self._kinds()
        st = StepBudget(self.cfg.max_batch_input_tokens, self.cfg.max_batch_total_tokens,
                        self.bm.page_size)
        phases = ((kinds.decode, self._schedule_decodes), (kinds.prefill, self._schedule_chunks),
                  (kinds.admit, self._schedule_admissions))
        for on, phase in phases:
            if on:
                phase(st)
        if not st.rows and kinds != ALL:      # never an empty step while some work could run
            for on, phase in phases:
                if not on:
                    phase(st)
        if not st.rows:
            return None
        self.policy.done(kinds, st.num_decode, st.num_admitted,
                         any(r.sample for r in st.rows[st.num_decode:]))
        num_tokens = self.cfg.max_batch_input_tokens - st.budget
        self.num_steps += 1
        self.num_scheduled_tokens += num_tokens
        self.num_scheduled_rows += len(st.rows)
        self.num_decode_tokens += st.num_decode
        self.num_prefill_tokens += num_tokens - st.num_decode
        return StepPlan(st.rows, num_tokens, st.preempted, st.num_admitted)

    def _schedule_decodes(self, st: StepBudget) -> None:
        """Running decodes, one token each (plus drafts), oldest first. Victims come from the
        tail, which this pass has not reached yet."""
        max_rows = self.cfg.max_batch_size
        i = 0
        while i < len(self.running) and len(st.rows) < max_rows and st.budget > 0:
            req = self.running[i]
            room = st.room(req.num_computed_tokens)
            if req.is_prefilling or req.request_id in st.scheduled or room < 1 or \
                    ends_in_flight(req, self.length_limit):
                i += 1
                continue
            drafts = fitting_drafts(req, st.budget, self.max_draft_tokens,
                                    self.max_length)[:room - 1]
            fits = True
            while not self.bm.allocate(req, 1 + len(drafts)):
                if drafts:
                    drafts = []       # drafts never preempt anyone
                    continue
                if self.in_flight:
                    self.short, fits = True, False
                    break
                if self._preempt_newest(st.scheduled, st.preempted) is req:
                    break
            if req.status is RequestStatus.RUNNING:
                if fits:
                    st.add(self._row(req, 1, drafts))
                    st.num_decode += 1
                i += 1

    def _schedule_chunks(self, st: StepBudget) -> None:
        """Running partial prefills, the next chunk each: a chunk shrinks to the pages left;
        with none left, preempt."""
        max_rows, ps = self.cfg.max_batch_size, self.bm.page_size
        i = 0
        while i < len(self.running) and len(st.rows) < max_rows and st.budget > 0:
            req = self.running[i]
            if req.request_id in st.scheduled or not req.is_prefilling:
                i += 1
                continue
            remaining = req.num_uncomputed_tokens
            limit = min(st.room(req.num_computed_tokens), self.input_cap)
            if limit < 1 or self._chunk(req, limit, remaining) == 0:
                i += 1                      # budget too small for a chunk this step
                continue
            while True:
                fit = (len(req.pages) + self.bm.num_free_pages) * ps - req.num_computed_tokens
                chunk = self._chunk(req, min(limit, fit), remaining)
                if chunk:
                    if not self.bm.allocate(req, chunk):
                        raise RuntimeError(f"{chunk} tokens fit the free pages but allocation failed")
                    break
                if self.in_flight:
                    self.short = True
                    break
                if self._preempt_newest(st.scheduled, st.preempted) is req:
                    break
            if req.status is RequestStatus.RUNNING:
                if chunk:
                    st.add(self._row(req, chunk))
                i += 1

    def _schedule_admissions(self, st: StepBudget) -> None:
        """Waiting requests, FCFS: stop at the first that does not fit. Running requests are
        capped at max_batch_size (and --max-queue-size-tg) too, so every decode finds a row in
        every step. A request whose adapter finds every slot held by running requests is passed
        over, keeping its place."""
        max_rows, ps = self.cfg.max_batch_size, self.bm.page_size
        passed: list[Request] = []
        while self.waiting and len(self.running) < self.policy.tg_cap and \
                len(st.rows) < max_rows and st.budget > 0:
            req = self.waiting[0]
            if self.lora is not None and not self.lora.can_acquire(req):
                passed.append(self.waiting.popleft())
                continue
            prefix, restored = self.request_state.resume_point(self.bm.match_prefix(req))
            start = len(prefix.pages) * ps
            limit = min(st.room(start), self.input_cap)
            chunk = self._chunk(req, limit, req.num_tokens - start) if limit > 0 else 0
            if chunk == 0 or not self.bm.allocate(req, chunk, prefix):
                break
            if self.lora is not None:
                self.lora.acquire(req)
            self.request_state.acquire(req)
            self.waiting.popleft()
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            row = self._row(req, chunk)
            row.state_from = restored
            st.add(row)
            st.num_admitted += 1
        self.waiting.extendleft(reversed(passed))

    def advance(self, plan: StepPlan) -> None:
        """Take `plan` as computed while its step is still on the device (in_flight.py
        advance_rows), so the next plan can be made now."""
        advance_rows(plan)
        self.in_flight = True

    def begins_prefill(self) -> bool:
        """Whether the next schedule() would likely admit a waiting request (--ce-delay-ms):
        the step policy allows it and a page is free (the prefix cache is not consulted)."""
        if not self.waiting or self.bm.num_free_pages == 0:
            return False
        return self._kinds().admit and len(self.running) < self.policy.tg_cap

    def _kinds(self):
        num_decoding = sum(not r.is_prefilling for r in self.running)
        return self.policy.kinds(self.num_steps, num_decoding, len(self.running) - num_decoding,
                                 self.waiting, len(self.running))

    def update_from_output(self, plan: StepPlan, out: StepOutput,
                           advanced: bool = False) -> list[StepUpdate]:
        """Take in what running `plan` gave, once: each row's prompt logprobs and pooled
        states kept on its request, its samples accepted (update()); the updates carry each
        row's samples on to output processing. `advanced`: the plan was `advance`d, its
        placeholders are filled in."""
        keep_results(plan, out)
        return self._apply(plan, [None if res is None else res.token_ids for res in out.results],
                           [[] if res is None else res.samples for res in out.results], advanced)

    def update(self, plan: StepPlan, sampled) -> list[StepUpdate]:
        """Apply a step's sampled tokens (update_from_output without the rest of a result).
        `sampled[i]`: row i's sampled tokens, one per sample slot (a bare int for a one-slot
        row; ignored for rows that do not sample), or the same for the sampling rows only."""
        return self._apply(plan, sampled_by_row(plan, sampled), [[]] * len(plan.rows))

    def _apply(self, plan: StepPlan, sampled: list, samples: list[list],
               advanced: bool = False) -> list[StepUpdate]:
        updates = []
        self.in_flight = False
        for row, tokens, row_samples in zip(plan.rows, sampled, samples):
            req = row.request
            if req.status is not RequestStatus.RUNNING:
                continue                    # finished or aborted since the plan was made
            computed = len(row.token_ids) * (not advanced)
            assert req.num_computed_tokens + computed == row.start_pos + len(row.token_ids), \
                (req, row.start_pos)
            req.draft_token_ids = []
            if not row.sample:
                req.num_computed_tokens += computed
                self._cache_pages(req)
                if req.is_embedding and req.num_computed_tokens == req.num_tokens:
                    updates.append(StepUpdate(req, []))   # its last chunk: done, pages freed
                    self.running.remove(req)
                    self._finish(req, FinishReason.STOP)
                continue
            accepted = accept_drafts(row.draft_token_ids, row_tokens(row, tokens))
            rejected = len(row.draft_token_ids) - (len(accepted) - 1)
            self.request_state.accepted(req, len(row.draft_token_ids), len(accepted) - 1)
            req.num_computed_tokens += computed - rejected
            if rejected:
                self.bm.truncate(req, req.num_computed_tokens)
            added, reason = take_tokens(req, accepted, advanced, self.eos_token_ids,
                                        self.length_limit)
            self._cache_pages(req)
            updates.append(StepUpdate(req, added, row_samples))
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
        return updates

    def _cache_pages(self, req: Request) -> None:
        """Offer req's computed full pages to the prefix cache, then its pending state
        snapshots to the cached pages they end."""
        self.bm.cache_full_pages(req)
        self.request_state.bind(req)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            waiting=len(self.waiting), running=len(self.running),
            preemptions=self.num_preemptions, scheduled_tokens=self.num_scheduled_tokens,
            scheduled_rows=self.num_scheduled_rows, prefill_tokens=self.num_prefill_tokens,
            decode_tokens=self.num_decode_tokens)

