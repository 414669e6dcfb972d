"""EngineCore: the synchronous engine. One `step()` = Scheduler.schedule -> ModelRunner.run (a
StepOutput, maxjax/engine/step_io.py) -> Scheduler.update_from_output (the one reader of the
result: StepUpdates) -> OutputProcessor.process, and returns the step's RequestOutputs. Not
thread-safe: the AsyncEngine's loop thread (or LLM.generate) owns it. Embedding requests
(`add_embedding`) ride the same steps as prompts that sample nothing: the runner hands back their
rows' pooled hidden states, folded into the Request by the scheduler after each step.

A fault in a step fails only the requests it can be traced to, and the engine goes on:
  - an exception while building one row's inputs (host side) fails that row's request;
  - when the runner raises and the KV pool is intact (nothing of the step reached it), the step's
    rows run again one at a time, and only those that fail alone fail;
  - when the KV pool was donated into the failed call (or poisoned by it), the requests in that
    call fail, a new pool replaces it, and every other running request goes back to the queue to
    be recomputed (the prefix cache, whose pages are gone with the pool, is emptied).
"""
from __future__ import annotations

import logging
import time

import jax
import numpy as np

from maxjax.engine import compile_counter, kv_events, speculative
from maxjax.engine.block_manager import BlockManager
from maxjax.engine.config import EngineConfig
from maxjax.engine.output import OutputProcessor, final_output
from maxjax.engine.overlap import OverlapLoop
from maxjax.engine.plan import EnginePlan, plan_engine
from maxjax.engine.request import Request, RequestStatus
from maxjax.engine.runner import ModelRunner, RowRequest, RowResult, StepResult
from maxjax.engine.scheduler import Scheduler
from maxjax.engine.state_slots import Snapshots, StateSlots
from maxjax.engine.step_io import ScheduledRow, StepOutput
from maxjax.engine.stats import EngineStats, SpecStats
from maxjax.engine.types import FinishReason, PoolingParams, RequestOutput, SamplingParams
from maxjax.engine.vision import ImageEncoder, image_rows, rope_rows
from maxjax.engine.validate import EngineLimits, check_embedding_input, check_request
from maxjax.errors import RequestError, UserError
from maxjax.graphs.step import RowSlice
from maxjax.structured.backend import backend_for

log = logging.getLogger("maxjax.engine")
# An embedding request's SamplingParams: never sampled (its rows have no sample slot).
EMBEDDING_SAMPLING = SamplingParams(max_new_tokens=1, temperature=0.0)


def make_lora_manager(cfg: EngineConfig, model, items=()):
    """The LoraManager for --enable-lora with the plan's --lora-paths adapters (`items`: (name,
    path), maxjax/engine/plan.py lora_path_items) loaded, else None (UserError for a bad
    adapter)."""
    if not cfg.enable_lora:
        return None
    from maxjax.lora.manager import LoraManager
    manager = LoraManager(model.config, model.compute_dtype, cfg.max_num_loras,
                          cfg.max_lora_rank, cfg.max_cpu_loras)
    for name, path in items:
        try:
            manager.load(name, path, "--lora-paths")
        except RequestError as e:
            raise UserError(f"--lora-paths {name}: {e.reason}") from None
    return manager


class EngineCore:
    def __init__(self, model, plan: EnginePlan | EngineConfig, executables: dict | None = None,
                 kv_init=None, vision_executables: dict | None = None, executor=None,
                 graphs=None, replica: int = 0):
        """`plan`: maxjax/engine/plan.py's (an EngineConfig: planned here); `executables` (per
        bucket) and `kv_init`: loaded for that plan (maxjax/aot/load.py, the compile cache), or
        None to compile them here; `executor`: the runner's (ModelRunner; None: this
        process's own); `vision_executables`: an image-text model's encoder graphs, loaded
        likewise (maxjax/engine/vision.py); `graphs`: where a draft model's graphs come from
        (maxjax/engine/draft.py; None: compiled at warm-up); `replica`: its index among
        --data-parallel-degree replicas (the KV events' data_parallel_rank)."""
        if isinstance(plan, EngineConfig):
            plan = plan_engine(plan, model)
        self.model = model
        self.plan = plan
        self.cfg = cfg = plan.config
        self.layout = lay = plan.layout
        self.max_length = lay.max_length
        self.eos_token_ids = tuple(model.config.eos_token_ids)
        self.lora = make_lora_manager(cfg, model, plan.lora_items)
        self.block_manager = BlockManager(lay.num_pages, lay.page_size, cfg.enable_prefix_caching,
                                          cfg.kv_cache_hash_algo, cfg.kv_cache_hash_seed)
        self.kv_events = kv_events.start(cfg.kv_events_config, self.block_manager, lay.page_size,
                                         replica)
        self.speculator = speculative.build(cfg, lay, model, graphs, plan.draft_tokens, plan)
        n = lay.state_slots - lay.state_snapshots
        self.state_slots = StateSlots(n, 1 + lay.state_spec // cfg.max_batch_size) \
            if lay.state_slots else None
        self.snapshots = Snapshots(n, lay.state_snapshots, self.block_manager) \
            if lay.state_snapshots else None
        self.scheduler = Scheduler(cfg, self.block_manager, lay.max_length, self.eos_token_ids,
                                   self.speculator.k if self.speculator else 0, lora=self.lora,
                                   state_slots=self.state_slots, snapshots=self.snapshots)
        self.runner = ModelRunner(model, lay.buckets, lay.num_pages, lay.page_size,
                                  lay.max_pages_per_row, lay.max_length, executables, kv_init,
                                  self.lora, lay.attention, lay.kv_dtype, lay.mesh, executor,
                                  lay.state_slots, lay.state_dtype, hidden=lay.mtp_layers > 0)
        if self.speculator:
            self.speculator.attach(self.runner)
        self.output = OutputProcessor(model.tokenizer)
        self.images = ImageEncoder(model.vision, vision_executables) if model.vision else None
        self.grammars = backend_for(cfg, model)     # None: structured output off
        # How a step waits out --ce-delay-ms; the AsyncEngine takes commands meanwhile.
        self.sleep = time.sleep
        self._ce_waited = False     # the delay was spent; no other until a prefill batch begins
        # Compilations that happened inside this engine's steps: must stay 0 after warm-up.
        self.step_compiles = 0
        self.grammar_faults = 0     # sampled tokens their grammar refused (a server fault)
        self._priming = None
        self.overlap = OverlapLoop(self) if cfg.enable_overlap_scheduler else None
        # Seconds spent per phase of a step, summed over steps (`maxjax generate --profile`).
        # "detokenize" is the output processing (text, stop strings, logprobs).
        self.profile = {"schedule": 0.0, "build_inputs": 0.0, "device_step": 0.0, "update": 0.0,
                        "detokenize": 0.0, "steps": 0, "tokens": 0}

    # ---- lifecycle ----------------------------------------------------------------------------
    def warmup(self, progress=None) -> None:
        """Compile (or check loaded) every bucket; after this no step compiles."""
        self.runner.compile_all(progress)
        if self.images:
            self.images.compile_all()
            self.images.prime()
        if self.speculator:
            self.speculator.warmup()
        if self.overlap is not None:
            self.runner.compile_feeds()
        self._priming = self.runner.prime_steps()

    @property
    def primed(self) -> bool:
        return self._priming is None

    def prime_next(self) -> bool:
        """Run one dummy step of the executables' first-run priming; False once all have run.
        A failure ends the priming (and replaces the KV pool if it was lost) and is raised."""
        try:
            if self._priming is None or next(self._priming, None) is None:
                self._priming = None
                return False
        except Exception:
            self._priming = None
            if self.kv_lost():
                self.replace_kv()
            raise
        return True

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, grammar=None, lora: str | None = None,
                    images: list | None = None) -> None:
        """Queue a request; RequestError (naming the field) if it breaks a limit. `grammar`:
        its structured_output compiled by `self.grammars` (the server awaits that off the engine
        thread); None: compiled here, blocking. `lora`: the name of a loaded adapter.
        `images`: the ImageInputs (maxjax/models/vision.py) of the prompt's image placeholder
        runs, in order; encoded here."""
        if self.cfg.task == "embeddings_generation":
            raise RequestError("model", "this server runs --task embeddings_generation: it "
                                        "serves /v1/embeddings only")
        check_request(prompt_token_ids, params, self._limits())
        req = Request(request_id, list(prompt_token_ids), params, cache_salt=cache_salt,
                      adapter_id=self._adapter(lora))
        if images:
            if self.images is None:
                raise RequestError("messages", "this model does not read images")
            req.images = self.images.spans(req.prompt_token_ids, images, self.model.config,
                                           self.cfg.max_batch_input_tokens)
            req.rope_positions, req.rope_delta = self.images.rope_positions(
                req.prompt_token_ids, images)
        spec = params.structured_output
        if spec is not None:
            if self.grammars is None:
                raise RequestError(spec.param, "structured output is off on this server "
                                               "(--no-enable-structured-output)")
            req.grammar = self.grammars.new_state(grammar or self.grammars.compiled(spec), spec)
        self.scheduler.add(req)

    def add_embedding(self, request_id: str, prompt_token_ids: list[int],
                      pooling: PoolingParams | str | None = None, lora: str | None = None) -> None:
        """Queue an embedding request: its prompt is prefilled (in chunks, batched with
        everything else) and its one output carries `embedding`, its pooled final hidden
        states. `pooling`: PoolingParams, or a pooling type with the engine's normalization
        (None: --pooling-type / --pool-embeddings). RequestError naming the field."""
        if not isinstance(pooling, PoolingParams):
            pooling = self.default_pooling(pooling)
        check_embedding_input(prompt_token_ids, pooling, self._limits())
        req = Request(request_id, list(prompt_token_ids), EMBEDDING_SAMPLING,
                      adapter_id=self._adapter(lora), pooling=pooling)
        self.scheduler.add(req)

    def default_pooling(self, pooling_type: str | None = None) -> PoolingParams:
        """`pooling_type` (None: --pooling-type, or last with --no-pool-embeddings), normalized
        unless --no-pool-embeddings."""
        if not self.cfg.pool_embeddings:
            return PoolingParams(pooling_type or "last", normalize=False)
        return PoolingParams(pooling_type or self.cfg.pooling_type)

    def _limits(self) -> EngineLimits:
        return EngineLimits(self.model.config.vocab_size, self.max_length, self.eos_token_ids,
                            self.cfg.enable_penalties, self.cfg.enable_min_tokens,
                            getattr(self.model.config, "max_position_embeddings", None))

    def _adapter(self, lora: str | None) -> str | None:
        return None if lora is None else self._lora_manager("model").resolve(lora)

    # ---- LoRA adapters (no compilation: loading writes host memory, swapping a device slot) ----
    def load_lora(self, name: str, path: str) -> None:
        """RequestError naming the field for a bad name or adapter."""
        self._lora_manager("lora_name").load(name, path)

    def unload_lora(self, name: str) -> str:
        """Serve `name` no more: new requests naming it are refused from now; the unfinished
        ones using it run to their end, and then it is gone (`lora_users(uid)` is 0). Its uid."""
        return self._lora_manager("lora_name").unload(name)

    def lora_users(self, uid: str) -> int:
        return 0 if self.lora is None else self.lora.users(uid)

    def _lora_manager(self, param: str):
        if self.lora is None:
            raise RequestError(param, "LoRA is off on this server (--enable-lora)")
        return self.lora

    def lora_names(self) -> list[str]:
        return [] if self.lora is None else self.lora.names()

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
              error: str | None = None) -> RequestOutput | None:
        """End a request now, freeing its pages; its last output (None: unknown or finished)."""
        req = self.scheduler.finish(request_id, reason)
        return None if req is None else final_output(req, reason, error)

    def has_unfinished(self) -> bool:
        """Requests to run, or a step still on the device (the overlap scheduler's)."""
        return self.scheduler.has_unfinished() or bool(self.overlap and self.overlap.pending)

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, take the result in (the scheduler, once), make the outputs. With
        the overlap scheduler: maxjax/engine/overlap.py's step, whose outputs are those of the
        step before the one it leaves on the device."""
        if self.overlap is not None:
            return self.overlap.step()
        plan = self._schedule()
        if plan is None:
            return []
        return self.take(plan, self._run(plan.rows))

    def _schedule(self):
        """The next StepPlan (None: nothing to run), after --ce-delay-ms and the drafts."""
        self._ce_delay()
        t0 = time.perf_counter()
        self._propose()
        plan = self.scheduler.schedule()
        if plan is None or not plan.rows:
            return None
        if plan.num_admitted:
            self._ce_waited = False
        self.profile["schedule"] += time.perf_counter() - t0
        return plan

    def take(self, plan, out: StepOutput, advanced: bool = False) -> list[RequestOutput]:
        """What running `plan` gave, taken in (`advanced`: the overlap scheduler advanced the
        plan while it ran): the scheduler's update, the grammars, the outputs."""
        t1 = time.perf_counter()
        updates = self.scheduler.update_from_output(plan, out, advanced)
        self._advance_grammars(updates)
        t2 = time.perf_counter()
        processed = self.output.process(updates)
        t3 = time.perf_counter()
        for o in processed:
            if o.finished:   # a stop string (or a failure) ends a request the scheduler still runs
                self.scheduler.finish(o.request_id, o.finish_reason)
        if self.speculator:
            self.speculator.observe(plan.rows, out.results, out.bucket, out.device_seconds)
        prof = self.profile
        prof["update"] += t2 - t1 + time.perf_counter() - t3
        prof["detokenize"] += t3 - t2
        prof["steps"] += 1
        prof["tokens"] += plan.num_tokens
        if self.kv_events is not None:
            self.kv_events.flush()
        return out.failed + processed

    def _propose(self) -> None:
        """The speculator's drafts for this step's decodes (none when proposing fails)."""
        if not self.speculator:
            return
        before = compile_counter.count()
        try:
            self.speculator.propose(self.scheduler)
        except Exception:     # the drafts are only a guess: none this step, nothing fails
            log.exception("draft proposal failed: this step verifies no drafts")
            self.speculator.reset(self.scheduler)
        self.step_compiles += compile_counter.count() - before

    def _ce_delay(self) -> None:
        """--ce-delay-ms: wait once before a step that begins a prefill batch, so requests
        arriving meanwhile join it."""
        if self.cfg.ce_delay_ms > 0 and not self._ce_waited and self.scheduler.begins_prefill():
            self._ce_waited = True
            self.sleep(self.cfg.ce_delay_ms / 1000)

    def _row_input(self, row: ScheduledRow) -> RowRequest:
        req = row.request
        rs = RowSlice(row.token_ids, row.start_pos, row.pages, self._next_tokens(row),
                      row.num_samples, req.lora_slot, state_slot=req.state_slot,
                      state_from=row.state_from, state_save=row.state_save,
                      state_keep=row.state_keep)
        if req.images:
            rs.embeds, rs.embed_mask, rs.visible_end = image_rows(req.images, row.start_pos,
                                                                  len(row.token_ids))
        if req.rope_positions is not None:
            rs.rope_positions = rope_rows(req.rope_positions, req.rope_delta, row.start_pos,
                                          len(row.token_ids))
        return RowRequest(rs,
                          req.sampling, req.prompt_token_ids, req.output_token_ids, req.seed,
                          pool=req.is_embedding)

    def _grammar_masks(self, rows: list[ScheduledRow], failed: list) -> dict[int, np.ndarray]:
        """id(row) -> the allow-bits of its next token, for the sampling rows under a grammar
        (filled in one parallel call; unconstrained rows cost nothing). A grammar row samples
        one slot: drafts for it need its matcher's `validate` first. A grammar that allows no
        next token is the request's own ("grammar_error", appended to `failed`)."""
        rows = [r for r in rows if r.sample and r.request.grammar is not None
                and r.request.grammar.mask_needed and r.request.status is RequestStatus.RUNNING]
        if not rows:
            return {}
        t0 = time.perf_counter()
        masks = self.grammars.fill_masks([r.request.grammar for r in rows])
        self.profile["build_inputs"] += time.perf_counter() - t0
        out = {}
        for r, m in zip(rows, masks):
            g = r.request.grammar
            if m.any() and not g.error:
                out[id(r)] = m
                continue
            why = g.error or "no token can continue the output"
            log.warning("request %s: its grammar allows no next token: %s",
                        r.request.request_id, why)
            self.scheduler.finish(r.request.request_id, FinishReason.GRAMMAR_ERROR)
            failed.append(final_output(r.request, FinishReason.GRAMMAR_ERROR,
                                       f"the grammar allows no next token: {why}"))
        return out

    def _advance_grammars(self, updates) -> None:
        """Each constrained request's matcher consumes the tokens its step appended. The token was
        sampled under the matcher's own mask, so one it refuses is a fault of the server (the
        sampler or the grammar engine), never of the request: the request fails ("error")."""
        for u in updates:
            g = u.request.grammar
            if g is not None and not g.accept(u.token_ids) and not u.request.is_finished:
                self.grammar_faults += 1
                u.request.error = (f"server fault: a sampled token ({u.token_ids}) broke the "
                                   f"grammar its mask was made from: {g.error}")
                log.error("request %s: %s", u.request.request_id, u.request.error)
                self.scheduler.finish(u.request.request_id, FinishReason.ERROR)

    @staticmethod
    def _next_tokens(row) -> list[int] | None:
        """For prompt logprobs: the prompt token following each token of the row (-1: none).
        None once the request has output (its prompt logprobs went with the first one)."""
        req = row.request
        if (not req.sampling.prompt_logprobs or req.num_output_tokens
                or row.start_pos >= req.num_prompt_tokens - 1):
            return None
        prompt = req.prompt_token_ids
        return [prompt[p + 1] if p + 1 < len(prompt) else -1
                for p in range(row.start_pos, row.start_pos + len(row.token_ids))]

    def _run(self, rows: list[ScheduledRow]) -> StepOutput:
        """Run the rows: a RowResult per row, None where its request failed (its last output in
        `failed`) or went back to the queue; with --synthetic-acceptance-rate, the samples
        rewritten to keep drafts at that rate."""
        steps: list[StepResult] = []      # each runner call that returned, in order
        inputs, failed = self.inputs(rows)
        got = dict(zip((id(row) for row, _ in inputs), self._execute(inputs, failed, steps)))
        results = [got.get(id(row)) for row in rows]
        if self.speculator:
            self.speculator.verify(rows, results)
        if not steps:
            return StepOutput(results, failed)
        return StepOutput(results, failed, steps[-1].bucket, steps[-1].timing["device_step"])

    def inputs(self, rows: list[ScheduledRow]) -> tuple[list, list[RequestOutput]]:
        """[(row, RowRequest)] of the rows whose inputs were built (grammar masks included),
        and the last outputs of the requests that failed meanwhile."""
        failed: list[RequestOutput] = []
        inputs = []
        try:
            masks = self._grammar_masks(rows, failed)
        except Exception as e:          # a fault of the grammar engine: its rows fail
            masks = {}
            for row in rows:
                if row.request.grammar is not None:
                    failed.append(self.fail(row.request, "filling its grammar mask", e))
        for row in rows:
            if row.request.status is not RequestStatus.RUNNING:
                continue
            try:
                x = self._row_input(row)
                if id(row) in masks:
                    x.token_masks = [masks[id(row)]] + [None] * (row.num_samples - 1)
                inputs.append((row, x))
            except Exception as e:
                failed.append(self.fail(row.request, "building its step inputs", e))
        return inputs, failed

    def _execute(self, inputs: list[tuple], failed: list,
                 steps: list[StepResult]) -> list[RowResult | None]:
        if not inputs:
            return []
        before = compile_counter.count()
        try:
            result = self.runner.run([x for _, x in inputs])
        except Exception as e:
            error = e
        else:
            steps.append(result)
            for k, v in result.timing.items():
                self.profile[k] += v
            return result.rows
        finally:
            self.step_compiles += compile_counter.count() - before
        lost = self.kv_lost()
        if len(inputs) == 1 or lost:
            for row, _ in inputs:
                failed.append(self.fail(row.request, "the model step", error))
            if lost:
                self.replace_kv()
            return [None] * len(inputs)
        # The pool is intact, so nothing of this step reached it: find the rows at fault.
        return [self._execute([x], failed, steps)[0]
                if x[0].request.status is RequestStatus.RUNNING else None for x in inputs]

    def fail(self, req: Request, where: str, error: Exception) -> RequestOutput:
        log.error("request %s failed in %s: %s: %s", req.request_id, where,
                  type(error).__name__, error, exc_info=error)
        self.scheduler.finish(req.request_id, FinishReason.ERROR)
        return final_output(req, FinishReason.ERROR, f"engine step failed in {where}: "
                                                     f"{type(error).__name__}: {error}")

    def kv_lost(self) -> bool:
        """True when the KV pool was donated into a call that failed, or holds its error."""
        leaves = jax.tree.leaves(self.runner.kv)
        if any(a.is_deleted() for a in leaves):
            return True
        try:
            jax.block_until_ready(leaves)
        except Exception:
            return True
        return False

    def replace_kv(self) -> None:
        """A new, zeroed pool; the K/V of every running request and of every cached page went
        with the old one."""
        log.warning("the KV pool was lost in a failed call: recomputing %d running requests",
                    self.scheduler.num_running)
        self.runner.reset_kv()
        self.scheduler.preempt_running()
        self.block_manager.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()

    def stats(self) -> EngineStats:
        phases = {k: v for k, v in self.profile.items() if k not in ("steps", "tokens")}
        return EngineStats(
            scheduler=self.scheduler.stats(), kv=self.block_manager.stats(),
            spec=self.speculator.stats() if self.speculator else SpecStats(),
            steps=self.profile["steps"], xla_compiles=compile_counter.count(),
            xla_compiles_since_ready=self.step_compiles, grammar_faults=self.grammar_faults,
            step_seconds=phases)
