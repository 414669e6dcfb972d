"""The Anthropic Messages API: POST /v1/messages (whole, or streamed as Anthropic's typed SSE
events) and POST /v1/messages/count_tokens. The request becomes a ChatCompletionRequest
(server/anthropic_translate.py) and runs as a ChatTurn (server/chat_run.py), as every chat API
does; here its typed parts and message (server/chat_events.py) are rendered as content blocks:
thinking (from --reasoning-parser), text, tool_use. Errors on these routes are in Anthropic's
envelope (server/app.py's middleware picks it by `is_anthropic`). Registered by server/app.py."""
from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from maxjax.engine.types import FinishReason

from .anthropic_translate import (CountTokensRequest, MessagesRequest, anthropic_names,
                                  error_body, server_tools, to_chat)
from .chat_events import (ChatMessage, ChatPart, Finish, Reasoning, Text, ToolCallArgs,
                          ToolCallStart)
from .chat_prompt import chat_prompt
from .chat_run import ChatTurn
from .openai_routes import SSE, _accept
from .protocol import APIError
from .state import ServerState
from .tools import dropped_tools_header, tool_setup

PREFIX = "/v1/messages"
_STOP = {FinishReason.STOP: "end_turn", FinishReason.LENGTH: "max_tokens",
         FinishReason.TOOL_CALLS: "tool_use"}


def is_anthropic(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def json_error(status: int, message: str, param=None, code=None, headers=None):
    return web.json_response(error_body(status, message, param, code), status=status,
                             headers=headers)


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _usage(turn: ChatTurn) -> dict:
    """Anthropic counts cache reads apart from input_tokens (their sum is the prompt)."""
    prompt, completion, cached = turn.usage_counts()
    return {"input_tokens": prompt - cached, "output_tokens": completion,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def _stop_reason(st: ServerState, turn: ChatTurn, finish: Finish,
                       stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). The engine drops a matched stop string from the text but
    not from the tokens, so the sequence is the stop string the decoded tokens hold right after
    the text; none there (EOS): end_turn."""
    if finish.reason != FinishReason.STOP or not stops:
        return _STOP[finish.reason], None
    c = turn.choices[0]
    text = "".join(c.text)
    full = await st.in_tokenizer_thread(
        lambda: st.engine.tokenizer.decode(c.token_ids, skip_special_tokens=True))
    start = max(len(text) - 8, 0)     # slack for a decode that differs around the first token
    found = [(i, s) for s in stops if (i := full.find(s, start)) >= 0]
    return ("stop_sequence", min(found)[1]) if found else ("end_turn", None)


def _message(rid: str, model: str, content: list[dict], stop_reason, stop_sequence,
             usage: dict) -> dict:
    return {"id": rid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage}


def content_blocks(message: ChatMessage) -> list[dict]:
    """A whole message as content blocks: thinking, text, tool_use."""
    blocks = []
    if message.reasoning:
        blocks.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        blocks.append({"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name,
                       "input": call.args})
    return blocks


class BlockStream:
    """Chat parts -> content_block_start / _delta / _stop events: a block opens when a part of
    another kind (thinking, text, a new tool call) arrives and closes the one before."""

    def __init__(self, sse: SSE):
        self.sse, self.index, self.kind = sse, -1, None

    async def event(self, kind: str, data: dict, last: bool = False) -> None:
        body = f"event: {kind}\ndata: ".encode() + json.dumps(
            {"type": kind, **data}, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
        await (self.sse.finish(body) if last else self.sse.write(body))

    async def _open(self, kind: str, block: dict) -> None:
        await self.close()
        self.index, self.kind = self.index + 1, kind
        await self.event("content_block_start", {"index": self.index, "content_block": block})

    async def _delta(self, delta: dict) -> None:
        await self.event("content_block_delta", {"index": self.index, "delta": delta})

    async def close(self) -> None:
        if self.kind is None:
            return
        if self.kind == "thinking":
            await self._delta({"type": "signature_delta", "signature": ""})
        await self.event("content_block_stop", {"index": self.index})
        self.kind = None

    async def feed(self, part: ChatPart) -> None:
        match part:
            case Reasoning(text) if text:
                if self.kind != "thinking":
                    await self._open("thinking", {"type": "thinking", "thinking": "",
                                                  "signature": ""})
                await self._delta({"type": "thinking_delta", "thinking": text})
            case Text(text) if text:
                if self.kind != "text":
                    await self._open("text", {"type": "text", "text": ""})
                await self._delta({"type": "text_delta", "text": text})
            case ToolCallStart(_, call_id, name):
                await self._open("tool_use", {"type": "tool_use", "id": _tool_use_id(call_id),
                                              "name": name, "input": {}})
            case ToolCallArgs(_, args) if args:
                await self._delta({"type": "input_json_delta", "partial_json": args})


async def _accept_messages(request: web.Request, model_cls):
    st, req, lora = await _accept(request, model_cls)
    try:
        return st, req, lora, to_chat(req)
    except APIError as e:
        raise anthropic_names(e) from None


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic Messages (streamed as Anthropic's SSE events with stream: true)."""
    t0 = time.perf_counter()
    st, req, lora, chat = await _accept_messages(request, MessagesRequest)
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    stops = [s for s in req.stop_sequences or [] if s]
    try:
        # max_tokens is required and clients send a large one (Claude Code: 32000): it is cut
        # to what the prompt leaves; a call cut off by it stays a tool_use block, as Anthropic's
        turn = await ChatTurn.prepare(st, chat, rid, t0, lora, clamp=True, partial_calls=True)
        turn.headers.update(dropped_tools_header(server_tools(req)))
        async with turn:
            if req.stream:
                return await _stream(request, st, req, turn, rid, stops)
            final = (await turn.collect())[0]
            reason, seq = await _stop_reason(st, turn, final.finish, stops)
            return web.json_response(_message(rid, req.model, content_blocks(final.message),
                                              reason, seq, _usage(turn)),
                                     headers=turn.headers)
    except APIError as e:     # before any byte went out (_stream sends its own as an event)
        raise anthropic_names(e) from None


async def _stream(request, st, req, turn, rid, stops) -> web.StreamResponse:
    sse = await SSE(request, turn.headers).start()
    blocks = BlockStream(sse)
    started = False

    async def start() -> None:
        """message_start once the engine's first output came: its usage then splits the
        prompt into cache reads and the rest, as the final usage does."""
        nonlocal started
        if not started:
            started = True
            await blocks.event("message_start", {"message": _message(
                rid, req.model, [], None, None, {**_usage(turn), "output_tokens": 0})})
            await blocks.event("ping", {})
    finish = Finish(FinishReason.STOP, FinishReason.STOP)
    try:
        async for ev in turn.events():
            await start()
            for part in ev.parts:
                await blocks.feed(part)
            finish = ev.finish or finish
        await start()
    except APIError as e:
        e = anthropic_names(e)
        return await sse.finish(b"event: error\ndata: " + json.dumps(
            error_body(e.status, e.message, e.param, e.code)).encode() + b"\n\n")
    await blocks.close()
    reason, seq = await _stop_reason(st, turn, finish, stops)
    await blocks.event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                         "usage": _usage(turn)})
    await blocks.event("message_stop", {}, last=True)
    return sse.resp


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt /v1/messages would run, counted: {"input_tokens": N}."""
    st, req, lora, chat = await _accept_messages(request, CountTokensRequest)
    try:
        ids, _, _ = await chat_prompt(st, chat, tool_setup(chat, st.tool_parser))
    except APIError as e:
        raise anthropic_names(e) from None
    return web.json_response({"input_tokens": len(ids)})
