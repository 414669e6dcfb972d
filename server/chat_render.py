"""The chat completions wire shape of a chat turn's typed output (server/chat_events.py): a part
as a streamed delta, an engine output's parts as chunk choices, the whole message. `fields`: the
names reasoning goes out under (ServeConfig.reasoning_fields(): reasoning_content and/or
reasoning)."""
from __future__ import annotations

from maxjax.engine.types import TokenLogprob

from .chat_events import (ChatMessage, ChatPart, ChoiceEvent, Reasoning, Text, ToolCall,
                          ToolCallArgs, ToolCallStart)
from .protocol import chat_chunk_choice


def delta(part: ChatPart, fields: tuple[str, ...]) -> dict:
    match part:
        case Text(text):
            return {"content": text}
        case Reasoning(text):
            return {f: text for f in fields}
        case ToolCallStart(index, call_id, name):
            return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]}
        case ToolCallArgs(index, args):
            return {"tool_calls": [{"index": index, "function": {"arguments": args}}]}
    raise TypeError(f"not a chat part: {part!r}")


def chunk_choices(ev: ChoiceEvent, fields: tuple[str, ...], logprobs: dict | None) -> list[dict]:
    """One chunk choice per part (an empty delta when there is none): the logprobs on the
    first, the finish reason on the last."""
    deltas = [delta(p, fields) for p in ev.parts] or [{}]
    last = len(deltas) - 1
    return [chat_chunk_choice(ev.index, d, ev.finish.reason if ev.finish and j == last else None,
                              logprobs if j == 0 else None) for j, d in enumerate(deltas)]


def logprob_entries(token_str, lps: list[TokenLogprob] | None, top_n: int) -> list[dict]:
    """Token logprobs as {token, logprob, bytes, top_logprobs}: chat completions' `content`
    entries, which the Responses API's LogProb also is. `token_str`: a token id's text."""
    def entry(tid, lp):
        s = token_str(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    out = []
    for t in lps or []:
        e = entry(t.token_id, t.logprob)
        e["top_logprobs"] = [entry(i, lp) for i, lp in t.top[:top_n]]
        out.append(e)
    return out


def tool_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def message(msg: ChatMessage, fields: tuple[str, ...]) -> dict:
    """The message of a non-streamed choice: content (null beside tool calls), reasoning,
    tool_calls."""
    out = {"content": msg.content or (None if msg.tool_calls else "")}
    if msg.reasoning:
        out.update({f: msg.reasoning for f in fields})
    if msg.tool_calls:
        out["tool_calls"] = [tool_call(c) for c in msg.tool_calls]
    return out
