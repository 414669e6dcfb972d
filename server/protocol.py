"""OpenAI request models (pydantic v2) and response builders, in the shapes of the official
OpenAI spec (CreateChatCompletionRequest/Response, CreateChatCompletionStreamResponse,
CreateCompletionRequest/Response, ListModelsResponse, ErrorResponse). Called by server/app.py.
Responses are plain dicts: they are built once per streamed chunk, and json.dumps of a dict is
the cheapest path; tests validate them against the spec's JSON schemas."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from maxjax.engine.types import MAX_TOP_LOGPROBS

SYSTEM_FINGERPRINT = "fp_maxjax"


class APIError(Exception):
    """An error the client caused (or a server failure), rendered as the OpenAI envelope."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error",
             404: "invalid_request_error", 405: "invalid_request_error",
             408: "invalid_request_error",
             413: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = APIError.TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Strict(BaseModel):
    """A request body: an unknown field is refused, and an explicit null takes the field's
    default (the spec's "integer or null, default 1": clients send null for what they leave
    unset)."""
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields
                or fields[k].is_required() or fields[k].default is None}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class _SamplingFields(_Strict):
    """Fields shared by chat and completions, including the vLLM-style extensions. Bounds are
    the OpenAI spec's (an early 400); they equal the SamplingParams declaration
    (maxjax/engine/types.py, checked by tests/test_sampling_params.py), whose validator is what
    enforces every limit, at admission."""
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-2**63, lt=2**63)     # any int64
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM names).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    # Structured output (server/structured.py): OpenAI's, vLLM's and vLLM's older names.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Spec fields accepted and ignored (they change nothing here).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream: true (as OpenAI and vLLM refuse it)")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)      # 0: refused below (completions' echo)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (server/tools.py).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # Spec fields we only accept at their "off" value (checked in unsupported()).
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a requested feature this server does not implement."""
        if self.modalities and set(self.modalities) != {"text"}:
            return "modalities", "only the 'text' modality is supported"
        if self.audio is not None:
            return "audio", "audio output is not supported"
        zero = next((f for f in ("max_completion_tokens", "max_tokens")
                     if getattr(self, f) == 0), None)
        if zero:
            return zero, "must be at least 1 (0 scores a prompt: /v1/completions with echo)"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs: true"
        return None


COMPLETION_MAX_TOKENS = 16     # OpenAI's default max_tokens for /v1/completions


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # None: COMPLETION_MAX_TOKENS, or what the longest prompt leaves of the maximum length;
    # 0 with echo: the prompt scored, nothing generated
    max_tokens: int | None = Field(None, ge=0)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "0 only with echo (the prompt scored, nothing generated)"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported by this server"
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", f"must be at least n ({self.n}; got {self.best_of})"
        if self.best_of is not None and self.best_of > self.n:
            return "best_of", "best_of greater than n is not supported"
        return None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    # with messages, what shapes a chat request's prompt
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)


class LoadLoraRequest(UnloadLoraRequest):
    lora_path: str = Field(min_length=1)


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a one-line 400 naming the field."""
    err = e.errors()[0]
    loc = err.get("loc", ())
    # Union members add type names to the location (e.g. "str", "list[int]"); drop them.
    parts = [p for p in loc if isinstance(p, int) or ("[" not in str(p) and str(p) not in
             ("str", "int", "float", "bool", "list", "dict", "function-after"))]
    param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
                    for i, p in enumerate(parts)) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field"
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


# ---- responses -------------------------------------------------------------------------------

def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_response(rid: str, model: str, created: int, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": use, "system_fingerprint": SYSTEM_FINGERPRINT,
            "service_tier": None}


def chat_choice(index: int, message: dict, finish_reason: str, logprobs: dict | None) -> dict:
    """`message`: content (and tool_calls, reasoning fields) from server/chat_output.py."""
    return {"index": index, "finish_reason": finish_reason, "logprobs": logprobs,
            "message": {"role": "assistant", **message, "refusal": None, "annotations": []}}


def chat_chunk(rid: str, model: str, created: int, choices: list[dict],
               use: dict | None = None, include_usage: bool = False) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices, "system_fingerprint": SYSTEM_FINGERPRINT}
    if include_usage:
        chunk["usage"] = use
    return chunk


def chat_chunk_choice(index: int, delta: dict, finish_reason: str | None = None,
                      logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(rid: str, model: str, created: int, choices: list[dict],
                        use: dict | None, include_usage: bool = True) -> dict:
    resp = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "system_fingerprint": SYSTEM_FINGERPRINT}
    if include_usage:
        resp["usage"] = use
    return resp


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def model_card(model_id: str, created: int, max_length: int, sampling_defaults: dict,
               parent: str | None = None, root: str | None = None) -> dict:
    """A /v1/models entry; a LoRA adapter's names its base model as `parent` (vLLM's fields);
    `sampling_defaults`: what requests that leave sampling fields out get (SamplingDefaults.
    in_force)."""
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "maxjax",
            "max_model_len": max_length, "root": root or model_id, "parent": parent,
            "sampling_defaults": sampling_defaults}
    return card
