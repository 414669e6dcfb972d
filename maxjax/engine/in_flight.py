"""The Scheduler's side of the overlap scheduler (maxjax/engine/overlap.py): a plan taken as
computed while its step is still on the device (`advance_rows`: a sampling row's request ends
with a PLACEHOLDER token, filled in when the step's tokens are back), and the requests not to
schedule again meanwhile (`ends_in_flight`). While a step is in flight the Scheduler preempts
nothing: a row that would need it waits, and its `short` says so.
"""
from __future__ import annotations

from maxjax.engine.request import PLACEHOLDER, Request, RequestStatus
from maxjax.engine.step_io import StepPlan


def advance_rows(plan: StepPlan) -> None:
    """Each running row's tokens counted as computed, a PLACEHOLDER appended for a sampling
    row's token. A plan with drafts is never advanced."""
    for row in plan.rows:
        req = row.request
        if req.status is not RequestStatus.RUNNING:
            continue
        assert not row.draft_token_ids and req.num_computed_tokens == row.start_pos, req
        req.num_computed_tokens += len(row.token_ids)
        if row.sample:
            req.append_token(PLACEHOLDER)


def ends_in_flight(req: Request, length_limit: int) -> bool:
    """Nothing left to compute (an embedding's last chunk in flight), or its in-flight
    token is its last by length: it finishes when that token is back."""
    return req.num_uncomputed_tokens < 1 or req.has_placeholder and (
        req.num_output_tokens >= req.sampling.max_new_tokens
        or req.num_tokens >= length_limit)
