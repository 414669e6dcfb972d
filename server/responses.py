"""The shapes of the server's response bodies, declared once as TypedDicts: the builders in
server/protocol.py return them, and server/openapi.py turns them (with the pydantic request
models) into GET /openapi.json. tests/test_openapi.py checks real responses against both this
description and the official OpenAI schemas."""
from __future__ import annotations

from typing import Any, Literal

from typing_extensions import NotRequired, TypedDict


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


class ToolCallFunction(TypedDict):
    name: NotRequired[str]
    arguments: str


class ToolCall(TypedDict):
    index: NotRequired[int]
    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: ToolCallFunction


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[TokenLogprobEntry] | None
    refusal: None


class ChatMessageOut(TypedDict):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    annotations: list[Any]
    tool_calls: NotRequired[list[ToolCall]]
    reasoning_content: NotRequired[str]
    reasoning: NotRequired[str]


class ChatChoiceOut(TypedDict):
    index: int
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChatLogprobs | None
    message: ChatMessageOut


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoiceOut]
    usage: Usage
    system_fingerprint: str
    service_tier: None


class ChatDelta(TypedDict, total=False):
    role: Literal["assistant"]
    content: str
    tool_calls: list[ToolCall]
    reasoning_content: str
    reasoning: str


class ChatChunkChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(TypedDict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str
    usage: NotRequired[Usage | None]


class CompletionLogprobsOut(TypedDict):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoiceOut(TypedDict):
    index: int
    text: str
    logprobs: CompletionLogprobsOut | None
    finish_reason: Literal["stop", "length"] | None


class Completion(TypedDict):
    """A non-streamed completion, and (finish_reason null until the last, usage only in the
    final usage chunk) each streamed chunk."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoiceOut]
    system_fingerprint: str
    usage: NotRequired[Usage | None]


class SamplingDefaults(TypedDict):
    """What a request that leaves these fields out is sampled with (--generation-config,
    --temperature, --top-k), and where they came from."""
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    source: str


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str
    parent: str | None
    sampling_defaults: SamplingDefaults


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(TypedDict):
    error: ErrorDetail


class Health(TypedDict):
    status: Literal["ok", "loading", "failed"]


class TokenizeResponse(TypedDict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(TypedDict):
    prompt: str
