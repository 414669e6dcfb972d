"""A step's results read for each of its rows, for the Scheduler's update
(maxjax/engine/scheduler.py update_from_output / update): the results kept on the requests
(`keep_results`: prompt logprobs, pooled states), the sampled tokens per row (`sampled_by_row`),
a sampling row's tokens (`row_tokens`), the drafts they confirm (`accept_drafts`, also the
speculator's acceptance count), and those taken into the request up to the first that ends it
(`take_tokens`, `stop_reason`).
"""
from __future__ import annotations

import numpy as np

from maxjax.engine.output import keep_prompt_logprobs
from maxjax.engine.request import Request
from maxjax.engine.step_io import ScheduledRow, StepOutput, StepPlan
from maxjax.engine.types import FinishReason


def keep_results(plan: StepPlan, out: StepOutput) -> None:
    """Each row's prompt logprobs and pooled states kept on its request."""
    for row, res in zip(plan.rows, out.results):
        if res is None:
            continue
        if res.prompt_logprobs is not None:
            keep_prompt_logprobs(row.request, row.start_pos, len(row.token_ids),
                                 res.prompt_logprobs)
        if res.pooled is not None:
            row.request.add_pooled(row.start_pos, *res.pooled)


def sampled_by_row(plan: StepPlan, sampled) -> list:
    """`sampled` as one entry per row of `plan`: given one per row, or one per sampling row
    (then None for the others)."""
    if len(sampled) == len(plan.rows):
        return sampled
    n_sample = sum(r.sample for r in plan.rows)
    if len(sampled) != n_sample:
        raise ValueError(f"{len(sampled)} sampled tokens for {len(plan.rows)} rows "
                         f"({n_sample} sampling)")
    it = iter(sampled)
    return [next(it) if r.sample else None for r in plan.rows]


def row_tokens(row: ScheduledRow, tokens) -> list[int]:
    """A sampling row's sampled `tokens` (a bare int for one sample slot) as a list of ints,
    one per sample slot (a ValueError otherwise)."""
    tokens = [int(tokens)] if isinstance(tokens, (int, np.integer)) else [int(t) for t in tokens]
    if len(tokens) != row.num_samples:
        raise ValueError(f"{len(tokens)} tokens for {row.num_samples} sample slots")
    return tokens


def accept_drafts(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a row emits: sampled[i] is the token after draft i (sampled[0] after the last
    real token). A draft stands while it equals the token sampled before it; the emitted tokens
    are the accepted drafts plus the next sample (the bonus token). With a one-hot proposal this
    is exact rejection sampling: a draft d is kept with probability p(d), and otherwise the
    sample is drawn from p without d."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return list(sampled[:n + 1])


def stop_reason(req: Request, token: int, eos_token_ids: frozenset,
                length_limit: int) -> FinishReason | None:
    """Why `req` ends at `token`, just appended (None: it goes on)."""
    sp = req.sampling
    n = req.num_output_tokens
    # min_tokens: the output, stop token included, has at least min_tokens tokens (as vLLM).
    if n >= sp.min_tokens:
        if token in eos_token_ids and not sp.ignore_eos:
            return FinishReason.STOP
        if token in sp.stop_token_ids:
            return FinishReason.STOP
    if n >= sp.max_new_tokens or req.num_tokens >= length_limit:
        return FinishReason.LENGTH
    return None


def take_tokens(req: Request, accepted: list[int], advanced: bool, eos_token_ids: frozenset,
                length_limit: int) -> tuple[list[int], FinishReason | None]:
    """`accepted` appended to `req` (in place of its PLACEHOLDER when its step was `advanced`,
    maxjax/engine/in_flight.py) up to the first that ends it: the tokens added, and why it ends
    (None: it goes on)."""
    reason, added = None, []
    for token in accepted:
        if advanced:
            req.fill_placeholder(token)
        else:
            req.append_token(token)
        added.append(token)
        reason = stop_reason(req, token, eos_token_ids, length_limit)
        if reason is not None:
            break
    return added, reason
