"""Speculative decoding: which requests speculate, who proposes their draft tokens, how many
drafts a step verifies, and the acceptance counters. EngineCore.step calls, around one step:

    speculator.propose(scheduler)          # sets draft_token_ids of the decoding requests
    plan = scheduler.schedule(); results = runner.run(...).rows   # [last, d1..dk]: k+1 slots
    speculator.verify(plan.rows, results)  # only --synthetic-acceptance-rate rewrites samples
    speculator.observe(plan.rows, results, bucket, seconds)   # acceptance and step-time estimates

Verification is plain sampling at every slot, with the same seed hash at the same output
position as a step without drafts; Scheduler.update keeps a draft while it equals the token
sampled before it (`accept_drafts`). With a deterministic (one-hot) proposal this is the
speculative-sampling rule itself: the draft d is kept with probability p(d), and when it is not,
the emitted token is distributed as p with d removed, renormalized (p: the target's processed,
filtered distribution at that slot). So the output distribution is the target's, greedy output
is unchanged, and a seeded request emits the same tokens with or without speculation (up to the
float rounding of a different batch shape). Slot k's penalties and min_tokens see the k drafts
before it (ModelRunner.run).

How many drafts: verifying costs a bigger bucket (on XLA:CPU an 8-token step takes ~2x a
1-token one; at 32 rows the extra tokens cost through every layer), so each step picks the
total draft count that maximizes expected tokens per second, from the measured device time of
each bucket (learned online; a bucket not yet timed is assumed to cost what the next smaller
measured one does, so it is tried; one decision in 64 is a random count, to measure again) and each request's estimated acceptance (a draft at position j is
worth a^j; a: the request's kept / verified drafts, with the running average as prior). Drafts
only use the budget that pending prefills leave, and none at all in a step with prefill chunks
unless --enable-spec-decode-mixed-batches; per request at most --num-speculative-tokens, or the
--num-speculative-tokens-per-batch-size cap for the step's number of decoding requests, or in a
mixed step --num-speculative-tokens-mixed-batch (`Speculator.cap`).
"""
from __future__ import annotations

import random
from typing import Sequence

import numpy as np

from maxjax.engine import spec_flags
from maxjax.engine.accept import accept_drafts
from maxjax.engine.buckets import pick_bucket
from maxjax.engine.ngram import propose as ngram_propose
from maxjax.engine.request import Request
from maxjax.engine.stats import SpecStats
from maxjax.errors import UserError

_DECAY = 0.9          # per observation, of a request's acceptance counts
_PRIOR_WEIGHT = 2.0   # drafts' worth of the global rate in a request's estimate
_TIME_EMA = 0.2
# Every so many decisions a random draft count: its bucket's time and the acceptance estimates
# are measured again (the machine's load changes; a bad first sample must not stop speculation).
_EXPLORE_EVERY = 64


def build(cfg, layout, model=None, graphs=None, k: int = 0, plan=None) -> "Speculator | None":
    """The engine's speculator for `cfg` with at most `k` drafts per request and step (the
    plan's `draft_tokens`; 0: speculation off). `plan`: the engine's, for a draft model's
    sub-plan; `graphs`: where a draft model's graphs come from (draft.DraftProposer)."""
    if not k:
        return None
    if cfg.speculative_method == "draft":
        from maxjax.engine import draft
        proposer = draft.DraftProposer(
            draft.load_draft(cfg, model, layout.max_length, layout.platform), plan, graphs)
    elif cfg.speculative_method == "mtp":
        from maxjax.engine import mtp
        proposer = mtp.MtpProposer(model, plan)
    else:
        proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    return Speculator(proposer, k, layout.buckets, cfg.max_batch_size,
                      cfg.max_batch_input_tokens, spec_flags.greedy_only(cfg),
                      schedule=spec_flags.batch_schedule(
                          cfg.num_speculative_tokens_per_batch_size, k),
                      mixed=cfg.enable_spec_decode_mixed_batches,
                      mixed_tokens=cfg.num_speculative_tokens_mixed_batch,
                      synthetic_rate=cfg.synthetic_acceptance_rate)


def may_speculate(req: Request, greedy_only: bool) -> bool:
    """The one check of whether a request may get drafts this step. A grammar's matcher would
    have to validate every draft first (llguidance `validate_tokens`): until then, none. An
    embedding request generates nothing."""
    if req.grammar is not None or req.is_embedding:
        return False
    return not greedy_only or req.sampling.greedy


class NgramProposer:
    """Prompt lookup over the request's prompt and output (maxjax/engine/ngram.py)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        return [ngram_propose(r.all_token_ids, k, self.min_n, self.max_n) for r in requests]

    def warmup(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def observe(self, rows, results) -> None:
        pass


class Speculator:
    def __init__(self, proposer, num_tokens: int, buckets, max_batch_size: int,
                 max_batch_input_tokens: int, greedy_only: bool = False, *, schedule=(),
                 mixed: bool = True, mixed_tokens: int | None = None,
                 synthetic_rate: float | None = None):
        """`schedule`: (first, last, most drafts) by the number of decoding requests;
        `mixed`: drafts in steps that carry prefill chunks too, at most `mixed_tokens` per
        request there (None: as a decode-only step); `synthetic_rate`: keep drafts at random
        (--synthetic-acceptance-rate)."""
        self.proposer = proposer
        self.k = num_tokens
        self.schedule = list(schedule)
        self.mixed, self.mixed_tokens = mixed, mixed_tokens
        self.synthetic = None if synthetic_rate is None else \
            spec_flags.calibrated_rate(synthetic_rate, num_tokens)
        self._synthetic_rng = random.Random(1)
        self.buckets = sorted(buckets)
        self.max_rows = max_batch_size
        self.budget = max_batch_input_tokens
        self.greedy_only = greedy_only
        self.step_seconds: dict = {}           # Bucket -> EMA of its device step time
        self._runs: dict = {}                  # Bucket -> steps seen (the first is not timed)
        self._decisions = 0
        self._rng = random.Random(0)
        self.kept, self.verified = 1.0, 2.0    # global acceptance counts (prior 0.5)
        # counters (stats(), /metrics, generate --profile)
        self.num_rows_verified = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.drafted_at = [0] * num_tokens
        self.accepted_at = [0] * num_tokens

    def warmup(self) -> None:
        """Compile (and prime) what the proposer runs: the draft model's graphs."""
        self.proposer.warmup()

    def attach(self, runner) -> None:
        """The target's ModelRunner, for a proposer that reads its steps (MTP's)."""
        if hasattr(self.proposer, "attach"):
            self.proposer.attach(runner)

    def reset(self, scheduler) -> None:
        """After a failed proposal: no drafts, and the proposer's state starts over."""
        for r in scheduler.running:
            r.draft_token_ids = []
        self.proposer.reset()

    # ---- before the step ------------------------------------------------------------------------
    def propose(self, scheduler) -> None:
        """Set `draft_token_ids` on every decoding request (empty where no draft pays)."""
        decoding = [r for r in scheduler.running if not r.is_prefilling][:self.max_rows]
        for r in scheduler.running:
            r.draft_token_ids = []
        spec = [r for r in decoding if may_speculate(r, self.greedy_only)]
        if not spec:
            return
        # Prefills first: the prompts (and preempted sequences) the scheduler could admit.
        admit = max(0, self.max_rows - len(scheduler.running))
        pending = sum(r.num_uncomputed_tokens for r in scheduler.running if r.is_prefilling)
        pending += sum(r.num_tokens for r in list(scheduler.waiting)[:admit])
        n = len(decoding)
        room = min(self.budget - n - pending, self.cap(n, pending > 0))
        if room <= 0:
            return
        proposals = self.proposer.propose(spec, room)
        cands = []     # (worth, position, request index)
        for i, (r, p) in enumerate(zip(spec, proposals)):
            # what the scheduler would keep: the request's remaining length and max_new_tokens
            p = proposals[i] = p[:max(0, min(scheduler.max_length - 1 - r.num_tokens,
                                             r.sampling.max_new_tokens - r.num_output_tokens - 1))]
            a = self._rate(r)
            cands += [(a ** (j + 1), j, i) for j in range(len(p))]
        if not cands:
            return
        cands.sort(key=lambda c: (-c[0], c[1]))
        worth = np.cumsum([c[0] for c in cands])
        d = self._best_count(n, n + (pending > 0), pending, worth, min(room, len(cands)))
        take = [0] * len(spec)
        for _, _, i in cands[:d]:
            take[i] += 1
        for r, p, m in zip(spec, proposals, take):
            r.draft_token_ids = p[:m]

    def cap(self, batch_size: int, mixed: bool) -> int:
        """The most drafts per request in a step of `batch_size` decoding requests, `mixed`
        with prefill chunks."""
        if mixed and not self.mixed:
            return 0
        if mixed and self.mixed_tokens is not None:
            return self.mixed_tokens
        for first, last, n in self.schedule:
            if first <= batch_size <= last:
                return n
        return self.k

    def _rate(self, r: Request) -> float:
        kept, verified = r.spec_counts
        prior = self.kept / self.verified
        return (kept + _PRIOR_WEIGHT * prior) / (verified + _PRIOR_WEIGHT)

    def _cost(self, tokens: int, rows: int, samples: int) -> float | None:
        try:
            b = pick_bucket(self.buckets, tokens, rows, samples)
        except ValueError:
            return None
        if b in self.step_seconds:
            return self.step_seconds[b]
        known = [t for bb, t in self.step_seconds.items() if bb < b]
        return max(known) if known else 0.0

    def _best_count(self, n: int, rows: int, prefill: int, worth, max_d: int) -> int:
        """The number of drafts (the best `worth` first) with the most expected tokens per
        second: evaluated at no drafts and at each bucket's largest draft count."""
        def rate(d):
            t = self._cost(n + d + prefill, rows, n + d + (prefill > 0))
            if t is None:
                return -1.0
            gain = n + (worth[d - 1] if d else 0.0)
            return gain / t if t > 0 else float("inf")
        counts = {0, max_d}
        counts |= {b.num_tokens - n - prefill for b in self.buckets
                   if 0 < b.num_tokens - n - prefill < max_d}
        counts = sorted(counts)
        self._decisions += 1
        if self._decisions % _EXPLORE_EVERY == 0:
            return self._rng.choice(counts)
        return max(counts, key=rate)

    # ---- after the step -------------------------------------------------------------------------
    def verify(self, rows, results) -> None:
        """With --synthetic-acceptance-rate, before the scheduler's acceptance: each row's
        samples rewritten so that its drafts stand, position by position, with the calibrated
        probability (the first refused one gets a token other than the draft)."""
        if self.synthetic is None:
            return
        for row, res in zip(rows, results):
            drafts = row.draft_token_ids
            if not drafts or res is None:
                continue
            n = 0
            while n < len(drafts) and self._synthetic_rng.random() < self.synthetic:
                n += 1
            for j in range(n):
                res.samples[j].token_id = drafts[j]
            if n < len(drafts) and res.samples[n].token_id == drafts[n]:
                res.samples[n].token_id = drafts[n] - 1 if drafts[n] else 1

    def observe(self, rows, results, bucket, seconds: float | None) -> None:
        """Learn from a step: its bucket's time, and each verified row's kept drafts."""
        runs = self._runs[bucket] = self._runs.get(bucket, 0) + 1
        # An executable's first run (unless primed while idle) costs 0.1-0.3 s more.
        if bucket is not None and seconds is not None and runs > 1:
            old = self.step_seconds.get(bucket)
            self.step_seconds[bucket] = seconds if old is None else \
                (1 - _TIME_EMA) * old + _TIME_EMA * seconds
        for row, res in zip(rows, results):
            drafts = row.draft_token_ids
            if not drafts or res is None:
                continue
            n = len(accept_drafts(drafts, res.token_ids)) - 1
            self.num_rows_verified += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += n
            for j in range(len(drafts)):
                self.drafted_at[j] += 1
                self.accepted_at[j] += j < n
            trials = n + (n < len(drafts))
            kept, verified = row.request.spec_counts
            row.request.spec_counts = (_DECAY * kept + n, _DECAY * verified + trials)
            self.kept, self.verified = self.kept + n, self.verified + trials
        self.proposer.observe(rows, results)

    def stats(self) -> SpecStats:
        return SpecStats(rows_verified=self.num_rows_verified, draft_tokens=self.num_draft_tokens,
                         accepted_tokens=self.num_accepted_tokens,
                         drafted_at=tuple(self.drafted_at), accepted_at=tuple(self.accepted_at))


def report(spec: SpecStats) -> str:
    """A few lines on acceptance for `maxjax generate --profile` (empty without speculation)."""
    rows = spec.rows_verified
    if not rows:
        return ""
    by_pos = " ".join(f"{a / d:.2f}" if d else "-"
                      for a, d in zip(spec.accepted_at, spec.drafted_at))
    return (f"speculation: {rows} rows verified, {spec.draft_tokens} drafts, "
            f"{spec.accepted_tokens} accepted "
            f"({spec.accepted_tokens / rows:.2f} per verified row, "
            f"{spec.accepted_tokens / max(spec.draft_tokens, 1):.0%})\n"
            f"acceptance rate by position: {by_pos}")
