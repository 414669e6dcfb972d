"""The typed output of one chat turn, the same for every API that speaks chat: what a choice's
text adds, in order (`Text`, `Reasoning`, `ToolCallStart` then `ToolCallArgs` per call), why it
ended (`Finish`), and the whole message (`ChatMessage`). server/chat_output.py makes them, each
API renders them into its own wire shape (server/chat_render.py for chat completions,
server/anthropic_api.py for Messages, server/responses_request.py for Responses); no API reads
another's wire format."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from maxjax.engine.types import FinishReason, TokenLogprob


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    args: dict          # the call's arguments as parsed from the output

    @classmethod
    def new(cls, name: str, args: dict) -> "ToolCall":
        return cls(f"call_{uuid.uuid4().hex[:24]}", name, args)

    @property
    def arguments(self) -> str:
        """The arguments as the JSON text the APIs send."""
        return json.dumps(self.args, ensure_ascii=False)


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int          # the call's place among the choice's calls
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    delta: str          # more of the call's arguments' JSON text (today: all of it, once)


ChatPart = Text | Reasoning | ToolCallStart | ToolCallArgs


@dataclass(frozen=True)
class Finish:
    """`reason`: what the APIs answer (STOP, LENGTH or TOOL_CALLS: a cut-off output is LENGTH
    even when it holds complete calls); `raw`: the engine's own reason."""
    reason: FinishReason
    raw: FinishReason

    @property
    def truncated(self) -> bool:
        return self.raw == FinishReason.LENGTH


@dataclass
class ChatMessage:
    """A choice's whole output: what the parts of its stream add up to."""
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ChoiceEvent:
    """What one engine output of choice `index` adds: its parts, the new tokens' logprobs (when
    asked), and the finish on the last."""
    index: int
    parts: list[ChatPart]
    logprobs: list[TokenLogprob] | None
    finish: Finish | None


@dataclass(frozen=True)
class FinalChoice:
    index: int
    message: ChatMessage
    finish: Finish
    logprobs: list[TokenLogprob]
