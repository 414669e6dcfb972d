"""Which kinds of work the next step may hold: the `max serve` step-composition knobs
(--enable-in-flight-batching, --enable-prioritize-first-decode, --max-queue-size-tg,
--min-batch-size-tg, --prefill-coalesce-*, --prefill-schedule-interval) and the checks of every
flag of that block of EngineConfig (`check_flags`). The Scheduler asks `kinds()` once per step and
reports what the step did with `done()`; the token caps (--max-batch-total-tokens,
--max-request-input-tokens) are applied by the Scheduler row by row.

A step may hold decodes (TG), further chunks of running prefills, and admissions of waiting
requests (together CE). With every default a step holds all three, as far as the budgets allow.
"""
from __future__ import annotations

from dataclasses import dataclass

from maxjax.errors import UserError


@dataclass(frozen=True)
class StepKinds:
    decode: bool = True      # running decodes
    prefill: bool = True     # next chunks of running prefills
    admit: bool = True       # waiting requests admitted
    held: bool = False       # the coalescing gate holds the queue back this step


ALL = StepKinds()


def _at_least(name: str, value, low: int) -> None:
    if value is not None and value < low:
        raise UserError(f"--{name.replace('_', '-')} {value}: must be >= {low}")


def check_flags(cfg) -> None:
    """One-line UserError for a value of the block that cannot be served (start-up, before the
    model loads)."""
    for name, low in (("max_request_input_tokens", 0), ("max_queue_size_tg", 1),
                      ("min_batch_size_tg", 0), ("prefill_coalesce_min_pending", 0),
                      ("prefill_coalesce_max_held_steps", 0), ("prefill_schedule_interval", 1)):
        _at_least(name, getattr(cfg, name), low)
    if not cfg.ce_delay_ms >= 0:
        raise UserError(f"--ce-delay-ms {cfg.ce_delay_ms}: must be >= 0")
    page = cfg.kv_cache_page_size
    if cfg.max_batch_total_tokens is not None and cfg.max_batch_total_tokens < page:
        raise UserError(f"--max-batch-total-tokens {cfg.max_batch_total_tokens}: less than one "
                        f"KV page (--kv-cache-page-size {page}), no row would fit")
    n = cfg.max_request_input_tokens
    if n and not cfg.enable_chunked_prefill:
        raise UserError(f"--max-request-input-tokens {n}: requires chunked prefill "
                        "(drop --no-enable-chunked-prefill, or use 0)")
    if n and n < cfg.chunked_prefill_min_chunk_size:
        raise UserError(f"--max-request-input-tokens {n}: below --chunked-prefill-min-chunk-size "
                        f"{cfg.chunked_prefill_min_chunk_size}, a long prompt could never be "
                        "chunked")
    if cfg.max_queue_size_tg is not None and cfg.max_batch_size is not None and \
            cfg.max_queue_size_tg > cfg.max_batch_size:
        raise UserError(f"--max-queue-size-tg {cfg.max_queue_size_tg}: more than --max-batch-size "
                        f"{cfg.max_batch_size}; every decoding request holds a row of each step "
                        f"here (supported: 1..{cfg.max_batch_size})")


class StepPolicy:
    def __init__(self, cfg):
        self.cfg = cfg
        self.tg_cap = min(cfg.max_queue_size_tg or cfg.max_batch_size, cfg.max_batch_size)
        self.tg_floor = self.tg_cap if cfg.min_batch_size_tg is None else cfg.min_batch_size_tg
        self.hold_limit = cfg.prefill_coalesce_max_held_steps or cfg.prefill_coalesce_min_pending
        self.held_steps = 0            # consecutive steps the coalescing gate held the queue
        self.first_decodes = False     # the last step was CE and finished some prompts

    def _released(self, waiting) -> bool:
        """The coalescing gate: queued fresh prompts go once enough are queued or the oldest has
        been held long enough; a preempted request (not fresh) goes at once."""
        n = self.cfg.prefill_coalesce_min_pending
        if n == 0 or waiting[0].admitted or len(waiting) >= n:
            return True
        return self.held_steps >= self.hold_limit

    def kinds(self, step_index: int, num_decoding: int, num_partial: int, waiting,
              num_running: int) -> StepKinds:
        """What the step `step_index` (0-based) may hold. With no decode work, everything."""
        if num_decoding == 0:
            return ALL
        prefill = step_index % self.cfg.prefill_schedule_interval == 0
        admit = prefill and bool(waiting) and num_running < self.tg_cap and \
            num_decoding < self.tg_floor
        held = admit and not self._released(waiting)
        admit = admit and not held
        if self.cfg.enable_in_flight_batching:
            return StepKinds(True, prefill, admit, held)
        ce = (prefill and num_partial > 0) or admit
        if not ce or (self.cfg.enable_prioritize_first_decode and self.first_decodes) or \
                num_decoding >= self.tg_floor:
            return StepKinds(True, False, False, held)
        return StepKinds(False, True, admit, held)

    def done(self, kinds: StepKinds, num_decode_rows: int, num_admitted: int,
             finished_prompts: bool) -> None:
        """What the step planned with `kinds` holds: decode rows, requests admitted, prompts
        finished."""
        if num_admitted:
            self.held_steps = 0
        elif kinds.held:
            self.held_steps += 1
        self.first_decodes = num_decode_rows == 0 and finished_prompts
