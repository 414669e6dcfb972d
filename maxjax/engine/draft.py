"""Draft-model proposals for speculative decoding (`--speculative-method draft`): a second,
usually smaller model with the target's vocabulary drafts k tokens greedily for each row.

The draft keeps its own paged KV cache (its own BlockManager and ModelRunner, with the plain
one-slot-per-row buckets of the engine's token budget: maxjax/engine/plan.py `draft_plan`; its graphs come from the
artifacts' draft/ directory or the compile cache, as the engine's builder says, else they compile
at warm-up), holding for each
request the tokens it has seen: `Request.draft_state` is the request's sequence in the draft's
pool (a Request of that pool: pages, num_computed_tokens). Per step, for the rows the speculator
asks about: feed each request's tokens the draft has not seen (the last accepted ones, or all of
them the first time, in chunks within the budget), sample d1, then k-1 one-token steps batched
over the rows give d2..dk. What a verification rejects is rolled back lazily: the next call keeps
the draft's tokens only up to where they still equal the request's. The target's preemption does
not touch the draft's cache; a finished request's draft pages are freed on the next call.
"""
from __future__ import annotations

import logging

import jax

from maxjax.engine.block_manager import BlockManager
from maxjax.engine.plan import EnginePlan, draft_plan
from maxjax.engine.request import Request
from maxjax.engine.runner import ModelRunner, RowRequest
from maxjax.engine.types import SamplingParams
from maxjax.errors import UserError
from maxjax.graphs.state import request_state_of
from maxjax.graphs.step import RowSlice

log = logging.getLogger("maxjax.engine")
_GREEDY = SamplingParams(temperature=0.0)
_PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def load_draft(cfg, target, max_length: int | None = None, platform: str | None = None):
    """The draft LoadedModel, loaded from the draft's ModelSource (--draft-* flags) in the
    planner's encoding for it (maxjax/engine/encoding.py draft_encoding, on `platform`, the
    target's: None this machine's), its params on --draft-devices (default: --devices);
    UserError if it cannot draft for `target` of `max_length` (--draft-max-length below it)."""
    from maxjax.engine.encoding import draft_encoding
    from maxjax.engine.plan import local_platform
    from maxjax.models.loader import load_model, read_checkpoint
    if cfg.draft_max_length is not None and max_length and cfg.draft_max_length < max_length:
        raise UserError(f"--draft-max-length {cfg.draft_max_length}: must be >= the target's max "
                        f"length ({max_length}): the draft sees every position the target does")
    mesh = draft_mesh(cfg)
    header = read_checkpoint(cfg.draft_source(), cfg.draft_quantization_encoding)
    encoding = draft_encoding(cfg, target.dtype, header, platform or local_platform())
    draft = load_model(header, encoding, progress=False)
    check_vocabulary(draft, target, cfg.draft_model_path)
    if request_state_of(draft.config) is not None:
        raise UserError(f"--draft-model-path {cfg.draft_model_path}: {draft.config.architecture} "
                        f"keeps a fixed-size state per request, which the draft's cache cannot "
                        f"roll back; a draft model must keep K/V only (the target may be hybrid)")
    from maxjax.engine.devices import place_model
    return place_model(draft, mesh)


def draft_mesh(cfg):
    """The mesh of --draft-devices (else --devices), None for JAX's default device; UserError
    for devices this process does not have or another platform than the target's."""
    from maxjax.engine import devices
    from maxjax.graphs.sharding import mesh_over
    name = "--draft-devices" if cfg.draft_devices is not None else "--devices"
    text = cfg.draft_devices if cfg.draft_devices is not None else cfg.devices
    kind = _PLATFORMS.get(devices.parse(text, name).platform or jax.default_backend())
    if kind != _PLATFORMS.get(jax.default_backend(), jax.default_backend()):
        raise UserError(f"{name} {text}: the draft model runs on the target's platform "
                        f"({jax.default_backend()})")
    [group] = devices.device_groups(text, 1, name)
    return None if group == [jax.devices()[0]] else mesh_over(group)


def check_vocabulary(draft, target, path) -> None:
    dv, tv = draft.config.vocab_size, target.config.vocab_size
    same = dv == tv and (draft.tokenizer is None or target.tokenizer is None
                         or draft.tokenizer.get_vocab() == target.tokenizer.get_vocab())
    if not same:
        raise UserError(f"--draft-model-path {path}: its vocabulary ({dv} ids) is not the "
                        f"target's ({tv} ids): a draft model must share the target's tokenizer")


class DraftProposer:
    def __init__(self, draft, plan: EnginePlan, graphs=None):
        """`plan`: the engine's (the draft's sub-plan is maxjax/engine/plan.py `draft_plan`);
        `graphs`: (model, EnginePlan) -> (executables, kv_init) from the artifacts or the
        compile cache (maxjax/engine/build.py `_draft_graphs`); () or None: compiled at warm-up."""
        self.model = draft
        self.max_rows = plan.config.max_batch_size
        self.budget = plan.config.max_batch_input_tokens
        self.plan = draft_plan(plan, draft)
        lay = self.plan.layout
        self.bm = BlockManager(lay.num_pages, lay.page_size, enable_prefix_caching=False)
        executables, kv_init = (graphs(draft, self.plan) if graphs else ())[:2] or (None, None)
        self.runner = ModelRunner(draft, lay.buckets, lay.num_pages, lay.page_size,
                                  lay.max_pages_per_row, lay.max_length, executables, kv_init,
                                  attention=lay.attention, kv_dtype=lay.kv_dtype, mesh=lay.mesh)
        self.live: list[Request] = []      # requests holding draft pages

    def warmup(self) -> None:
        self.runner.compile_all()
        for _ in self.runner.prime_steps():
            pass

    def propose(self, requests, k: int) -> list[list[int]]:
        self.release_finished()
        seqs = [self._sync(r) for r in requests]
        active = [i for i, s in enumerate(seqs) if s is not None]
        out = [[] for _ in requests]
        first = self._feed([(seqs[i], requests[i].all_token_ids) for i in active])
        drafts = {i: [t] for i, t in zip(active, first) if t is not None}
        for _ in range(k - 1):
            rows = [i for i in drafts if self.bm.allocate(seqs[i], 1)]
            if not rows:
                break
            toks = self._run([(seqs[i], [drafts[i][-1]], True) for i in rows])
            for i, t in zip(rows, toks):
                seqs[i].num_computed_tokens += 1
                seqs[i].draft_token_ids.append(drafts[i][-1])
                drafts[i].append(t)
        for i, d in drafts.items():
            out[i] = d
        return out

    def observe(self, rows, results) -> None:
        self.release_finished()

    def reset(self) -> None:
        """Forget every request's draft cache (a failed call may have lost the pool)."""
        for r in self.live:
            self.bm.free(r.draft_state)
            r.draft_state = None
        self.live = []
        self.runner.reset_kv()

    # ---- the draft's cache ------------------------------------------------------------------------
    def _sync(self, r: Request) -> Request | None:
        """The request's draft sequence, rolled back to the tokens it still shares with it."""
        s = r.draft_state
        if s is None:
            s = r.draft_state = Request(r.request_id, [], _GREEDY)
            self.live.append(r)
        toks = r.all_token_ids
        keep = s.num_computed_tokens - len(s.draft_token_ids)   # tokens fed from the request
        for j, t in enumerate(s.draft_token_ids):               # then its own drafts, fed back
            if keep < len(toks) and toks[keep] == t:
                keep += 1
            else:
                break
        keep = min(keep, len(toks) - 1)        # the last token is fed to sample the first draft
        s.draft_token_ids = []
        if keep < s.num_computed_tokens:
            s.num_computed_tokens = keep
            self.bm.truncate(s, keep)
        return s

    def release_finished(self) -> None:
        for r in [r for r in self.live if r.is_finished]:
            self.bm.free(r.draft_state)
            r.draft_state = None
            self.live.remove(r)

    def _feed(self, items) -> list[int | None]:
        """Feed each sequence the request tokens it lacks (in chunks within the budget); the
        greedy token after the last of them, None where the draft's pool had no room."""
        out: list[int | None] = [None] * len(items)
        todo = list(range(len(items)))
        while todo:
            rows, budget = [], self.budget
            for i in list(todo):
                s, toks = items[i]
                n = min(len(toks) - s.num_computed_tokens, budget)
                if n <= 0 or len(rows) == self.max_rows:
                    break
                if not self.bm.allocate(s, n):
                    todo.remove(i)              # no room in the draft's pool: no drafts now
                    continue
                rows.append((i, n))
                budget -= n
            if not rows:
                break
            chunks = []
            for i, n in rows:
                s, toks = items[i]
                c = s.num_computed_tokens
                chunks.append((s, toks[c:c + n], c + n == len(toks)))
            for (i, n), t in zip(rows, self._run(chunks)):
                s, toks = items[i]
                s.num_computed_tokens += n
                if s.num_computed_tokens == len(toks):
                    out[i] = t
                    todo.remove(i)
        return out

    def _run(self, rows) -> list[int]:
        """One draft step over (sequence, tokens, samples) rows: the greedy token after each."""
        reqs = [RowRequest(RowSlice(toks, s.num_computed_tokens, s.pages, None, int(sample)),
                           _GREEDY, [], [], 0) for s, toks, sample in rows]
        return [res.token_ids[0] if res.samples else None for res in self.runner.run(reqs).rows]
