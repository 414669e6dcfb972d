"""Server settings (`ServeConfig`): HTTP binding, auth, admission limits and request defaults.
The CLI (maxjax/cli/main.py) builds its argparse flags from these fields and their `help` metadata;
server/app.py reads them."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from maxjax.errors import UserError

API_KEY_ENV = "MAXJAX_API_KEY"
HOST_ENV, PORT_ENV = "MAX_SERVE_HOST", "MAX_SERVE_PORT"


def _env_host() -> str:
    return os.environ.get(HOST_ENV) or "127.0.0.1"


def _env_port() -> int:
    text = os.environ.get(PORT_ENV) or "8000"
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{PORT_ENV}={text}: not a port number") from None


@dataclass
class ServeConfig:
    host: str = field(default_factory=_env_host, metadata={
        "help": f"Interface to bind the HTTP API to (default: ${HOST_ENV}, else 127.0.0.1: only "
                f"this machine can reach a server nobody chose to expose; in a container "
                f"pass --host 0.0.0.0)"})
    port: int = field(default_factory=_env_port, metadata={
        "help": f"Port for the HTTP API (default: ${PORT_ENV}, else 8000)"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "Model id clients send and /v1/models reports (default: the model's name)"})
    api_key: str | None = field(default=None, metadata={
        "help": f"Require `Authorization: Bearer KEY` on every route but /health and the web "
                f"UI's static page (default: ${API_KEY_ENV} if set)"})
    max_queue_size: int | None = field(default=None, metadata={
        "help": "Cap on requests waiting for their first token; beyond it new requests get "
                "HTTP 429 with Retry-After (default: unbounded)"})
    max_pending_requests: int | None = field(default=None, metadata={
        "help": "Cap on the scheduler's pending (not yet running) requests: the engine takes "
                "no more from its request queue while it holds this many, so the queue backs up "
                "(no request is refused for it; --max-queue-size answers 429). Should be at "
                "least --max-batch-size (default: unbounded)"})
    enable_echo: bool = field(default=True, metadata={
        "help": "Serve /v1/completions' echo (the prompt before the completion, with its "
                "logprobs when asked; --no-...: a request with echo gets a 400)"})
    allow_unsupported_logprobs: bool = field(default=False, metadata={
        "help": "A request asking for logprobs where the server cannot return them is "
                "served without them instead of a 400 (MAX's flag; every route returns the "
                "logprobs it is asked for now, so it changes nothing)"})
    allow_extra_request_fields: bool = field(default=False, metadata={
        "help": "Drop unknown top-level request fields with a warning instead of answering 400"})
    temperature: float | None = field(default=None, metadata={
        "help": "Default sampling temperature for requests that do not set one, over the "
                "model's (default: --generation-config's)"})
    top_k: int | None = field(default=None, metadata={
        "help": "Default top-k for requests that do not set one, over the model's (default: "
                "--generation-config's)"})
    max_request_body_bytes: int = field(default=8 * 1024 * 1024, metadata={
        "help": "Largest accepted request body; larger ones get HTTP 413"})
    http_idle_timeout: float = field(default=15.0, metadata={
        "help": "Seconds a connection may stay open without sending a complete request head "
                "(idle keep-alive, or half-sent headers) before it is closed"})
    http_body_timeout: float = field(default=30.0, metadata={
        "help": "Seconds a client may take to send a request body before it gets HTTP 408"})
    http_write_timeout: float = field(default=60.0, metadata={
        "help": "Seconds a streamed response may wait on a client that reads nothing before "
                "the connection is cut (and its requests aborted)"})
    shutdown_grace_period: float = field(default=30.0, metadata={
        "help": "Seconds in-flight requests may run after SIGTERM/SIGINT before they are cut"})

    disable_log_requests: bool = field(default=False, metadata={
        "help": "No access log line per request (vLLM's flag). By default each request ends "
                "with one line on the maxjax.access logger: client, method and path, status, "
                "model, prompt, completion and cached tokens, time to first token, duration "
                "(499: the client went away)"})

    models_file: str | None = field(default=None, metadata={
        "help": "YAML or JSON file of the models one server serves: a list of {name, model, any "
                "model or engine flag, tool_parser, reasoning_parser}, each its own engine, "
                "picked by a request's \"model\" (or repeat --model; docs/serving.md)"})
    max_loaded_models: int | None = field(default=None, metadata={
        "help": "With several models: how many stay loaded at once; a request for another "
                "unloads the least recently used one once its requests have finished "
                "(default: all of them)"})
    models_memory_budget: str | None = field(default=None, metadata={
        "help": "With several models: the memory the loaded models may hold together (their "
                "planned weights, KV and state pools), e.g. 12G; a request for a model that "
                "does not fit unloads the least recently used ones once their requests have "
                "finished (default: the free memory at start x --device-memory-utilization)"})

    webui: bool = field(default=True, metadata={
        "help": "Serve the browser playground and engine dashboard at / (--no-webui: / is a 404; "
                "/stats and /stats/stream stay)"})

    tool_parser: str | None = field(default=None, metadata={
        "choices": ["hermes", "llama3_json", "mistral", "pythonic", "none"], "any_case": True,
        "help": "Tool-call format parsed out of chat outputs (default: chosen from the chat "
                "template: mistral, llama3_json, else hermes; none: tools get a 400)"})
    enable_tool_call_constrained_decode: bool = field(default=True, metadata={
        "help": "Force tool_choice required / a named function with a grammar in the tool "
                "parser's format, so the call's arguments match the tool's schema"})
    reasoning_parser: str | None = field(default=None, metadata={
        "choices": ["qwen3", "deepseek_r1", "none"], "any_case": True,
        "help": "Split <think>...</think> out of chat outputs into the reasoning field "
                "(default: none)"})
    emit_reasoning_content: bool | None = field(default=None, metadata={
        "help": "Reasoning under reasoning_content only (--no-...: under reasoning only; "
                "default: both)"})

    max_images_per_request: int = field(default=8, metadata={
        "help": "Images one request may hold (image_url content parts), for a model that reads "
                "images"})
    max_image_bytes: int = field(default=20 * 1024 * 1024, metadata={
        "help": "Largest image file a request may send, in bytes"})
    max_image_pixels: int = field(default=40_000_000, metadata={
        "help": "Largest image a request may send, in pixels (width x height), checked before "
                "it is decoded"})
    allowed_local_media_path: str | None = field(default=None, metadata={
        "help": "A directory whose image files requests may name (file: URLs or paths); unset: "
                "images come only as data: URLs. Remote URLs are never fetched"})

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port {self.port}: a port is 0-65535 (0: any free one)")
        for name in ("max_images_per_request", "max_image_bytes", "max_image_pixels",
                     "max_request_body_bytes"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1 "
                                f"(got {getattr(self, name)})")
        for name in ("http_idle_timeout", "http_body_timeout", "http_write_timeout"):
            if not getattr(self, name) > 0:
                raise UserError(f"--{name.replace('_', '-')} must be > 0 seconds "
                                f"(got {getattr(self, name)})")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise UserError(f"--max-loaded-models must be >= 1 (got {self.max_loaded_models})")
        if self.models_memory_budget is not None:
            from maxjax.aot.cache import size_bytes
            if size_bytes(self.models_memory_budget, "--models-memory-budget") < 1:
                raise UserError("--models-memory-budget must be more than 0 bytes")
        for name in ("max_queue_size", "max_pending_requests", "shutdown_grace_period"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be >= 0 "
                                f"(got {getattr(self, name)})")

    def reasoning_fields(self) -> tuple[str, ...]:
        return {None: ("reasoning_content", "reasoning"), True: ("reasoning_content",),
                False: ("reasoning",)}[self.emit_reasoning_content]

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None
