"""MTP drafts for speculative decoding (`--speculative-method mtp`): the checkpoint's
multi-token-prediction layer (graphs/mtp.py) drafts one token per request and step.

After every target step the proposer runs one MTP step over the positions that step computed
and kept (a prefill chunk's, or a verified row's last token and its accepted drafts): entry i
takes the target's hidden state at i, which the step kept on the device (ModelRunner
`last_hidden`), and token i+1, now known (the prompt's, or the one just sampled). Its latent is
written into a one-layer pool indexed by the target's pages, so the MTP cache needs no block
manager of its own: what the target's pages hold, rollback, preemption (the recompute writes it
again) and the prefix cache follow. The row's last entry gives the draft of the token after the
one just sampled, which `propose` hands the speculator for the next step. Each step's MTP graph
has the target bucket's shape (tokens, rows; one sample a row), compiled at warm-up.

A cached prefix page's last entry was written with the token after it in the request that
filled it; a request that shares the page and continues otherwise drafts from it until that
entry is written again: only the drafts' acceptance can suffer, never the output.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import mtp
from maxjax.graphs.attention import backend_named
from maxjax.graphs.program import abstract
from maxjax.graphs.step import build_step_inputs, step_input_specs, RowSlice

log = logging.getLogger("maxjax.engine")


def load_mtp(model) -> dict:
    """The MTP layer's params from the model's checkpoint (read again: the target's loader
    leaves them out), in the target's dtype."""
    from maxjax.models import hf as hfw
    from maxjax.models.loader import read_checkpoint
    from maxjax.errors import UserError
    ckpt = read_checkpoint(model.source)
    reader = hfw.SafetensorsReader(ckpt.files.weights)
    try:
        name = mtp.prefix(model.config) + mtp.EXTRA["eh_proj"]
        if hasattr(reader, "names") and name not in reader.names():
            raise UserError(f"--speculative-method mtp: {model.source} has no {name} (its "
                            f"config says {model.config.num_mtp_layers} MTP layers)")
        return mtp.params_from_hf(model.config, reader, model.params["final_norm"].dtype)
    finally:
        reader.close()


class MtpProposer:
    def __init__(self, model, plan, params: dict | None = None):
        """`params`: the MTP layer's (None: read from the model's checkpoint)."""
        lay = plan.layout
        self.cfg = model.config
        self.model = model
        self.params = params if params is not None else load_mtp(model)
        self.page_size, self.max_pages = lay.page_size, lay.max_pages_per_row
        self.backend = backend_named(lay.attention)
        self.shapes = sorted({(b.num_tokens, b.num_rows) for b in lay.buckets})
        spec = mtp.pool_specs(self.cfg, lay.num_pages, lay.page_size, lay.kv_dtype)
        self._zero = jax.jit(lambda: tuple(jnp.zeros(s.shape, s.dtype) for s in spec))
        self.kv = self._zero()
        self.executables: dict = {}
        self.runner = None
        self.drafts: dict[str, tuple[int, int]] = {}   # request id -> (its tokens, draft)

    def attach(self, runner) -> None:
        """The target's ModelRunner, whose steps keep their hidden states (`last_hidden`)."""
        self.runner = runner

    def warmup(self) -> None:
        H, dtype = self.cfg.hidden_size, self.model.params["final_norm"].dtype
        for T, R in self.shapes:
            if (T, R) in self.executables:
                continue
            step = step_input_specs(T, R, self.max_pages, R, self.backend)
            args = (abstract(self.model.params), abstract(self.params), abstract(self.kv), step,
                    jax.ShapeDtypeStruct((T,), np.int32), jax.ShapeDtypeStruct((T, H), dtype))
            fn = jax.jit(lambda *a: mtp.draft_program(self.cfg, *a), donate_argnums=(2,))
            self.executables[(T, R)] = fn.lower(*args).compile()

    def propose(self, requests, k: int) -> list[list[int]]:
        out = []
        for r in requests:
            d = self.drafts.get(r.request_id)
            out.append([d[1]] if d is not None and d[0] == r.num_tokens and k > 0 else [])
        return out

    def reset(self) -> None:
        self.drafts.clear()
        self.kv = self._zero()

    def observe(self, rows, results) -> None:
        """One MTP step over what the target step just computed and kept."""
        last, self.runner.last_hidden = self.runner.last_hidden, None
        for row in rows:
            if row.request.is_finished:
                self.drafts.pop(row.request.request_id, None)
        done = [row for row, res in zip(rows, results) if res is not None]
        if last is None or not done:
            return
        inputs, h = last
        if len(inputs) != len(done) or any(
                x.slice.start_pos != row.start_pos or len(x.slice.token_ids) != len(row.token_ids)
                for x, row in zip(inputs, done)):
            return          # the step ran in several calls (a failure): no drafts from it
        T, R = h.shape[0], len(inputs)
        shape = next(s for s in self.shapes if s[0] == T and s[1] >= R)
        mrows, src, owners, t = [], [], [], 0
        for row in done:
            req, p, n = row.request, row.start_pos, len(row.token_ids)
            toks = req.all_token_ids
            valid = min(n, req.num_computed_tokens - p, len(toks) - 1 - p)
            held = len(req.pages) * self.page_size      # none after a preemption
            if valid > 0 and not req.is_finished and held > p + valid - 1:
                sample = p + valid == len(toks) - 1
                mrows.append(RowSlice(toks[p + 1:p + 1 + valid], p, list(req.pages),
                                      num_samples=int(sample)))
                src += range(t, t + valid)
                if sample:
                    owners.append(req)
            t += n
        if not mrows:
            return
        step = build_step_inputs(mrows, shape[0], shape[1], self.max_pages, self.page_size,
                                 shape[1], self.backend)
        src_a = np.zeros(shape[0], np.int32)
        src_a[:len(src)] = src
        tokens, self.kv = self.executables[shape](self.model.params, self.params, self.kv, step,
                                                  src_a, h)
        tokens = jax.device_get(tokens)
        for j, req in enumerate(owners):
            self.drafts[req.request_id] = (req.num_tokens, int(tokens[j]))
