"""EngineCore: the synchronous engine. One `step()` = Scheduler.schedule -> ModelRunner.run ->
Scheduler.update. Not thread-safe: the AsyncEngine's loop thread (or LLM.generate) owns it.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import jax
import numpy as np

from maxjax.engine import compile_counter
from maxjax.engine.block_manager import BlockManager
from maxjax.engine.buckets import bucket_set
from maxjax.engine.config import EngineConfig
from maxjax.engine.request import Request, RequestStatus, new_seed
from maxjax.engine.runner import ModelRunner, RowRequest
from maxjax.engine.scheduler import Scheduler
from maxjax.engine.types import SamplingParams, TokenLogprob
from maxjax.engine.validate import EngineLimits, check_request
from maxjax.errors import UserError
from maxjax.graphs.step import RowSlice

log = logging.getLogger("maxjax.engine")
DEFAULT_MAX_LENGTH_CAP = 4096


@dataclass
class TokenEvent:
    """What one step produced for one request."""
    request_id: str
    token_id: int
    logprob: TokenLogprob | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_logprobs: list | None = None   # with the first token, when asked for


@dataclass
class EngineLayout:
    """Sizes derived from the config and the machine; pinned in artifacts."""
    max_length: int
    page_size: int
    num_pages: int
    max_pages_per_row: int
    buckets: list = field(default_factory=list)


def resolve_max_length(cfg: EngineConfig, model_cfg) -> int:
    limit = model_cfg.max_position_embeddings
    if cfg.max_length is None:
        return min(limit, DEFAULT_MAX_LENGTH_CAP)
    if cfg.max_length < 2:
        raise UserError(f"--max-length must be >= 2 (got {cfg.max_length})")
    return cfg.max_length


def _available_bytes() -> int:
    dev = jax.devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def plan_layout(cfg: EngineConfig, model) -> EngineLayout:
    mc = model.config
    if cfg.kv_cache_page_size < 1:
        raise UserError(f"--kv-cache-page-size must be >= 1 (got {cfg.kv_cache_page_size})")
    if cfg.max_batch_size < 1 or cfg.max_batch_input_tokens < 1:
        raise UserError("--max-batch-size and --max-batch-input-tokens must be >= 1")
    max_length = resolve_max_length(cfg, mc)
    page = cfg.kv_cache_page_size
    per_row = math.ceil(max_length / page)
    if cfg.num_kv_pages is not None:
        num_pages = cfg.num_kv_pages
    else:
        itemsize = np.dtype(model.params["embed"].dtype).itemsize
        page_bytes = 2 * mc.num_layers * page * mc.num_kv_heads * mc.head_dim * itemsize
        budget = int(_available_bytes() * cfg.device_memory_utilization)
        # No more than every row at max_length could use, plus the scratch page.
        num_pages = min(budget // page_bytes, cfg.max_batch_size * per_row + 1)
    if num_pages < 2:
        raise UserError(f"the KV pool would have {num_pages} pages; it needs at least 2 "
                        "(raise --device-memory-utilization or set --num-kv-pages)")
    buckets = bucket_set(cfg.max_batch_input_tokens, cfg.max_batch_size)
    return EngineLayout(max_length, page, int(num_pages), per_row, buckets)


class EngineCore:
    def __init__(self, model, cfg: EngineConfig, layout: EngineLayout | None = None):
        compile_counter.install()
        self.model = model
        self.cfg = cfg
        self.layout = layout or plan_layout(cfg, model)
        lay = self.layout
        self.max_length = lay.max_length
        self.eos_token_ids = tuple(model.config.eos_token_ids)
        self.block_manager = BlockManager(lay.num_pages, lay.page_size, cfg.enable_prefix_caching,
                                          cfg.kv_cache_hash_algo, cfg.kv_cache_hash_seed)
        self.scheduler = Scheduler(cfg, self.block_manager, lay.max_length, self.eos_token_ids)
        self.runner = ModelRunner(model, lay.buckets, lay.num_pages, lay.page_size,
                                  lay.max_pages_per_row, lay.max_length)
        self.seeds: dict[str, int] = {}
        self.prompt_lps: dict[str, dict[int, TokenLogprob]] = {}   # request -> position -> logprob
        # Compilations that happened inside this engine's steps: must stay 0 after warm-up.
        self.step_compiles = 0
        self._priming = None
        # Seconds spent per phase of a step, summed over steps (`maxjax generate --profile`).
        self.profile = {"schedule": 0.0, "build_inputs": 0.0, "device_step": 0.0, "update": 0.0,
                        "steps": 0, "tokens": 0}

    # ---- lifecycle ----------------------------------------------------------------------------
    def warmup(self, progress=None) -> None:
        """Compile (or check loaded) every bucket; after this no step compiles."""
        self.runner.compile_all(progress)
        self._priming = self.runner.prime_steps()

    @property
    def primed(self) -> bool:
        return self._priming is None

    def prime_next(self) -> bool:
        """Run one dummy step of the executables' first-run priming; False once all have run."""
        if self._priming is None or next(self._priming, None) is None:
            self._priming = None
            return False
        return True

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None) -> None:
        """Queue a request; RequestError (naming the field) if it breaks a limit."""
        check_request(prompt_token_ids, params,
                      EngineLimits(self.model.config.vocab_size, self.max_length,
                                   self.eos_token_ids))
        req = Request(request_id, list(prompt_token_ids), params, cache_salt=cache_salt)
        self.scheduler.add(req)
        self.seeds[request_id] = params.seed if params.seed is not None else new_seed()

    def abort(self, request_id: str, reason: str = "abort") -> bool:
        self.seeds.pop(request_id, None)
        self.prompt_lps.pop(request_id, None)
        return self.scheduler.finish(request_id, reason) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None or not plan.rows:
            return []
        t_sched = time.perf_counter() - t0
        rows = [RowRequest(RowSlice(r.token_ids, r.start_pos, r.pages, self._next_tokens(r),
                                    r.num_samples),
                           r.request.sampling, r.request.prompt_token_ids,
                           r.request.output_token_ids, self.seeds[r.request.request_id])
                for r in plan.rows]
        before = compile_counter.count()
        results = self.runner.run(rows)
        self.step_compiles += compile_counter.count() - before
        for row, res in zip(plan.rows, results):
            if res.prompt_logprobs is not None:
                self._keep_prompt_logprobs(row, res.prompt_logprobs)
        t1 = time.perf_counter()
        updates = self.scheduler.update(plan, [res.token_ids for res in results])
        by_req = {row.request.request_id: res for row, res in zip(plan.rows, results) if row.sample}
        events = []
        for u in updates:
            req, res = u.request, by_req[u.request.request_id]
            done = req.status is RequestStatus.FINISHED
            if done:
                self.seeds.pop(req.request_id, None)
            n_before = req.num_output_tokens - len(u.token_ids)
            for j, (token, smp) in enumerate(zip(u.token_ids, res.samples)):
                lp = None
                if req.sampling.logprobs:
                    k = req.sampling.top_logprobs
                    lp = TokenLogprob(token, smp.logprob, [(int(i), float(v)) for i, v in
                                                           zip(smp.top_ids[:k], smp.top_logprobs[:k])])
                plps = None
                if req.sampling.prompt_logprobs and n_before + j == 0:
                    got = self.prompt_lps.pop(req.request_id, {})
                    plps = [None] + [got.get(i) for i in range(1, req.num_prompt_tokens)]
                last = j == len(u.token_ids) - 1
                events.append(TokenEvent(req.request_id, token, lp, done and last,
                                         req.finish_reason if last else None,
                                         req.num_prompt_tokens, n_before + j + 1,
                                         req.num_cached_tokens, plps))
        prof = self.profile
        prof["schedule"] += t_sched
        for k, v in self.runner.last_timing.items():
            prof[k] += v
        prof["update"] += time.perf_counter() - t1
        prof["steps"] += 1
        prof["tokens"] += plan.num_tokens
        return events

    @staticmethod
    def _next_tokens(row) -> list[int] | None:
        """For prompt logprobs: the prompt token following each token of the row (-1: none)."""
        req = row.request
        if not req.sampling.prompt_logprobs or row.start_pos >= req.num_prompt_tokens - 1:
            return None
        prompt = req.prompt_token_ids
        return [prompt[p + 1] if p + 1 < len(prompt) else -1
                for p in range(row.start_pos, row.start_pos + len(row.token_ids))]

    def _keep_prompt_logprobs(self, row, plp) -> None:
        lps, top_ids, top_lps = plp
        k = row.request.sampling.top_logprobs
        prompt = row.request.prompt_token_ids
        kept = self.prompt_lps.setdefault(row.request.request_id, {})
        for i in range(len(row.token_ids)):
            pos = row.start_pos + i + 1
            if pos < len(prompt):
                kept[pos] = TokenLogprob(prompt[pos], float(lps[i]),
                                         [(int(a), float(b)) for a, b in zip(top_ids[i][:k], top_lps[i][:k])])

    def stats(self) -> dict:
        s = self.scheduler.stats()
        s["xla_compiles"] = compile_counter.count()
        s["xla_compiles_since_ready"] = self.step_compiles
        s["steps"] = self.profile["steps"]
        s["step_seconds"] = {k: v for k, v in self.profile.items() if k not in ("steps", "tokens")}
        return s
