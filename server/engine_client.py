"""The interface between the HTTP server and an engine (the real one in maxjax/engine/, or
tests/mock_engine.py). The server codes only against `EngineClient`."""
from __future__ import annotations

from typing import Any, AsyncIterator, Protocol, runtime_checkable

from maxjax.engine.stats import EngineStats
from maxjax.engine.types import RequestOutput, SamplingParams
from maxjax.errors import QueueFullError  # noqa: F401  (re-exported for the server)



@runtime_checkable
class EngineClient(Protocol):
    model_name: str            # model id reported by /v1/models (served-model-name)
    tokenizer: Any             # a transformers tokenizer: encode/decode, apply_chat_template
    chat_template: str | None  # None: the model has no template (chat requests get a 400)
    max_length: int            # prompt tokens + max_tokens must fit
    is_ready: bool             # False while loading/compiling: /health answers 503
    # Optional `vision`: an image-text model's VisionModel (maxjax/models/vision.py), whose
    # `generate` then takes `images=` (ImageInputs of the prompt's placeholder runs).
    # Optional `sampling_defaults`: the model's SamplingDefaults (maxjax/models/
    # sampling_defaults.py) for requests that leave sampling fields out; without it, OpenAI's.

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 cache_salt: str | None = None,
                 lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs: each RequestOutput holds the tokens (and their
        detokenized text, stop strings already applied and excluded) new since the last one; the
        last has finished=True and a FinishReason (STOP, LENGTH, ABORT, ERROR, GRAMMAR_ERROR).
        Raises ValueError (bad params; the message names the field) or QueueFullError, either
        when called or on the first iteration. Closing or cancelling the iteration before the
        last output must abort the request (free its pages). `lora`: a loaded adapter's name."""
        ...

    async def embed(self, request_id: str, prompt_token_ids: list[int],
                    pooling_type: str | None = None, lora: str | None = None) -> list[float]:
        """The prompt's embedding: its final hidden states pooled by `pooling_type` ("last" |
        "mean"; None: the engine's --pooling-type), normalized as --pool-embeddings says,
        prefilled beside the generation requests and sampling nothing. RequestError naming the
        field ("prompt", "pooling_type") or QueueFullError; cancelling the call aborts the
        request (frees its pages)."""
        ...

    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters served: name -> the path it was loaded from."""
        ...

    async def load_lora(self, name: str, path: str) -> None:
        """RequestError naming the field (lora_name, lora_path) when it cannot be loaded."""
        ...

    async def unload_lora(self, name: str) -> None:
        """New requests naming it are refused at once; returns when the unfinished ones using
        it have ended. RequestError (lora_name) when unknown, or when they have not ended
        within the engine's --lora-unload-timeout."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages; a no-op for unknown or finished requests."""
        ...

    def stats(self) -> EngineStats:
        """Counters and gauges read at /metrics scrape time."""
        ...

    def info(self) -> dict:
        """What does not change while serving, for the dashboard: model, max_length, page_size,
        num_pages, buckets (names), structured_output (bool), engine_config (flat dict),
        hidden_size (the embeddings' width), kernels (what runs in the CPU kernels: isa, linear,
        attention; None without them)."""
        ...
