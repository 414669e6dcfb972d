"""POST /v1/chat/completions and POST /v1/completions: request -> prompt token ids (chat
template in the tokenizer thread) -> SamplingParams -> Generation -> JSON or SSE chunks; a chat
turn runs in server/chat_run.py, as it does under the Responses and Messages routes. Also the SSE
writer and the request acceptance every generation route shares. Registered by server/app.py."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web

from maxjax.engine.types import TokenLogprob

from . import chat_render
from .chat_render import logprob_entries
from .chat_run import ChatTurn
from .generation import Generation
from .openapi import describe
from .protocol import (COMPLETION_MAX_TOKENS, APIError, ChatCompletionRequest, CompletionRequest,
                       chat_choice, chat_chunk, chat_chunk_choice, chat_response,
                       completion_choice, completion_response, error_body, now, usage)
from .responses import ChatCompletion, ChatCompletionChunk, Completion
from .sampling_request import (COMPLETION_ERROR_NAMES, default_max_tokens, per_choice,
                               sampling_params)
from .state import COMPLETED, STATE, ServerState, parse_request, read_json
from .structured import unenforced_notes, warning_headers

_DONE = b"data: [DONE]\n\n"


# ---- prompts ------------------------------------------------------------------------------------

async def completion_prompts(st: ServerState, prompt) -> tuple[list[list[int]], list[str | None]]:
    """Token id lists, and each prompt's text when it came as text (for echo)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    if isinstance(prompt[0], str):
        for i, p in enumerate(prompt):
            st.check_fits(p, "prompt" if len(prompt) == 1 else f"prompt[{i}]")
        enc = st.engine.tokenizer.encode
        ids = await st.in_tokenizer_thread(lambda: [enc(p) for p in prompt])
        texts = list(prompt)
    else:
        ids, texts = [list(p) for p in prompt], [None] * len(prompt)
    return ids, texts


# ---- logprobs -----------------------------------------------------------------------------------

def chat_logprobs(st: ServerState, lps: list[TokenLogprob] | None, top_n: int) -> dict:
    return {"content": logprob_entries(st.token_str, lps, top_n), "refusal": None}


class CompletionLogprobs:
    """The legacy completions logprobs object, built incrementally. text_offset runs on by the
    tokens' lengths, held within `limit` (the text returned so far): a character split over
    tokens shows each piece as '\ufffd', longer than the text it makes."""

    def __init__(self, st: ServerState, top_n: int):
        self.st, self.top_n, self.offset = st, top_n, 0

    def build(self, token_ids: list[int], lps: list[TokenLogprob | None], limit: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, t in zip(token_ids, lps):
            s = self.st.token_str(tid)
            out["tokens"].append(s)
            out["text_offset"].append(min(self.offset, limit))
            self.offset += len(s)
            out["token_logprobs"].append(None if t is None else t.logprob)
            if t is None:
                out["top_logprobs"].append(None)
            else:
                top = {self.st.token_str(i): lp for i, lp in t.top[:self.top_n]}
                top.setdefault(s, t.logprob)
                out["top_logprobs"].append(top)
        return out


# ---- SSE ----------------------------------------------------------------------------------------

class SSE:
    """A server-sent-events response. A client that reads nothing for --http-write-timeout
    seconds (its socket buffer full) is cut with ConnectionResetError, as when it goes away,
    so the handler's generation aborts its requests."""

    def __init__(self, request: web.Request, headers: dict | None = None):
        self.request, self.timeout = request, request.app[STATE].cfg.http_write_timeout
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                "Cache-Control": "no-cache",
                                                "X-Accel-Buffering": "no", **(headers or {})})

    async def start(self) -> "SSE":
        await self.resp.prepare(self.request)
        return self

    async def write(self, data: bytes) -> None:
        try:
            await asyncio.wait_for(self.resp.write(data), self.timeout)
        except asyncio.TimeoutError:
            raise ConnectionResetError(f"the client read nothing for {self.timeout:g} s") \
                from None

    async def send(self, obj: dict) -> None:
        await self.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    async def finish(self, data: bytes) -> web.StreamResponse:
        """Write the stream's last event and mark the response completed: the handler still
        awaits its cleanup (the generation's close) after this, and a client that hangs up as
        soon as it has read the last event cancels the handler there; the middleware then
        counts the status it had (200), not 499."""
        await self.write(data)
        self.request[COMPLETED] = self.resp.status
        return self.resp

    async def error(self, e: APIError) -> web.StreamResponse:
        """After the 200 headers have gone out, an error can only be an event in the stream."""
        await self.send(error_body(e.status, e.message, e.param, e.code))
        return await self.done()

    async def done(self) -> web.StreamResponse:
        return await self.finish(_DONE)


# ---- handlers -----------------------------------------------------------------------------------

async def _accept(request: web.Request, model_cls):
    """Parse and check what every generation route checks first: body, readiness, model,
    unsupported fields."""
    st: ServerState = request.app[STATE]
    req = parse_request(model_cls, await read_json(request), st.cfg.allow_extra_request_fields)
    st.check_ready()
    lora = st.check_model(req.model)
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"{bad[0]}: {bad[1]}", param=bad[0])
    return st, req, lora


@describe(request=ChatCompletionRequest, response=ChatCompletion, stream=ChatCompletionChunk)
async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI chat completions (streamed as SSE with stream: true)."""
    t0 = time.perf_counter()
    st, req, lora = await _accept(request, ChatCompletionRequest)
    rid, model = f"chatcmpl-{uuid.uuid4().hex}", lora or st.model_id
    top_n = req.top_logprobs or 0
    turn = await ChatTurn.prepare(st, req, rid, t0, lora)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    fields = st.cfg.reasoning_fields()
    async with turn:
        if not req.stream:
            choices = [chat_choice(f.index, chat_render.message(f.message, fields),
                                   f.finish.reason,
                                   chat_logprobs(st, f.logprobs, top_n) if req.logprobs else None)
                       for f in await turn.collect()]
            return web.json_response(chat_response(rid, model, turn.created, choices,
                                                   usage(*turn.usage_counts())),
                                     headers=turn.headers)
        sse = await SSE(request, turn.headers).start()

        def chunk(choices, use=None):
            return chat_chunk(rid, model, turn.created, choices, use, include_usage)
        for c in turn.choices:
            await sse.send(chunk([chat_chunk_choice(
                c.index, {"role": "assistant", "content": ""})]))
        try:
            async for ev in turn.events():
                lp = chat_logprobs(st, ev.logprobs, top_n) if ev.logprobs else None
                for choice in chat_render.chunk_choices(ev, fields, lp):
                    await sse.send(chunk([choice]))
        except APIError as e:
            return await sse.error(e)
        if include_usage:
            await sse.send(chunk([], usage(*turn.usage_counts())))
        return await sse.done()


@describe(request=CompletionRequest, response=Completion, stream=Completion)
async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI (legacy) completions (streamed as SSE with stream: true)."""
    t0 = time.perf_counter()
    st, req, lora = await _accept(request, CompletionRequest)
    if req.echo and not st.cfg.enable_echo:
        raise APIError(400, "echo: echo is off on this server (--no-enable-echo)", param="echo")
    prompts, texts = await completion_prompts(st, req.prompt)
    # max_tokens 0 (with echo): one token is generated, and dropped (vLLM's way)
    score_only = req.max_tokens == 0
    max_new = 1 if score_only else default_max_tokens(st, prompts, req.max_tokens,
                                                      COMPLETION_MAX_TOKENS)
    want_lp = req.logprobs is not None
    top_n = req.logprobs or 0
    params = sampling_params(st, req, max_new, want_lp, top_n,
                             prompt_logprobs=bool(req.echo and want_lp))
    rid, model = f"cmpl-{uuid.uuid4().hex}", lora or st.model_id
    created = now()
    n = req.n
    headers = warning_headers(unenforced_notes(params.structured_output))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    async with Generation(st.engine, st.admission, st.metrics, rid, prompts, n,
                          per_choice(params, len(prompts) * n, n), req.cache_salt, t0,
                          COMPLETION_ERROR_NAMES, lora) as gen:
        # Decoded once the engine has admitted the prompts (their token ids are valid).
        echo_texts = [t if t is not None else st.engine.tokenizer.decode(p)
                      for t, p in zip(texts, prompts)] if req.echo else None
        st.metrics.prompt_tokens.inc(sum(map(len, prompts)))
        lp_builders = {c.index: CompletionLogprobs(st, top_n) for c in gen.choices}

        def counts():
            prompt, completion, cached = gen.usage_counts()
            return prompt, 0 if score_only else completion, cached

        def echo_logprobs(c):
            plps = c.prompt_logprobs or [None] * c.prompt_len
            start = len(echo_texts[c.prompt_index])      # where the completion's text starts
            built = lp_builders[c.index].build(prompts[c.prompt_index], plps, start)
            lp_builders[c.index].offset = start
            return built

        if not req.stream:
            async for _ in gen.events():
                pass
            choices = []
            for c in gen.choices:
                text, lps = ("", []) if score_only else ("".join(c.text), c.logprobs or [])
                lp = None
                if req.echo:
                    text = echo_texts[c.prompt_index] + text
                if want_lp:
                    head = echo_logprobs(c) if req.echo else None
                    lp = lp_builders[c.index].build([t.token_id for t in lps], lps, len(text))
                    lp = _concat_lp(head, lp) if head else lp
                choices.append(completion_choice(c.index, text, "length" if score_only else
                                                 c.finish_reason, lp))
            return web.json_response(completion_response(rid, model, created, choices,
                                                         usage(*counts())),
                                     headers=headers)
        sse = await SSE(request, headers).start()

        def chunk(choice):
            return completion_response(rid, model, created, [choice], None, False)
        echoed, sent = set(), {}       # sent: each choice's text length, this chunk's included
        try:
            async for c, out in gen.events():
                text, lps = ("", []) if score_only else (out.new_text, out.new_logprobs or [])
                lp = head = None
                if req.echo and c.index not in echoed:
                    echoed.add(c.index)
                    text = echo_texts[c.prompt_index] + text
                    head = echo_logprobs(c) if want_lp else None
                sent[c.index] = sent.get(c.index, 0) + len(text)
                if want_lp:
                    lp = lp_builders[c.index].build([t.token_id for t in lps], lps,
                                                    sent[c.index])
                    lp = _concat_lp(head, lp) if head else lp
                if not (text or out.finished or lp and lp["tokens"]):
                    continue
                finish = ("length" if score_only else c.finish_reason) if out.finished else None
                await sse.send(chunk(completion_choice(c.index, text, finish, lp)))
        except APIError as e:
            return await sse.error(e)
        if include_usage:
            await sse.send(completion_response(rid, model, created, [],
                                                     usage(*counts())))
        return await sse.done()


def _concat_lp(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}
