"""A step's budgets and what of a request fits them, for the Scheduler (maxjax/engine/scheduler.py),
which decides the order of the work and what to preempt: `StepBudget` (a step being planned: the
tokens left of --max-batch-input-tokens, the page-aligned context left of
--max-batch-total-tokens, its rows so far), `prefill_chunk` (how much of a prefill runs in a
step), `fitting_drafts` (how many of a request's drafts it verifies) and `check_fits` (whether
a request could ever run: Scheduler.add).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from maxjax.engine.config import EngineConfig
from maxjax.engine.request import Request
from maxjax.engine.step_io import ScheduledRow
from maxjax.engine.vision import chunk_end
from maxjax.errors import RequestError


@dataclass
class StepBudget:
    """A step being planned: what is left of its budgets and what it holds so far."""
    budget: int                  # tokens left (max_batch_input_tokens)
    total_left: int | None       # page-aligned context left (max_batch_total_tokens)
    page_size: int
    rows: list[ScheduledRow] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)
    preempted: list[Request] = field(default_factory=list)
    num_decode: int = 0
    num_admitted: int = 0

    def room(self, start: int) -> int:
        """Tokens a row whose computed part is `start` tokens may compute in this step: the
        step's token budget, and its page-aligned context budget."""
        if self.total_left is None:
            return self.budget
        ps = self.page_size
        return min(self.budget, self.total_left // ps * ps - start)

    def add(self, row: ScheduledRow) -> None:
        self.rows.append(row)
        self.scheduled.add(row.request.request_id)
        self.budget -= len(row.token_ids)
        if self.total_left is not None:
            end = row.start_pos + len(row.token_ids)
            self.total_left -= -(-end // self.page_size) * self.page_size


def prefill_chunk(cfg: EngineConfig, req: Request, budget: int, remaining: int) -> int:
    """Tokens of `remaining` to prefill within `budget`: all of them, or a chunk such that the
    chunk and what is left are both >= the min chunk size (when the rest allows), or 0."""
    if remaining <= budget:
        return remaining
    # Chunking off means a prompt only goes in whole; a preempted sequence longer than any
    # step must still be split to be recomputed.
    if not cfg.enable_chunked_prefill and remaining <= cfg.max_batch_input_tokens:
        return 0
    m = max(1, cfg.chunked_prefill_min_chunk_size)
    chunk = budget if remaining < 2 * m else min(budget, remaining - m)
    if chunk < m:
        return 0
    if req.images:           # an image attended both ways is computed in one chunk
        start = req.num_tokens - remaining
        return max(0, chunk_end(req.images, start, start + chunk) - start)
    return chunk


def fitting_drafts(req: Request, budget: int, max_draft_tokens: int,
                   max_length: int) -> list[int]:
    """The request's draft tokens that fit: the step's `budget`, the model's length (the
    last draft's position must fit a page row) and what the request may still generate."""
    if req.is_embedding:
        return []
    room = min(max_draft_tokens, budget - 1, max_length - 1 - req.num_tokens,
               req.sampling.max_new_tokens - req.num_output_tokens - 1)
    return list(req.draft_token_ids[:max(0, room)])


def check_fits(cfg: EngineConfig, bm, req: Request, length_limit: int) -> None:
    """A RequestError if the engine's resources (`bm`: the BlockManager) could never run `req`
    up to its final length (`length_limit`: the most tokens a request may reach)."""
    n = req.num_tokens
    if not cfg.enable_chunked_prefill and n > cfg.max_batch_input_tokens:
        raise RequestError("prompt", f"{n} tokens, more than max_batch_input_tokens "
                                     f"{cfg.max_batch_input_tokens}, and chunked "
                                     "prefill is off")
    total = cfg.max_batch_total_tokens
    if total is not None and bm.pages_for(n) * bm.page_size > total:
        raise RequestError("prompt", f"{n} tokens fill {bm.pages_for(n)} KV pages of "
                                     f"{bm.page_size}, more than --max-batch-total-tokens "
                                     f"{total}")
    final = min(n + req.sampling.max_new_tokens - req.num_output_tokens, length_limit)
    # The last sampled token is never fed back, so the cache holds at most final - 1 tokens
    # (an embedding request samples none: its prompt is all it holds).
    need = bm.pages_for(n if req.is_embedding else final - 1)
    if need > bm.num_usable_pages:
        too_long = bm.pages_for(n) > bm.num_usable_pages
        raise RequestError("prompt" if too_long else "max_new_tokens",
                           f"the request needs up to {need} KV pages ({final - 1} tokens) "
                           f"but the pool has {bm.num_usable_pages}")
