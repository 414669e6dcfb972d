"""What goes into and out of one engine step, between the scheduler and the rest of EngineCore:
the plan (`StepPlan` of `ScheduledRow`s, made by Scheduler.schedule), what running it gave
(`StepOutput`: one RowResult per row, made by EngineCore), and what the scheduler made of that
(`StepUpdate` per request, returned by Scheduler.update_from_output: the one place a step's
result is taken apart; grammars, output processing and the speculator read the updates or the
StepOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from maxjax.engine.request import Request
from maxjax.engine.types import RequestOutput

if TYPE_CHECKING:
    from maxjax.engine.runner import RowResult, Sample


@dataclass
class ScheduledRow:
    """The tokens one request contributes to a step (same fields as graphs.step.RowSlice)."""
    request: Request
    start_pos: int
    token_ids: list[int]      # to compute: uncomputed tokens, then draft_token_ids
    pages: list[int]
    sample: bool       # its last token yields a new token (False for a non-final prefill chunk)
    draft_token_ids: list[int] = field(default_factory=list)
    state_from: int = 0       # a hybrid model's state snapshot this row resumes from (0: none)
    state_save: int = 0       # the snapshot its state after this step is saved to (0: none)
    state_keep: list[int] | None = None   # per token, the slot its state after it is kept in

    @property
    def num_samples(self) -> int:
        """Sample slots: after the last real token and after each draft."""
        return 1 + len(self.draft_token_ids) if self.sample else 0


@dataclass
class StepPlan:
    rows: list[ScheduledRow]
    num_tokens: int
    preempted: list[Request] = field(default_factory=list)   # sent back to the queue by this plan

    num_admitted: int = 0      # waiting requests this plan admitted

    @property
    def num_rows(self) -> int:
        return len(self.rows)


@dataclass
class StepOutput:
    """What running a plan gave: per plan row, in order, its RowResult (None: its request failed
    or went back to the queue); the last outputs of the requests that failed in it; the bucket
    and device seconds of its last runner call (None when no call returned)."""
    results: list[RowResult | None]
    failed: list[RequestOutput] = field(default_factory=list)
    bucket: Any = None
    device_seconds: float | None = None


@dataclass
class StepUpdate:
    """What one step added to one request: the tokens appended (1 + accepted drafts, cut at a
    stop), finished requests included (status and finish_reason say so), and the runner's
    Samples of its row (the first ones match the tokens; empty for a row that did not sample)."""
    request: Request
    token_ids: list[int]
    samples: list[Sample] = field(default_factory=list)
