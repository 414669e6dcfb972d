"""The Responses API's shapes: its request (`CreateResponse` of the OpenAI spec) translated into a
ChatCompletionRequest, and a chat turn's typed parts (server/chat_events.py) rendered as output
items (message, function_call, reasoning) and stream events; the response object. Used by
server/responses_api.py, which runs the translated request as any chat turn."""
from __future__ import annotations

import contextlib
import copy
import time
import uuid
from typing import Any, Literal

from pydantic import Field

from . import json_body
from .chat_events import ChatPart, Reasoning, Text, ToolCallArgs, ToolCallStart
from .protocol import APIError, ChatCompletionRequest, _Strict
from .responses_tools import BUILT_IN_TOOLS, flat_name, function_tools

_CHAT = ChatCompletionRequest.model_fields


class ResponsesRequest(_Strict):
    """POST /v1/responses (the spec's CreateResponse); the sampling extensions at the end are
    chat's."""
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = _CHAT["temperature"]
    top_p: float | None = _CHAT["top_p"]
    top_logprobs: int | None = _CHAT["top_logprobs"]
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # What each names is absent here (no built-in tools, no encrypted reasoning), but for
    # logprobs (logprobs_included()).
    include: list[Literal["file_search_call.results", "web_search_call.results",
                          "web_search_call.action.sources", "message.input_image.image_url",
                          "computer_call_output.output.image_url",
                          "code_interpreter_call.outputs", "reasoning.encrypted_content",
                          "message.output_text.logprobs"]] | None = None
    background: bool | None = None      # run on after the answer (server/responses_run.py)
    # Accepted at their "off" value only (unsupported()).
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    # Accepted and ignored: they change nothing here.
    max_tool_calls: int | None = None       # counts built-in tools, which this server has none of
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    moderation: Any = None
    client_metadata: dict[str, Any] | None = None     # Codex's: who is asking, for logs
    # Extensions: chat's sampling fields.
    seed: int | None = _CHAT["seed"]
    stop: str | list[str] | None = None
    frequency_penalty: float | None = _CHAT["frequency_penalty"]
    presence_penalty: float | None = _CHAT["presence_penalty"]
    top_k: int | None = _CHAT["top_k"]
    min_p: float | None = _CHAT["min_p"]
    repetition_penalty: float | None = _CHAT["repetition_penalty"]
    min_tokens: int = _CHAT["min_tokens"]
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.background and self.store is False:
            return "background", "a background response must be stored (store: false)"
        if self.background and self.stream:
            return "background", "a background response is not streamed here (poll GET " \
                                 "/v1/responses/{id})"
        if self.prompt is not None:
            return "prompt", "prompt templates are not supported"
        if self.conversation is not None:
            return "conversation", "conversations are not supported (use previous_response_id)"
        if self.context_management:
            return "context_management", "context management is not supported"
        return None

    def logprobs_included(self) -> bool:
        """Whether the output text carries its tokens' logprobs (with top_logprobs
        alternatives each): only with this `include`, as OpenAI and vLLM return them."""
        return "message.output_text.logprobs" in (self.include or ())


def _bad(param: str, reason: str) -> APIError:
    return APIError(400, f"{param}: {reason}", param=param)


# ---- request -> chat ------------------------------------------------------------------------

def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return list(req.input or [])


_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text",
               "refusal": "refusal", "summary_text": "text", "reasoning_text": "text"}


def _text(content, param: str, allow_none: bool = False, images: bool = False):
    """A message's (or tool output's) content as text: a string, or text parts; `images` (a
    user message): with an input_image part, chat content parts (text and image_url)."""
    if isinstance(content, str) or (content is None and allow_none):
        return content
    if not isinstance(content, list):
        raise _bad(param, "must be a string or a list of content parts")
    texts, parts = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None     # a list or an object: no type
        key = _TEXT_PARTS.get(kind)
        if kind == "input_image" and images:
            if not isinstance(part.get("image_url"), str):
                raise _bad(f"{param}[{j}].image_url", "an input_image needs an image_url "
                                                      "(a data: URL; file_id is not supported)")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
            continue
        if key is None:
            what = {"input_image": "image inputs", "input_file": "file inputs",
                    "input_audio": "audio inputs"}.get(kind)
            raise _bad(f"{param}[{j}].type", f"{what} are not supported" if what else
                       f"{kind!r}: only text parts are supported (input_text, output_text)")
        if not isinstance(part.get(key), str):
            raise _bad(f"{param}[{j}].{key}", "must be a string")
        texts.append(part[key])
        parts.append({"type": "text", "text": part[key]})
    if len(parts) > len(texts):
        return parts
    return "\n".join(texts)


def _string(it: dict, key: str, param: str) -> str:
    if not isinstance(it.get(key), str):
        raise _bad(f"{param}.{key}", "required (a string)")
    return it[key]


def _arguments(it: dict, param: str) -> str:
    """A function_call's arguments; JSON nesting too deep is the body's 400, named here."""
    text = _string(it, "arguments", param)
    with contextlib.suppress(ValueError):     # not JSON: the template gets {}, as on chat
        json_body.loads(text, f"{param}.arguments")
    return text


def item_messages(items: list, where, images: bool = False) -> list[dict]:
    """Input items -> chat messages; `where(i)` names item i in an error. A function_call joins
    the assistant message before it; reasoning items are dropped (the template re-renders none)."""
    msgs: list[dict] = []
    for i, it in enumerate(items):
        p = where(i)
        if not isinstance(it, dict):
            raise _bad(p, "must be an object")
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{p}.role", f"{role!r}: must be user, system, developer or "
                                        "assistant")
            msgs.append({"role": role, "content": _text(it.get("content"), f"{p}.content",
                                                        images=images and role == "user")})
        elif kind == "function_call":
            name = _string(it, "name", p)
            if it.get("namespace") is not None:
                name = flat_name(_string(it, "namespace", p), name)
            call = {"id": _string(it, "call_id", p), "type": "function",
                    "function": {"name": name,
                                 "arguments": _arguments(it, p)}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
                msgs[-1]["content"] = msgs[-1]["content"] or None
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": _string(it, "call_id", p),
                         "content": _text(it.get("output"), f"{p}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise _bad(f"{p}.type", f"{kind!r} items are not supported (message, function_call, "
                                    "function_call_output, reasoning)")
    return msgs


def _tools(tools: list) -> list[dict]:
    return [{"type": "function", "function": {
        k: t[k] for k in ("name", "description", "parameters", "strict")
        if t.get(k) is not None}} for t in function_tools(tools)[0]]


def _tool_choice(choice, tools: list[dict]):
    """(chat tool_choice, chat tools): the function form reshaped; allowed_tools narrows tools."""
    if not isinstance(choice, dict):
        return choice, tools
    kind = choice.get("type")
    if kind in BUILT_IN_TOOLS:
        raise _bad("tool_choice", f"{kind!r} is a built-in tool (OpenAI runs it); this server "
                                  "cannot run it")
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, tools
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required") and \
            isinstance(choice.get("tools"), list):
        names = set()
        for j, t in enumerate(choice["tools"]):
            if isinstance(t, dict) and t.get("type") == "function":
                if not isinstance(t.get("name"), str):
                    raise _bad(f"tool_choice.tools[{j}].name", "must be a string")
                names.add(t["name"])
        return choice["mode"], [t for t in tools if t["function"].get("name") in names]
    raise _bad("tool_choice", "must be none, auto, required, {\"type\": \"function\", \"name\": "
                              "...} or allowed_tools of function tools")


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", "must be an object")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if "schema" not in fmt:
            raise _bad("text.format.schema", "required with type 'json_schema'")
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    raise _bad("text.format.type", f"{kind!r} is not supported (text, json_object, json_schema)")


def to_chat(req: ResponsesRequest, prior: list[dict], images: bool = False, drop: int = 0
            ) -> ChatCompletionRequest:
    """The chat request this Responses request is: `prior` (the stored conversation of
    previous_response_id) then the input, after `instructions` as a system message. `images`:
    the model reads images (input_image parts become image_url parts); `drop`: how many items
    of the conversation to leave out from its start (truncation "auto"), with the tool outputs
    that would then lead it."""
    items = prior + input_items(req)
    n = len(prior)
    while 0 < drop < len(items) - 1 and isinstance(items[drop], dict) and \
            items[drop].get("type") == "function_call_output":
        drop += 1
    msgs = item_messages(items[drop:], lambda i: "previous_response_id" if i + drop < n else
                         (f"input[{i + drop - n}]" if isinstance(req.input, list) else "input"),
                         images)
    if req.instructions:
        msgs.insert(0, {"role": "system", "content": req.instructions})
    if not msgs:
        raise _bad("input", "required (a string or a non-empty list of items)")
    tools = _tools(req.tools or [])
    choice, tools = _tool_choice(req.tool_choice, tools)
    if (req.reasoning or {}).get("effort") is not None and \
            not isinstance(req.reasoning["effort"], str):
        raise _bad("reasoning.effort", "must be a string")
    fields = dict(
        model=req.model, messages=msgs, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=tools or None, tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text),
        reasoning_effort=(req.reasoning or {}).get("effort"), user=req.user, seed=req.seed,
        stop=req.stop, frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos, logit_bias=req.logit_bias, cache_salt=req.cache_salt,
        chat_template_kwargs=req.chat_template_kwargs)
    if req.logprobs_included():
        fields.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items()
                                                 if v is not None})


_RENAMES = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
            ("response_format.json_schema.schema", "text.format.schema"),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("messages", "input"))


def renamed(e: APIError) -> APIError:
    """A chat error as the Responses request's field names it."""
    p = e.param
    if not p:
        return e
    new = p
    if p.startswith("tools[") and ".function" in p:
        new = p.replace(".function", "", 1)
    else:
        for old, to in _RENAMES:
            if p == old or p.startswith(old + ".") or p.startswith(old + "["):
                new = "input" if old == "messages" else to + p[len(old):]
                break
    if new == p:
        return e
    return APIError(e.status, e.message.replace(p, new, 1), param=new, code=e.code,
                    headers=e.headers)


def listed_item(it: dict, key: str) -> dict:
    """A conversation item as GET .../input_items lists it: an id (its own, else one made of
    `key`), a status, and a message's text as content parts."""
    kind = it.get("type", "message" if "role" in it else None)
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}.get(kind, "item")
    out = {**it, "id": it.get("id") or f"{prefix}_{key}", "type": kind,
           "status": it.get("status", "completed")}
    if kind == "message" and isinstance(it.get("content"), str):
        part = "output_text" if it.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": it["content"]} |
                          ({"annotations": []} if part == "output_text" else {})]
    return out


# ---- output ---------------------------------------------------------------------------------

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one response, built from a chat turn's parts; `feed` and `finish`
    return the stream events they add (without sequence_number). The whole (non-streamed)
    output goes through the same calls, so both are one rendering."""

    def __init__(self, namespaced: dict[str, tuple[str, str]] | None = None):
        """`namespaced`: function_tools'; a call of a flattened name goes out as its
        namespace's (namespace and name)."""
        self.namespaced = namespaced or {}
        self.items: list[dict] = []
        self.open: dict | None = None          # the item taking deltas
        self.calls: dict[int, dict] = {}       # tool call index -> its function_call item

    def _added(self, item: dict, part: dict | None) -> list[dict]:
        ev = self.close_open()
        item["status"] = "in_progress"
        self.items.append(item)
        self.open = item
        ev += [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
               "item": copy.deepcopy(item)}]
        if part is not None:
            item["content"].append(part)
            ev.append({"type": "response.content_part.added", "item_id": item["id"],
                       "output_index": len(self.items) - 1, "content_index": 0,
                       "part": dict(part)})
        return ev

    def _text(self, kind: str, text: str, logprobs: list[dict] | None = None) -> list[dict]:
        """`logprobs`: the LogProb entries of the tokens that wrote `text` (message text)."""
        ev = []
        item = self.open
        if item is None or item["type"] != kind:
            if kind == "message":
                ev += self._added({"id": _id("msg"), "type": "message", "role": "assistant",
                                   "content": []}, {"type": "output_text", "text": "",
                                                    "annotations": [], "logprobs": []})
            else:
                ev += self._added({"id": _id("rs"), "type": "reasoning", "summary": [],
                                   "content": []}, {"type": "reasoning_text", "text": ""})
            item = self.open
        part = item["content"][0]
        part["text"] += text
        if logprobs:      # a new list: the events copied the part before
            part["logprobs"] = part["logprobs"] + logprobs
        if not text:
            return ev
        e = {"type": "response.output_text.delta" if kind == "message" else
             "response.reasoning_text.delta", "item_id": item["id"],
             "output_index": len(self.items) - 1, "content_index": 0, "delta": text}
        if kind == "message":
            e["logprobs"] = event_logprobs(logprobs or [])
        return ev + [e]

    def feed(self, part: ChatPart, logprobs: list[dict] | None = None) -> list[dict]:
        """`logprobs`: those of a Text part's tokens."""
        match part:
            case Reasoning(text) if text:
                return self._text("reasoning", text)
            case Text(text) if text:
                return self._text("message", text, logprobs)
            case ToolCallStart(index, call_id, name):
                call = {"id": _id("fc"), "type": "function_call", "call_id": call_id,
                        "name": name, "arguments": ""}
                if name in self.namespaced:
                    call["namespace"], call["name"] = self.namespaced[name]
                ev = self._added(call, None)
                self.calls[index] = self.open
                return ev
            case ToolCallArgs(index, args) if args:
                item = self.calls[index]
                item["arguments"] += args
                return [{"type": "response.function_call_arguments.delta", "item_id": item["id"],
                         "output_index": self.items.index(item), "delta": args}]
        return []

    def close_open(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        i, ev = self.items.index(item), []
        if item["type"] == "function_call":
            ev.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                       "name": item["name"], "output_index": i, "arguments": item["arguments"]})
            status = "completed"       # a call cut off by max_tokens never became an item
        else:
            part = item["content"][0]
            done = {"type": "response.output_text.done" if item["type"] == "message" else
                    "response.reasoning_text.done", "item_id": item["id"], "output_index": i,
                    "content_index": 0, "text": part["text"]}
            if item["type"] == "message":
                done["logprobs"] = event_logprobs(part["logprobs"])
            ev += [done, {"type": "response.content_part.done", "item_id": item["id"],
                          "output_index": i, "content_index": 0, "part": dict(part)}]
        item["status"] = status
        return ev + [{"type": "response.output_item.done", "output_index": i,
                      "item": copy.deepcopy(item)}]

    def finish(self, truncated: bool) -> list[dict]:
        """The last events: an empty message when nothing else was said, the open item closed
        ("incomplete" when max_output_tokens cut it)."""
        ev = []
        if not any(it["type"] in ("message", "function_call") for it in self.items):
            ev += self._text("message", "")
        return ev + self.close_open("incomplete" if truncated else "completed")


def event_logprobs(entries: list[dict]) -> list[dict]:
    """LogProb entries (an output_text part's) as a text event carries them (the spec's
    ResponseLogProb: no bytes)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                              for t in e["top_logprobs"]]} for e in entries]


def response_usage(prompt: int, completion: int, cached: int) -> dict:
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def response_object(req: ResponsesRequest, rid: str, created: int, model: str, status: str,
                    output: list[dict], usage: dict | None = None) -> dict:
    """The spec's Response; `status`: queued, in_progress, completed, incomplete, failed or
    cancelled."""
    reasoning = None
    if req.reasoning:
        reasoning = {"effort": req.reasoning.get("effort"),
                     "summary": req.reasoning.get("summary")}
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None, "background": bool(req.background),
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls, "model": model, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": reasoning,
        "service_tier": "default", "store": req.store is not False,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": [{"type": "function", "name": t.get("name"),
                   "description": t.get("description"), "parameters": t.get("parameters"),
                   "strict": t.get("strict")} for t in function_tools(req.tools)[0]],
        "top_logprobs": req.top_logprobs or 0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
        "metadata": req.metadata or {},
    }
