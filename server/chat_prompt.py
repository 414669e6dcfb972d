"""Chat messages -> prompt token ids, through the model's chat template (sandboxed jinja, in the
tokenizer thread): content parts joined, `tools` passed to the template, assistant `tool_calls`
(arguments as objects, as templates expect) and `role: "tool"` messages rendered for the next
turn, `chat_template_kwargs` (e.g. enable_thinking) passed on. A template that ignores `tools`
(SmolLM2's does) gets the tools as a system prompt in the tool parser's format
(server/tools.py), and earlier tool calls as text in that format."""
from __future__ import annotations

import functools

from .images import ImagePart, part_url, read_images
from .protocol import APIError
from .tools import arguments, format_calls, template_tool_calls, tool_prompt

_RESERVED = {"messages", "tools", "add_generation_prompt", "chat_template", "tokenize",
             "return_dict", "documents"}
_PROBE = [{"type": "function", "function": {"name": "maxjax_probe_tool", "parameters": {}}}]


def template_messages(messages, calls_as_text: str | None = None,
                      images: list | None = None) -> list[dict]:
    """Messages as the dicts a chat template expects. `calls_as_text`: a tool parser whose
    format assistant tool_calls are written in, inside the content. `images`: a list that
    collects the request's `image_url` parts (server/images.py ImagePart), in order; a message
    with one keeps its content as parts ({"type": "text"} and {"type": "image"}), as image-text
    templates expect; None: image parts are refused (the model reads no images)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None and m.role != "assistant":
            raise APIError(400, f"messages[{i}].content: required for role {m.role!r}",
                           param=f"messages[{i}].content")
        if isinstance(content, list):
            content = _content_parts(content, i, images)
        msg = {"role": m.role, "content": content if content is not None else ""}
        for key in ("name", "tool_call_id"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        if m.tool_calls:
            bad = next((j for j, c in enumerate(m.tool_calls) if not isinstance(
                c.get("function"), dict) or not isinstance(c["function"].get("name"), str)), None)
            if bad is not None:
                raise APIError(400, f"messages[{i}].tool_calls[{bad}].function: needs a name",
                               param=f"messages[{i}].tool_calls[{bad}].function")
            calls = [{**c, "function": {**c["function"], "arguments": arguments(
                c["function"].get("arguments"), f"messages[{i}].tool_calls[{j}].function."
                "arguments")}} for j, c in enumerate(m.tool_calls)]
            if calls_as_text:
                text = format_calls(calls_as_text, calls)
                msg["content"] = f"{msg['content']}\n{text}" if msg["content"] else text
            else:
                msg["tool_calls"] = template_tool_calls(calls)
        out.append(msg)
    return out


def _content_parts(content: list, i: int, images: list | None):
    """A message's content parts: their texts joined, or (with an image) the parts."""
    parts = []
    for j, part in enumerate(content):
        kind, param = part.get("type"), f"messages[{i}].content[{j}]"
        if kind == "image_url" and images is not None:
            images.append(ImagePart(param, part_url(part, param)))
            parts.append({"type": "image"})
            continue
        if kind != "text" or not isinstance(part.get("text"), str):
            what = ("a text part needs a string 'text'" if kind == "text" else
                    "image_url: this model does not read images" if kind == "image_url" else
                    f"content part type {kind!r} is not supported (only 'text'"
                    f"{' and image_url' if images is not None else ''})")
            raise APIError(400, f"{param}: {what}", param=f"{param}.type")
        parts.append({"type": "text", "text": part["text"]})
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _render_text(tokenizer, template: str, messages: list[dict], add_generation_prompt: bool,
                 tools=None, kwargs=None) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         tools=tools, **(kwargs or {}))


def render_chat(tokenizer, template: str, messages: list[dict], add_generation_prompt: bool,
                tools=None, kwargs=None, with_text: bool = False, fits=None, expand=None):
    """Runs in the tokenizer thread: the prompt's token ids (and text, `with_text`). `fits`:
    ServerState.check_fits, called on the rendered text before it is tokenized; `expand`:
    text -> text with each image's placeholder tokens (an image-text model's)."""
    import jinja2
    try:
        text = _render_text(tokenizer, template, messages, add_generation_prompt, tools, kwargs)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
        raise APIError(400, f"messages: the chat template rejected them: {e}",
                       param="messages") from None
    if expand is not None:
        try:
            text = expand(text)
        except ValueError as e:       # the template placed a different number of images
            raise APIError(400, f"messages: {e}", param="messages") from None
    if fits is not None:
        fits(text, "messages")
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (ids, text) if with_text else ids


@functools.lru_cache(maxsize=8)
def template_ignores_tools(tokenizer, template: str) -> bool:
    """True when the template renders the same prompt with and without `tools`."""
    msgs = [{"role": "user", "content": "hi"}]
    try:
        return (_render_text(tokenizer, template, msgs, True, _PROBE)
                == _render_text(tokenizer, template, msgs, True))
    except Exception:
        return True


def with_tool_prompt(messages: list[dict], parser: str, tools: list[dict]) -> list[dict]:
    """The tool prompt in (or as) the first system message."""
    prompt = tool_prompt(parser, tools)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}")
        return [first] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages


def chat_template_kwargs(req) -> dict:
    kwargs = dict(req.chat_template_kwargs or {})
    bad = sorted(set(kwargs) & _RESERVED)
    if bad:
        raise APIError(400, f"chat_template_kwargs.{bad[0]}: set by the request itself",
                       param=f"chat_template_kwargs.{bad[0]}")
    return kwargs


async def chat_prompt(st, req, tools) -> tuple[list[int], str, list]:
    """(prompt token ids, prompt text, its images' ImageInputs) of a chat request; `tools`: its
    ToolSetup or None."""
    engine = st.engine
    if engine.chat_template is None:
        raise APIError(400, "this model has no chat template: use /v1/completions, or start the "
                            "server with --chat-template FILE", param="messages")
    kwargs = chat_template_kwargs(req)
    parser = tools.parser if tools else st.tool_parser
    ignores = await st.in_tokenizer_thread(template_ignores_tools, engine.tokenizer,
                                           engine.chat_template)
    vision = getattr(engine, "vision", None)
    parts: list | None = [] if vision is not None else None
    msgs = template_messages(req.messages, parser if ignores and parser else None, parts)
    if tools and ignores:
        msgs = with_tool_prompt(msgs, tools.parser, tools.tools)
    images = await st.in_tokenizer_thread(read_images, vision, parts, st.cfg) if parts else []
    expand = None
    if images:
        expand = functools.partial(vision.spec.expand_prompt, vision.config, engine.tokenizer,
                                   images=[im.features for im in images])
    ids, text = await st.in_tokenizer_thread(render_chat, engine.tokenizer, engine.chat_template,
                                             msgs, req.add_generation_prompt,
                                             None if (ignores or not tools) else tools.tools,
                                             kwargs, True, st.check_fits, expand)
    return ids, text, images
