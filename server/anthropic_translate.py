"""Anthropic Messages requests (POST /v1/messages, /v1/messages/count_tokens) -> the one request
model every chat API runs on, `ChatCompletionRequest`: system prompt, content blocks (text,
tool_use, tool_result; thinking dropped), tools and tool_choice, stop_sequences, thinking on/off,
output_config.format, context_management. Server tools (web search, code execution: Anthropic
runs them) are left out (`server_tools` names them for the route's X-Dropped-Tools header),
unless tool_choice names one. What this server cannot serve (document blocks, a final assistant
message to continue) is a 400 naming the field. Also the way back for errors: an
error below the route names OpenAI's field (`stop`, `tools[0].function.parameters`), renamed
here to the Anthropic one. Used by server/anthropic_api.py."""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .protocol import APIError, ChatCompletionRequest, validation_error


def _bad(param: str, reason: str) -> APIError:
    return APIError(400, f"{param}: {reason}", param=param)


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    """The fields that shape the prompt (count_tokens takes only these)."""
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # Accepted and ignored: prompt caching is automatic here (the prefix cache).
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    context_management: dict[str, Any] | None = None     # checked by _context_management

    def unsupported(self) -> None:      # openai_routes._accept's hook; to_chat refuses instead
        return None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    # Accepted and ignored.
    metadata: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None


# ---- content -------------------------------------------------------------------------------

_UNSERVED = {"document": "document input",
             "search_result": "search results", "container_upload": "container uploads"}


def _refuse_block(param: str, kind) -> APIError:
    what = _UNSERVED.get(kind) if isinstance(kind, str) else None
    if what:
        return _bad(f"{param}.type", f"{what} ({kind!r} blocks) is not supported by this server")
    return _bad(f"{param}.type", f"content block type {kind!r} is not supported here (text, "
                                 "image, tool_use, tool_result and thinking are)")


def _image_part(block: dict, param: str) -> dict:
    """An image block as a chat `image_url` part: base64 as a data: URL (a url source stays a
    URL, which the chat path refuses: nothing is fetched)."""
    src = block.get("source")
    if isinstance(src, dict) and src.get("type") == "base64" and \
            isinstance(src.get("data"), str) and isinstance(src.get("media_type"), str):
        url = f"data:{src['media_type']};base64,{src['data']}"
    elif isinstance(src, dict) and src.get("type") == "url" and isinstance(src.get("url"), str):
        url = src["url"]
    else:
        raise _bad(f"{param}.source", "an image block needs a base64 source (type, media_type, "
                                      "data) or a url source")
    return {"type": "image_url", "image_url": {"url": url}}


def _user_content(parts: list) -> str | list:
    """A user message's content: its texts joined, or (with an image) chat content parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _text(block: dict, param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise _bad(f"{param}.text", "a text block needs a string 'text'")
    return block["text"]


def _texts(content, param: str) -> str:
    """A string, or text blocks joined (a system prompt, a tool result)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(param, "must be a string or a list of text blocks")
    out = []
    for k, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise _refuse_block(f"{param}[{k}]", b.get("type") if isinstance(b, dict) else None)
        out.append(_text(b, f"{param}[{k}]"))
    return "\n".join(out)


def _user(m: AnthropicMessage, i: int) -> list[dict]:
    """A user turn: its text as a user message, each tool_result as a tool message, in order."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out, texts = [], []
    for j, b in enumerate(m.content):
        p = f"messages[{i}].content[{j}]"
        kind = b.get("type")
        if kind == "text":
            texts.append({"type": "text", "text": _text(b, p)})
        elif kind == "image":
            texts.append(_image_part(b, p))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": _user_content(texts)})
                texts = []
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad(f"{p}.tool_use_id", "a tool_result block needs the tool_use id")
            result = _texts(b.get("content"), f"{p}.content")
            if b.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
        else:
            raise _refuse_block(p, kind)
    if texts or not out:
        out.append({"role": "user", "content": _user_content(texts)})
    return out


def _assistant(m: AnthropicMessage, i: int) -> dict:
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    texts, calls = [], []
    for j, b in enumerate(m.content):
        p = f"messages[{i}].content[{j}]"
        kind = b.get("type")
        if kind == "text":
            texts.append(_text(b, p))
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise _bad(p, "a tool_use block needs a string id and name")
            if not isinstance(b.get("input", {}), dict):
                raise _bad(f"{p}.input", "must be an object")
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b.get("input", {}),
                                                           ensure_ascii=False)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue     # earlier reasoning is not shown to the model again
        else:
            raise _refuse_block(p, kind)
    msg = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(req: CountTokensRequest) -> list[dict]:
    out = []
    system = _texts(req.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if m.role == "system":
            out.append({"role": "system", "content": _texts(m.content, f"messages[{i}].content")})
        elif m.role == "user":
            out += _user(m, i)
        else:
            out.append(_assistant(m, i))
    if req.messages[-1].role == "assistant":
        raise _bad(f"messages[{len(req.messages) - 1}].role", "a final assistant message "
                   "(prefill, to be continued) is not supported by this server; end with a "
                   "user message")
    return out


# ---- tools, thinking, output format ----------------------------------------------------------

# Tools Anthropic runs itself (versioned type names); Anthropic-defined client tools (bash,
# text_editor, computer, memory) are not among them and stay a 400.
_SERVER_TOOLS = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_",
                 "mcp_toolset")


def _server_tool(t) -> bool:
    return isinstance(t, dict) and isinstance(t.get("type"), str) and \
        t["type"].startswith(_SERVER_TOOLS)


def server_tools(req: CountTokensRequest) -> list[str]:
    """The server tools of the request, left out of its prompt: `tools[i] (type)`."""
    return [f"tools[{i}] ({t['type']})" for i, t in enumerate(req.tools or [])
            if _server_tool(t)]


def _tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type")
        if _server_tool(t):
            continue
        if kind not in (None, "custom"):
            raise _bad(f"tools[{i}].type", f"server tools ({kind!r}) are not supported by "
                                           "this server; only custom tools are")
        if "input_schema" not in t:
            raise _bad(f"tools[{i}].input_schema", "required")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice: dict | None, tools: list | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    if choice.get("type") == "tool" and any(_server_tool(t) and t.get("name") == choice.get(
            "name") for t in tools or []):
        raise _bad("tool_choice.name", f"{choice['name']!r} is a server tool (Anthropic runs "
                                       "it); this server cannot run it")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice.name", "required with type 'tool'")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad("tool_choice.type", f"{kind!r}: must be auto, any, tool or none")


def _thinking(thinking: dict | None) -> dict | None:
    """chat_template_kwargs: enable_thinking for templates that read it (Qwen3's); the budget
    cannot be enforced and is ignored. The reasoning itself comes from --reasoning-parser."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if type(budget) is not int or budget < 1:
            raise _bad("thinking.budget_tokens", "a positive integer is required with "
                                                 "type 'enabled'")
        return {"enable_thinking": True}
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind == "adaptive":
        return None
    raise _bad("thinking.type", f"{kind!r}: must be enabled, disabled or adaptive")


_CONTEXT_EDITS = ("clear_thinking_20251015", "clear_tool_uses_20250919")


def _context_management(cm: dict | None) -> None:
    """Checked, not applied: earlier thinking never reaches the prompt here (clear_thinking is
    always in effect); clear_tool_uses is accepted as a context-window strategy the server
    does not run (a prompt that does not fit is a 400 saying what to change)."""
    if cm is None:
        return
    edits = cm.get("edits", [])
    if not isinstance(edits, list):
        raise _bad("context_management.edits", "must be a list")
    for i, e in enumerate(edits):
        kind = e.get("type") if isinstance(e, dict) else None
        if kind not in _CONTEXT_EDITS:
            raise _bad(f"context_management.edits[{i}].type",
                       f"{kind!r}: must be one of {', '.join(_CONTEXT_EDITS)}")


def _response_format(cfg: dict | None) -> dict | None:
    fmt = (cfg or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise _bad("output_config.format.type", "only 'json_schema' is supported")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema":
                                                   fmt.get("schema")}}


def to_chat(req: CountTokensRequest) -> ChatCompletionRequest:
    """The request as a ChatCompletionRequest (the model is checked by the route, not here)."""
    _context_management(req.context_management)
    choice, parallel = _tool_choice(req.tool_choice, req.tools)
    body = {"messages": _messages(req), "tools": _tools(req.tools), "tool_choice": choice,
            "parallel_tool_calls": parallel, "chat_template_kwargs": _thinking(req.thinking),
            "response_format": _response_format(req.output_config)}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items()
                                                     if v is not None})
    except ValidationError as e:
        raise anthropic_names(validation_error(e)) from None


# ---- errors, with Anthropic's field names ------------------------------------------------------

_RENAMES = [(r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
            (r"^tools\[(\d+)\]\.function\.name", r"tools[\1].name"),
            (r"^tools\[(\d+)\]\.function", r"tools[\1]"),
            (r"^stop\b", "stop_sequences"), (r"^max_completion_tokens\b", "max_tokens"),
            (r"^response_format(\.json_schema)?(\.schema)?", "output_config.format.schema")]


def anthropic_names(e: APIError) -> APIError:
    """`e` with the field it names (and its message's leading name) as the Anthropic request
    calls it."""
    new = e.param
    for pat, rep in _RENAMES:
        new = re.sub(pat, rep, new or "")
    msg = new + e.message[len(e.param):] if e.param and e.message.startswith(e.param) \
        else e.message
    msg = msg.replace("tool_choice 'required'", "tool_choice 'any'")
    if (new or None, msg) == (e.param, e.message):
        return e
    return APIError(e.status, msg, new or None, e.code, e.headers)


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               504: "timeout_error", 529: "overloaded_error"}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """Anthropic's error envelope (plus this server's `param` and `code`, when set)."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    err = {"type": kind, "message": message}
    if param is not None:
        err["param"] = param
    if code is not None:
        err["code"] = code
    return {"type": "error", "error": err}
