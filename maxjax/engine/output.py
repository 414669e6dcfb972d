"""The one output processor: a step's StepUpdates -> RequestOutputs, for maxjax.LLM and the server's
AsyncEngine alike. EngineCore.step calls it on the engine's thread right after the scheduler's
update_from_output, so a stop string found here ends its request in the same step (EngineCore
then finishes it in the scheduler, which frees its pages).

It works on each Request's own state: its TextStream (incremental detokenization and stop strings,
created with the request's first output) and the prompt logprobs gathered over its prefill chunks
(`keep_prompt_logprobs`), sent with the first output. `final_output` is the last output of a
request ended outside its updates (abort, failure); `embedding_output` the one output of an
embedding request, its pooled vector; `merge_outputs` folds outputs that queued up
for one consumer into one.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np

from maxjax.engine.detokenizer import TextStream
from maxjax.engine.request import Request
from maxjax.engine.types import FinishReason, RequestOutput, TokenLogprob

log = logging.getLogger("maxjax.engine")


def token_logprob(token_id: int, logprob, top_ids, top_logprobs, k: int) -> TokenLogprob:
    return TokenLogprob(int(token_id), float(logprob),
                        [(int(i), float(v)) for i, v in zip(top_ids[:k], top_logprobs[:k])])


def keep_prompt_logprobs(req: Request, start_pos: int, num_tokens: int, plp) -> None:
    """Store on the request the logprobs of the prompt tokens that follow a row's `num_tokens`
    tokens from `start_pos` (plp: the runner's (logprobs, top ids, top logprobs) arrays)."""
    lps, top_ids, top_lps = plp
    k = req.sampling.top_logprobs
    prompt = req.prompt_token_ids
    for i in range(num_tokens):
        pos = start_pos + i + 1
        if pos < len(prompt):
            req.prompt_logprobs[pos] = token_logprob(prompt[pos], lps[i], top_ids[i], top_lps[i], k)


def final_output(req: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
    """The last output of a request ended outside its updates (abort, failure): no new tokens."""
    return RequestOutput(req.request_id, [], finished=True, finish_reason=reason,
                         prompt_tokens=req.num_prompt_tokens,
                         completion_tokens=req.num_output_tokens,
                         cached_tokens=req.num_cached_tokens, error=error)


def pooled_embedding(req: Request) -> np.ndarray:
    """The request's embedding from its pooled hidden states: the last token's or the mean over
    its prompt, L2-normalized unless its PoolingParams say not (float32)."""
    p = req.pooling
    v = req.pool_sum / req.num_prompt_tokens if p.pooling_type == "mean" else req.pool_last
    v = np.asarray(v, np.float64)
    if p.normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v.astype(np.float32)


def embedding_output(req: Request) -> RequestOutput:
    """The one output of a finished embedding request."""
    return RequestOutput(req.request_id, [], finished=True, finish_reason=req.finish_reason,
                         prompt_tokens=req.num_prompt_tokens,
                         embedding=pooled_embedding(req).tolist())


def merge_outputs(outs: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: tokens, text and logprobs joined; counts and the
    finish from the last."""
    if len(outs) == 1:
        return outs[0]
    tokens, text, lps, plps = [], "", None, None
    for o in outs:
        tokens += o.new_token_ids
        text += o.new_text
        if o.new_logprobs is not None:
            lps = (lps or []) + o.new_logprobs
        if o.prompt_logprobs is not None:
            plps = o.prompt_logprobs
    return dataclasses.replace(outs[-1], new_token_ids=tokens, new_text=text, new_logprobs=lps,
                               prompt_logprobs=plps)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer     # None: outputs carry token ids only, no text

    def process(self, updates) -> list[RequestOutput]:
        """One output per StepUpdate (its samples: the row's runner Samples, the first ones
        matching its tokens). A finished output whose request the scheduler still runs (a stop
        string, or an ERROR when processing it raised) is for the caller to finish."""
        outs = []
        for u in updates:
            req = u.request
            try:
                if req.is_embedding:
                    outs.append(embedding_output(req))
                    continue
                outs.append(self._output(req, u.token_ids, u.samples))
            except Exception as e:
                log.exception("output processing failed for %s", req.request_id)
                outs.append(final_output(req, FinishReason.ERROR, f"output processing failed: "
                                                                f"{type(e).__name__}: {e}"))
        return outs

    def _text(self, req: Request) -> TextStream | None:
        if req.text is None and self.tokenizer is not None:
            req.text = TextStream(self.tokenizer, req.sampling, req.prompt_token_ids)
        return req.text

    def _output(self, req: Request, token_ids: list[int], samples) -> RequestOutput:
        sp = req.sampling
        n_before = req.num_output_tokens - len(token_ids)
        out = RequestOutput(req.request_id, [], new_logprobs=[] if sp.logprobs else None,
                            prompt_tokens=req.num_prompt_tokens, cached_tokens=req.num_cached_tokens)
        if sp.prompt_logprobs and n_before == 0:
            got, req.prompt_logprobs = req.prompt_logprobs, {}
            out.prompt_logprobs = [None] + [got.get(i) for i in range(1, req.num_prompt_tokens)]
        text = self._text(req)
        last = len(token_ids) - 1
        apart = []      # logprobs of tokens outside the text, after those the text holds
        for j, (token, smp) in enumerate(zip(token_ids, samples)):
            out.new_token_ids.append(token)
            lps = [token_logprob(token, smp.logprob, smp.top_ids, smp.top_logprobs,
                                 sp.top_logprobs)] if sp.logprobs else None
            # A stop token id ends the request without appearing in its text (EOS is special
            # and skipped by the detokenizer anyway).
            if text is None or (j == last and req.is_finished and token in sp.stop_token_ids):
                apart += lps or []
                continue
            out.new_text += text.add([token], lps)
            if text.stopped:
                break
        out.completion_tokens = n_before + len(out.new_token_ids)
        if text is not None and text.stopped:
            out.finished, out.finish_reason = True, FinishReason.STOP
        elif req.is_finished:
            out.finished, out.finish_reason, out.error = True, req.finish_reason, req.error
        if out.finished and text is not None:
            out.new_text += text.finish()
        if sp.logprobs:
            out.new_logprobs = (text.take_logprobs() if text is not None else []) + apart
        return out
