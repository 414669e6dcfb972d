"""POST /v1/embeddings: inputs -> token ids (tokenizer thread) -> one engine embedding request per
input (EngineClient.embed: prefill only, batched with the generation requests in the same steps,
its pages freed with its last chunk) -> the pooled, normalized vectors as floats or base64.
Registered by server/app.py; the request model is server/embeddings_protocol.py.

Served in both tasks: --task text_generation (the default) serves it beside generation, --task
embeddings_generation serves it alone (the engine refuses generation requests). Every input is
checked before any runs, so a bad `input[3]` is a 400 naming it and nothing was computed; a client
that goes away cancels the handler, which aborts every unfinished input (no page kept)."""
from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
from aiohttp import web

from . import access_log
from .embeddings_protocol import MAX_INPUTS, EmbeddingList, EmbeddingRequest
from .generation import _api_error, aborted
from .openapi import describe
from .protocol import APIError
from .state import STATE, ServerState, parse_request, read_json


async def input_token_ids(st: ServerState, inp) -> tuple[list[list[int]], list[str]]:
    """Each input's token ids and the name errors give it (`input`, or `input[i]` in a list)."""
    if isinstance(inp, str) or (inp and isinstance(inp[0], int)):
        items, names = [inp], ["input"]
    else:
        items, names = list(inp), [f"input[{i}]" for i in range(len(inp))]
    if not items or (len(items) == 1 and not items[0]):
        raise APIError(400, "input: must not be empty", param="input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"input: {len(items)} inputs, more than {MAX_INPUTS}", param="input")
    for item, name in zip(items, names):
        if not item:
            raise APIError(400, f"{name}: must not be empty", param=name)
        if isinstance(item, str):
            st.check_fits(item, name)
    texts = [(i, t) for i, t in enumerate(items) if isinstance(t, str)]
    if texts:
        enc = st.engine.tokenizer.encode
        ids = await st.in_tokenizer_thread(lambda: [enc(t) for _, t in texts])
        for (i, _), t in zip(texts, ids):
            items[i] = list(t)
    limit, vocab = st.engine.max_length, st.vocab_size
    for item, name in zip(items, names):
        if len(item) > limit:
            raise APIError(400, f"{name}: {len(item)} tokens, more than the maximum length "
                                f"{limit}", param=name)
        bad = next((t for t in item if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{name}: token id {bad} is outside the vocabulary "
                                f"[0, {vocab})", param=name)
    return [list(map(int, x)) for x in items], names


def encode_vector(v: list[float], encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii")
    return v


class _Inputs:
    """An embedding request's inputs, as a drain's deadline finds them (AdmissionState.live):
    `abort_unfinished` cancels what still runs, and the request is answered with a 503."""

    def __init__(self, tasks: list[asyncio.Future]):
        self.tasks, self.aborted = tasks, False

    def abort_unfinished(self) -> int:
        left = [t for t in self.tasks if not t.done()]
        self.aborted = self.aborted or bool(left)
        for t in left:
            t.cancel()
        return len(left)


@describe(request=EmbeddingRequest, response=EmbeddingList)
async def embeddings(request: web.Request) -> web.Response:
    """Embeddings of the inputs: each one's final hidden states, pooled (last token or mean,
    --pooling-type or the request's `pooling_type`) and L2-normalized."""
    st: ServerState = request.app[STATE]
    req = parse_request(EmbeddingRequest, await read_json(request),
                        st.cfg.allow_extra_request_fields)
    st.check_ready()
    lora = st.check_model(req.model)
    hidden = st.engine.info().get("hidden_size")
    if req.dimensions is not None and hidden is not None and req.dimensions != hidden:
        raise APIError(400, f"dimensions: this model's embeddings have {hidden} dimensions and "
                            "cannot be shortened (it was not trained for truncated vectors)",
                       param="dimensions")
    prompts, names = await input_token_ids(st, req.input)
    access_log.note_prompt_tokens(sum(map(len, prompts)))
    base = f"embd-{uuid.uuid4().hex}"

    async def one(i: int) -> list[float]:
        try:
            return await st.engine.embed(f"{base}-{i}", prompts[i], req.pooling_type, lora)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise _api_error(e, {"prompt": names[i]}) from None

    st.admission.add(len(prompts))
    run = _Inputs([asyncio.ensure_future(one(i)) for i in range(len(prompts))])
    st.admission.live.add(run)
    try:
        vectors = await asyncio.gather(*run.tasks)
    except asyncio.CancelledError:
        if not run.aborted:         # the client went away
            raise
        raise aborted() from None
    finally:        # an error or a client gone: the unfinished inputs are aborted
        st.admission.live.discard(run)
        for t in run.tasks:
            t.cancel()
        await asyncio.gather(*run.tasks, return_exceptions=True)
        st.admission.done(len(prompts))
    if req.dimensions is not None and vectors and req.dimensions != len(vectors[0]):
        raise APIError(400, f"dimensions: this model's embeddings have {len(vectors[0])} "
                            "dimensions and cannot be shortened", param="dimensions")
    n = sum(map(len, prompts))
    return web.json_response({
        "object": "list", "model": req.model or st.model_id,
        "data": [{"object": "embedding", "index": i,
                  "embedding": encode_vector(v, req.encoding_format)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": n, "total_tokens": n}})
