"""ModelRunner: owns the KV pool and one executable per bucket; turns scheduled rows into tokens.

Each bucket's executable is graphs/program.py's SampledStep (its step graph, then the sampler
graph of its number of sample slots, on the step's logits on the device), so logits never leave
the device: only token ids and logprobs come back, in one transfer (and, in a step with an
embedding row, the rows' pooled hidden states, f32[R, hidden] x 2). The KV pool is donated to
every call and updated in place; it is made by the program's KV initializer graph. Executables
(steps and initializer) come from precompiled artifacts (maxjax/aot/) given to the constructor,
or are compiled here (`compile_all`, and the initializer at construction); `run` never compiles.
The calls go through the runner's executor (maxjax/engine/executor.py): this process's own, or
multi-host process 0's, which makes every process of the group run them.

`run` = `launch` (inputs built, the step queued on the device, nothing waited for) then `collect`
(the one transfer back). The overlap scheduler (maxjax/engine/overlap.py) launches step N+1
before it collects step N: the rows that continue from N take their token from N's sampled
ids on the device (`feed`: a gather, one small graph per token bucket, compiled by
`compile_feeds` before the engine is ready).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import jax
import numpy as np

from maxjax.engine.buckets import Bucket, pick_bucket
from maxjax.engine.executor import LocalExecutor, StepExecutor
from maxjax.engine.types import MAX_TOP_LOGPROBS, SamplingParams
from maxjax.graphs import sampling
from maxjax.graphs.attention import backend_for, backend_named
from maxjax.graphs.program import (GraphSpec, image_embeds, jit_kwargs, kv_init_spec,
                                   sampled_steps, sampler_name, sampler_specs, step_graph_specs)
from maxjax.graphs.step import SCRATCH_PAGE, RowSlice, build_step_inputs

log = logging.getLogger("maxjax.runner")


@dataclass
class RowRequest:
    """One row of a step as the runner needs it: its tokens, and its sample slots (the row's last
    `slice.num_samples` tokens), each with an optional token mask (u32 allow-bits)."""
    slice: RowSlice
    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    seed: int
    token_masks: Sequence[np.ndarray | None] | None = None
    pool: bool = False        # an embedding row: return its pooled hidden states


@dataclass
class Sample:
    token_id: int
    logprob: float
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass
class RowResult:
    samples: list[Sample]     # one per sample slot of the row, in position order
    # Per token of the row with a next prompt token: (logprob, top ids, top logprobs) arrays.
    prompt_logprobs: tuple | None = None
    # For a pooling row: (sum, last) of its tokens' final hidden states in this step, f32[H] each.
    pooled: tuple | None = None

    @property
    def token_ids(self) -> list[int]:
        return [s.token_id for s in self.samples]


@dataclass(frozen=True)
class Launched:
    """A step queued on the device, its outputs not read back yet."""
    rows: list[RowRequest]
    bucket: Bucket
    outputs: tuple            # (SampleOutput, PromptLogprobs, PooledHidden) of device arrays
    build_seconds: float
    t_launch: float


@dataclass(frozen=True)
class StepResult:
    """What one `ModelRunner.run` gives back."""
    rows: list[RowResult]         # one per row given, in order
    bucket: Bucket                # the bucket whose executable ran
    timing: Mapping[str, float]   # seconds: "build_inputs" (host), "device_step" (to results)


def _slots(r: RowRequest) -> list[sampling.SampleSlot]:
    """The row's sample slots. Slot j > 0 follows j draft tokens (the row's tokens after its
    first sampled position): its penalties and min_tokens count them as generated."""
    n, k = len(r.slice.token_ids), r.slice.num_samples
    drafts = list(r.slice.token_ids[n - k + 1:])
    return [sampling.SampleSlot(r.params, r.prompt_ids,
                                [*r.output_ids, *drafts[:j]] if j else r.output_ids, r.seed, 0,
                                r.token_masks[j] if r.token_masks else None)
            for j in range(k)]


class ModelRunner:
    def __init__(self, model, buckets: list[Bucket], num_pages: int, page_size: int,
                 max_pages_per_row: int, history_len: int,
                 executables: dict[Bucket, Callable] | None = None,
                 kv_init: Callable[[], tuple] | None = None, lora=None,
                 attention: str | None = None, kv_dtype: str = "float32", mesh=None,
                 executor: Callable[[LocalExecutor], StepExecutor] | None = None,
                 state_slots: int = 0, state_dtype: str | None = None, hidden: bool = False):
        """`lora`: the LoraManager whose device slots join the params (None: no LoRA);
        `state_slots`, `state_dtype`: a hybrid model's request-state pools (graphs/state.py;
        0: none), each row then passes its slot;
        `attention`: the attention backend's name (None: this platform's); `hidden`: the steps
        keep every slot's hidden state on the device, the last step's in `last_hidden` (the MTP
        draft's input: maxjax/engine/mtp.py);
        `mesh`: the tensor-parallel mesh the model's params are placed on (None: one device);
        `executor`: wraps this process's LocalExecutor into the one every call goes through
        (None: the local one itself; multi-host process 0: distributed.py's LeaderExecutor)."""
        self.model = model
        self.mesh = mesh
        self.lora = lora
        self.cfg = model.config
        self.buckets = sorted(buckets)
        self.page_size = page_size
        self.max_pages = max_pages_per_row
        self.history_len = history_len
        self.num_pages = num_pages
        if kv_init is None:
            spec = kv_init_spec(self.cfg, num_pages, page_size, kv_dtype, mesh, attention,
                                state_slots, state_dtype)
            compiled = jax.jit(spec.fn, **jit_kwargs(spec)).lower().compile()
            kv_init = lambda: compiled()[1]        # noqa: E731
        self.executables: dict[Bucket, Callable] = dict(executables or {})
        local = LocalExecutor(self.buckets, self.executables, kv_init, lambda: self.params)
        self.executor: StepExecutor = executor(local) if executor else local
        self.eos = tuple(self.cfg.eos_token_ids)
        self.attention = backend_named(attention) if attention else backend_for()
        self.embeds = image_embeds(self.cfg, model.params)
        self.mrope = self.cfg.mrope_section is not None
        self.state = state_slots > 0
        self.feeds: dict[int, Callable] = {}     # token bucket T -> its gather (compile_feeds)
        self.widen: dict[int, Callable] = {}     # sample slots S -> padded to the most
        self.hidden = hidden
        self.last_hidden = None      # (rows, [T, H] on the device) of the last step collected

    @property
    def kv(self) -> tuple:
        return self.executor.kv

    def _step(self, bucket: Bucket, step, samp):
        return self.executor.run(self.buckets.index(bucket), step, samp)

    @property
    def params(self) -> dict:
        """What every step executable takes: the model's params, and the LoRA slots if served."""
        if self.lora is None:
            return self.model.params
        return {**self.model.params, "lora": self.lora.device}

    def graph_specs(self) -> list[GraphSpec]:
        """The step graphs of the buckets, then their samplers."""
        return step_graph_specs(self.model.arch, self.cfg, self.params, self.kv, self.buckets,
                                self.max_pages, MAX_TOP_LOGPROBS, self.attention, self.mesh,
                                self.hidden) + \
            sampler_specs(self.cfg, self.buckets, self.history_len, MAX_TOP_LOGPROBS, self.mesh)

    def input_structures(self) -> list:
        """Per bucket, in order, the tree of the (step, samp) inputs `run` gives the executor."""
        args = {s.name: s.args for s in self.graph_specs()}
        return [jax.tree.structure((args[b.name][2], args[sampler_name(b.num_samples)][1]))
                for b in self.buckets]

    def compile_all(self, progress: Callable[[int, int, str], None] | None = None) -> None:
        missing = [b for b in self.buckets if b not in self.executables]
        names = {b.name for b in missing} | {sampler_name(b.num_samples) for b in missing}
        specs = [s for s in self.graph_specs() if s.name in names]
        built = {}
        for i, spec in enumerate(specs):
            t0 = time.perf_counter()
            built[spec.name] = jax.jit(spec.fn, **jit_kwargs(spec)).lower(*spec.args).compile()
            log.debug("compiled %s in %.2fs", spec.name, time.perf_counter() - t0)
            if progress:
                progress(i + 1, len(specs), spec.name)
        self.executables.update(sampled_steps(missing, built))

    def reset_kv(self) -> None:
        """A new zero pool (the old one was lost in a failed call)."""
        self.executor.init_kv()

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
            step = build_step_inputs(rows, b.num_tokens, b.num_rows, self.max_pages, self.page_size,
                                     b.num_samples, self.attention, self.lora is not None,
                                     self.embeds, mrope=self.mrope, state=self.state)
            for params in (greedy, sampled):
                samp = sampling.build_sampling_arrays([(params, [0], [], 0)] * b.num_samples,
                                                      b.num_samples, self.history_len, self.eos,
                                                      self.cfg.vocab_size)
                jax.block_until_ready(self._step(b, step, samp))
                yield b

    def compile_feeds(self) -> None:
        """The overlap scheduler's graphs: per sample-slot count S, N's sampled ids padded to
        the most slots; per token bucket T, step N+1's token ids with N's gathered in."""
        pool = jax.tree.leaves(self.kv)[0].sharding
        if len(pool.device_set) != 1:
            raise ValueError("the overlap scheduler feeds tokens on one device")
        dev = jax.sharding.SingleDeviceSharding(next(iter(pool.device_set)))
        top = max(b.num_samples for b in self.buckets)

        def spec(n):
            return jax.ShapeDtypeStruct((n,), np.int32, sharding=dev)

        for S in sorted({b.num_samples for b in self.buckets} - {top}):
            self.widen[S] = jax.jit(lambda x: jax.numpy.pad(x, (0, top - x.shape[0]))).lower(
                spec(S)).compile()
        for T in sorted({b.num_tokens for b in self.buckets}):
            self.feeds[T] = jax.jit(_feed).lower(spec(top), spec(T), spec(T)).compile()

    def run(self, rows: list[RowRequest]) -> StepResult:
        return self.collect(self.launch(rows))

    def launch(self, rows: list[RowRequest], feed: tuple[Launched, list] | None = None
               ) -> Launched:
        """Queue the step of `rows` on the device. `feed`: (the launched step N, per row the
        index of N's sample slot whose token is the row's first token, or None): those tokens
        are taken from N's outputs on the device."""
        t0 = time.perf_counter()
        num_tokens = sum(len(r.slice.token_ids) for r in rows)
        slots = [slot for r in rows for slot in _slots(r)]
        bucket = pick_bucket(self.buckets, num_tokens, len(rows), len(slots))
        step = build_step_inputs([r.slice for r in rows], bucket.num_tokens, bucket.num_rows,
                                 self.max_pages, self.page_size, bucket.num_samples, self.attention,
                                 self.lora is not None, self.embeds, mrope=self.mrope,
                                 state=self.state)
        samp = sampling.build_sampling_arrays(slots, bucket.num_samples, self.history_len, self.eos,
                                              self.cfg.vocab_size)
        if feed is not None:
            step.token_ids = self._fed(bucket, rows, step.token_ids, *feed)
        t1 = time.perf_counter()
        return Launched(rows, bucket, tuple(self._step(bucket, step, samp)), t1 - t0, t1)

    def _fed(self, bucket: Bucket, rows: list[RowRequest], token_ids, prev: Launched, src):
        """`token_ids` (numpy) with the tokens `src` names taken from `prev`'s sampled ids."""
        where = np.full(bucket.num_tokens, -1, np.int32)
        t = 0
        for r, s in zip(rows, src):
            if s is not None:
                where[t] = s
            t += len(r.slice.token_ids)
        prev_ids = prev.outputs[0].token_ids
        widen = self.widen.get(prev_ids.shape[0])
        return self.feeds[bucket.num_tokens](widen(prev_ids) if widen else prev_ids,
                                             token_ids, where)

    def collect(self, launched: Launched) -> StepResult:
        """Wait for a launched step and read its results back (one transfer)."""
        rows, bucket, (out, plp, pooled) = launched.rows, launched.bucket, launched.outputs
        t1 = launched.t_launch
        want_prompt = any(r.slice.next_tokens is not None for r in rows)
        token_ids, logprobs, top_ids, top_lps = jax.device_get(tuple(out))
        plp = jax.device_get(tuple(plp)) if want_prompt else None
        if self.hidden:
            self.last_hidden = (rows, pooled.hidden)
        pooled = jax.device_get(tuple(pooled)[:2]) if any(r.pool for r in rows) else None
        timing = {"build_inputs": launched.build_seconds, "device_step": time.perf_counter() - t1}
        results, t, s = [], 0, 0
        for j, r in enumerate(rows):
            n, k = len(r.slice.token_ids), r.slice.num_samples
            prompt = None
            if plp is not None and r.slice.next_tokens is not None:
                prompt = tuple(a[t:t + n] for a in plp)
            results.append(RowResult([Sample(int(token_ids[i]), float(logprobs[i]), top_ids[i],
                                             top_lps[i]) for i in range(s, s + k)], prompt,
                                     (pooled[0][j], pooled[1][j]) if r.pool else None))
            t, s = t + n, s + k
        return StepResult(results, bucket, timing)


def _feed(prev_ids, token_ids, src):
    return jax.numpy.where(src >= 0, prev_ids[jax.numpy.maximum(src, 0)], token_ids)
