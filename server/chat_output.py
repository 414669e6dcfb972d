"""One chat choice's output text -> typed chat parts (server/chat_events.py), streamed or whole
by the same code: reasoning (server/reasoning.py) first, then tool calls (server/tools.py) in what
is content. `feed(text)` returns the parts new since the last call, `finish()` the rest;
`message()` the whole. So streamed parts reassemble to the whole message by construction.

Parts: Reasoning, Text, and per tool call a ToolCallStart followed by one ToolCallArgs. A call's
arguments go out whole, once the call is complete (partial-JSON diffs break clients). Text that
may be the start of a tool call is held back, so no partial tag reaches the content; if it turns
out not to be a call it goes out as content.
"""
from __future__ import annotations

from .chat_events import ChatMessage, ChatPart, Reasoning, Text, ToolCallArgs, ToolCallStart
from .reasoning import ReasoningStream, _held
from .tools import marker, parse_calls, partial_calls, starts_anywhere


class ChatOutput:
    def __init__(self, reasoning_parser: str | None = None, tool_parser: str | None = None,
                 prompt_text: str = "", tool_names: set[str] | None = None,
                 partial_calls: bool = False):
        self.reasoning = ReasoningStream(reasoning_parser, prompt_text) if reasoning_parser \
            else None
        self.tool_parser = tool_parser
        self.tool_names = tool_names      # calls naming another function are not calls
        self.partial_calls = partial_calls    # a cut-off call is kept (what parses of it)
        self.content, self.reasoning_text, self.tool_calls = "", "", []
        self._pending = ""          # content not yet sent: a possible marker, or the calls
        self._in_calls = False
        self._sent_calls = 0

    def feed(self, text: str, final: bool = False, truncated: bool = False) -> list[ChatPart]:
        parts = []
        if self.reasoning is not None:
            r, text = self.reasoning.feed(text, final)
            if r:
                self.reasoning_text += r
                parts.append(Reasoning(r))
        if self.tool_parser is None:
            if text:
                self.content += text
                parts.append(Text(text))
            return parts
        self._pending += text
        out = self._content_part(final)
        if out:
            self.content += out
            parts.append(Text(out))
        if self._in_calls:
            parts += self._call_parts(final, truncated)
        return parts

    def finish(self, truncated: bool = False) -> list[ChatPart]:
        """The rest; `truncated`: the output was cut (max_tokens), so an unfinished call at its
        end is dropped (kept as far as it parses, with `partial_calls`), never sent as
        content."""
        return self.feed("", final=True, truncated=truncated)

    def message(self) -> ChatMessage:
        return ChatMessage(self.content, self.reasoning_text, list(self.tool_calls))

    # ---- tool calls in the content ----------------------------------------------------------
    def _content_part(self, final: bool) -> str:
        """The pending text that is surely content; the rest stays pending."""
        if self._in_calls:
            return ""
        p, m = self.tool_parser, marker(self.tool_parser)
        if starts_anywhere(p):
            i = self._pending.find(m)
            if i >= 0:
                out, self._pending, self._in_calls = self._pending[:i], self._pending[i:], True
                return out
            keep = 0 if final else _held(self._pending, m)
        else:       # the calls are the whole output: decided by its first characters
            head = self._pending.lstrip()
            tag = "<|python_tag|>"
            if p == "llama3_json" and head.startswith(tag):
                head = head[len(tag):].lstrip()
            if head.startswith(m):
                self._in_calls = True
                return ""
            if not final and (not head or (p == "llama3_json" and tag.startswith(head))):
                return ""             # undecided yet
            self.tool_parser, keep = None, 0      # plain content from here on
        out = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(out):]
        return out

    def _call_parts(self, final: bool, truncated: bool = False) -> list[ChatPart]:
        if not final and self.tool_parser != "hermes":
            return []                 # whole-output formats are parsed at the end
        text = self._pending
        if final and truncated and self.partial_calls:
            calls = partial_calls(self.tool_parser, text, self.tool_names)
        else:
            if not final or (truncated and self.tool_parser == "hermes"):   # the calls closed
                end = text.rfind("</tool_call>")
                text = text[:end + len("</tool_call>")] if end >= 0 else ""
            calls = parse_calls(self.tool_parser, text) if text else None
        if calls and self.tool_names is not None and any(
                c.name not in self.tool_names for c in calls):
            calls = None
        if calls is None:
            if final and not truncated:   # not calls after all: it was content
                self.content += self._pending
                out, self._pending = self._pending, ""
                return [Text(out)] if out else []
            if final:
                self._pending = ""
            return []
        parts = []
        for call in calls[self._sent_calls:]:
            if any((c.name, c.arguments) == (call.name, call.arguments)
                   for c in self.tool_calls):
                continue      # the same call again in one turn (small models repeat) adds nothing
            i = len(self.tool_calls)
            self.tool_calls.append(call)
            parts += [ToolCallStart(i, call.id, call.name), ToolCallArgs(i, call.arguments)]
        self._sent_calls = len(calls)
        if final:
            self._pending = ""
        return parts
