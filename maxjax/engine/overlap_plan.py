"""The plan's part for the overlap scheduler (maxjax/engine/overlap.py): whether it runs. Called
by maxjax/engine/plan.py only (the planner: nothing after the plan decides anything,
tests/test_plan_once.py).

Unset, it is on where it measured faster (BENCHMARKS.md, "The overlap scheduler") and can run;
--enable-overlap-scheduler where it cannot run is a one-line error naming why;
--no-enable-overlap-scheduler is always honoured.
"""
from __future__ import annotations

import logging

import jax

from maxjax.errors import UserError

log = logging.getLogger("maxjax.engine")
# Platforms (export names) where the same-run A/B measured overlap faster: none yet. On the
# 2-core CPU it measured slower (BENCHMARKS.md: the host's work shares the step's cores);
# on a GPU it is not measured yet (tools/bench_offline.py --overlap-ab).
MEASURED_FASTER: frozenset = frozenset()


def overlap_refusal(layout, draft_tokens: int) -> str | None:
    """Why the overlap scheduler cannot run with this layout (None: it can)."""
    if draft_tokens:
        return "speculative decoding verifies step N's drafts before it proposes step N+1's"
    if layout.mesh is not None and layout.mesh.size > 1:
        return "its token feed runs on one device (--devices names several)"
    if jax.process_count() > 1:
        return "a multi-host group sends each step's inputs from the host"
    if layout.state_slots:
        return ("a hybrid model's request-state slots are handed over when a step's results "
                "are taken in")
    return None


def plan_overlap(cfg, layout, draft_tokens: int) -> bool:
    """--enable-overlap-scheduler resolved (one log line saying why it is off, if it is)."""
    why = overlap_refusal(layout, draft_tokens)
    if cfg.enable_overlap_scheduler and why:
        raise UserError(f"--enable-overlap-scheduler: {why}")
    if cfg.enable_overlap_scheduler is False:
        return False
    if why is None and cfg.enable_overlap_scheduler is None \
            and layout.platform not in MEASURED_FASTER:
        why = f"not measured faster on {layout.platform} (--enable-overlap-scheduler turns it on)"
    if why:
        log.info("overlap scheduler off: %s", why)
        return False
    return True
