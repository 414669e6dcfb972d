"""ModelRunner: owns the KV pool and one executable per bucket; turns scheduled rows into tokens.

Each bucket's executable is the model step fused with on-device sampling, so logits never leave
the device: only token ids and logprobs come back, in one transfer. The KV pool is donated to
every call and updated in place. Executables come from `compile_all` (jit + lower + compile) or
from precompiled artifacts (maxjax/aot/) through `set_executables`; `run` never compiles.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.engine import sampling
from maxjax.engine.buckets import Bucket, pick_bucket
from maxjax.engine.types import MAX_TOP_LOGPROBS, SamplingParams
from maxjax.graphs.decoder import init_kv
from maxjax.graphs.step import SCRATCH_PAGE, RowSlice, build_step_inputs, step_input_specs

log = logging.getLogger("maxjax.runner")


@dataclass
class RowRequest:
    """One row of a step as the runner needs it."""
    slice: RowSlice
    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    seed: int


@dataclass
class RowResult:
    token_id: int
    logprob: float
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    # Per token of the row with a next prompt token: (logprob, top ids, top logprobs) arrays.
    prompt_logprobs: tuple | None = None


class PromptLogprobs(NamedTuple):
    logprobs: jax.Array       # f32[T]: logprob of step.next_token after each slot
    top_ids: jax.Array        # i32[T, K]
    top_logprobs: jax.Array   # f32[T, K]


@dataclass(frozen=True)
class GraphSpec:
    """Everything needed to trace, export or compile one graph, without running it."""
    name: str
    bucket: Bucket
    fn: Callable
    args: tuple          # pytree of jax.ShapeDtypeStruct
    donate_argnums: tuple


def step_and_sample(arch, cfg, params, kv, step, samp):
    """The compiled step: model, sampling, and (only in steps that ask) prompt logprobs."""
    if arch.hidden_states is None:
        logits, kv = arch.forward(cfg, params, kv, step)
        return (sampling._sample(logits, samp, MAX_TOP_LOGPROBS), _no_prompt_logprobs(step)), kv
    h, kv = arch.hidden_states(cfg, params, kv, step)
    out = sampling._sample(arch.lm_logits(cfg, params, h[step.sample_idx]), samp, MAX_TOP_LOGPROBS)

    def prompt_lps(h):
        lps = sampling._prompt_logprobs(arch.lm_logits(cfg, params, h),
                                        jnp.maximum(step.next_token, 0), MAX_TOP_LOGPROBS)
        return PromptLogprobs(*lps)

    plp = jax.lax.cond(jnp.any(step.next_token >= 0), prompt_lps,
                       lambda h: _no_prompt_logprobs(step), h)
    return (out, plp), kv


def _no_prompt_logprobs(step) -> PromptLogprobs:
    return PromptLogprobs(*sampling.no_logprobs(step.token_ids.shape[0], MAX_TOP_LOGPROBS))


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


class ModelRunner:
    def __init__(self, model, buckets: list[Bucket], num_pages: int, page_size: int,
                 max_pages_per_row: int, history_len: int):
        self.model = model
        self.cfg = model.config
        self.buckets = sorted(buckets)
        self.page_size = page_size
        self.max_pages = max_pages_per_row
        self.history_len = history_len
        self.num_pages = num_pages
        self.kv = init_kv(self.cfg, num_pages, page_size, model.params["embed"].dtype)
        self.executables: dict[Bucket, Callable] = {}
        self.eos = tuple(self.cfg.eos_token_ids)
        self.last_timing: dict[str, float] = {}

    def graph_specs(self) -> list[GraphSpec]:
        fn = partial(step_and_sample, self.model.arch, self.cfg)
        params, kv = _abstract(self.model.params), _abstract(self.kv)
        specs = []
        for b in self.buckets:
            step = step_input_specs(b.num_tokens, b.num_rows, self.max_pages)
            samp = _abstract(sampling.build_sampling_arrays([], b.num_rows, self.history_len))
            specs.append(GraphSpec(b.name, b, fn, (params, kv, step, samp), (1,)))
        return specs

    def compile_all(self, progress: Callable[[int, int, str], None] | None = None) -> None:
        specs = self.graph_specs()
        for i, spec in enumerate(specs):
            if spec.bucket in self.executables:
                continue
            t0 = time.perf_counter()
            self.executables[spec.bucket] = jax.jit(
                spec.fn, donate_argnums=spec.donate_argnums).lower(*spec.args).compile()
            log.debug("compiled %s in %.2fs", spec.name, time.perf_counter() - t0)
            if progress:
                progress(i + 1, len(specs), spec.name)

    def set_executables(self, executables: dict[Bucket, Callable]) -> None:
        self.executables.update(executables)

    def prime_steps(self):
        """Run every executable on a dummy step, greedy then sampled, one per iteration, its K/V
        in the scratch page: on the CPU the first run of an executable (and of each branch it
        takes) costs 0.1-0.3 s more than the next ones. The server runs these while idle, so
        the first requests do not pay it."""
        greedy = SamplingParams(temperature=0.0)
        sampled = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, logprobs=True)
        for b in self.buckets:
            n = min(b.num_tokens - b.num_rows + 1, self.max_pages * self.page_size)
            rows = [RowSlice([0] * n, 0, [SCRATCH_PAGE] * -(-n // self.page_size))] + [
                RowSlice([0], 0, [SCRATCH_PAGE]) for _ in range(b.num_rows - 1)]
            step = build_step_inputs(rows, b.num_tokens, b.num_rows, self.max_pages, self.page_size)
            for params in (greedy, sampled):
                samp = sampling.build_sampling_arrays([(params, [0], [], 0)] * b.num_rows, b.num_rows,
                                                      self.history_len, self.eos)
                out, self.kv = self.executables[b](self.model.params, self.kv, step, samp)
                jax.block_until_ready(out)
                yield b

    def run(self, rows: list[RowRequest]) -> list[RowResult]:
        t0 = time.perf_counter()
        num_tokens = sum(len(r.slice.token_ids) for r in rows)
        bucket = pick_bucket(self.buckets, num_tokens, len(rows))
        step = build_step_inputs([r.slice for r in rows], bucket.num_tokens, bucket.num_rows,
                                 self.max_pages, self.page_size)
        samp = sampling.build_sampling_arrays(
            [(r.params, r.prompt_ids, r.output_ids, r.seed) for r in rows], bucket.num_rows,
            self.history_len, self.eos)
        t1 = time.perf_counter()
        (out, plp), self.kv = self.executables[bucket](self.model.params, self.kv, step, samp)
        want_prompt = any(r.slice.next_tokens is not None for r in rows)
        token_ids, logprobs, top_ids, top_lps = jax.device_get(tuple(out))
        plp = jax.device_get(tuple(plp)) if want_prompt else None
        self.last_timing = {"build_inputs": t1 - t0, "device_step": time.perf_counter() - t1}
        results, t = [], 0
        for i, r in enumerate(rows):
            n = len(r.slice.token_ids)
            prompt = None
            if plp is not None and r.slice.next_tokens is not None:
                prompt = tuple(a[t:t + n] for a in plp)
            results.append(RowResult(int(token_ids[i]), float(logprobs[i]), top_ids[i], top_lps[i],
                                     prompt))
            t += n
        return results
