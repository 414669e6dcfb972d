"""Per-app shared state (engine, config, metrics, tokenizer helpers) that the route modules read
from `request.app[STATE]`. Built by server/app.py:build_app."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel, ValidationError

from maxjax.engine.validate import length_advice

from . import access_log, json_body
from .config import ServeConfig
from .engine_client import EngineClient
from .generation import AdmissionState
from .metrics import ServerMetrics
from .protocol import APIError, validation_error

log = logging.getLogger("maxjax.server")


@dataclass
class ServerState:
    engine: EngineClient
    cfg: ServeConfig
    metrics: ServerMetrics
    admission: AdmissionState
    created: int
    # One thread: HF fast tokenizers are not safe to use from several threads at once, and a
    # long prompt's template + encode must not block the event loop.
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="maxjax-tokenize"))

    # The engine may still be loading when the app is built (its tokenizer and name appear once
    # is_ready), so everything derived from them is read on first use.
    @property
    def model_id(self) -> str:
        return self.cfg.served_model_name or self.engine.model_name

    @cached_property
    def vocab_size(self) -> int:
        return len(self.engine.tokenizer)

    @cached_property
    def _token_str(self):
        tok = self.engine.tokenizer
        return lru_cache(maxsize=65536)(lambda tid: tok.decode([tid], skip_special_tokens=False))

    @cached_property
    def tool_parser(self) -> str | None:
        """--tool-parser, else the one the chat template speaks; None: tool calling off."""
        from .tools import default_parser
        name = self.cfg.tool_parser or default_parser(self.engine.chat_template)
        return None if name == "none" else name

    @property
    def sampling_defaults(self):
        """What a request that leaves a sampling field out gets: --temperature and --top-k over
        the model's (--generation-config; read after the engine is ready, so not cached)."""
        from maxjax.models.sampling_defaults import SamplingDefaults
        model = getattr(self.engine, "sampling_defaults", None) or SamplingDefaults()
        return model.over(temperature=self.cfg.temperature, top_k=self.cfg.top_k)

    @property
    def reasoning_parser(self) -> str | None:
        name = self.cfg.reasoning_parser
        return None if name in (None, "none") else name

    @cached_property
    def max_prompt_chars(self) -> int:
        """No token is longer than the vocabulary's longest, so a text with more non-space
        characters than max_length times that cannot fit: it is refused before tokenizing
        (an 8 MB prompt would hold the one tokenizer thread for half a minute)."""
        longest = max(map(len, self.engine.tokenizer.get_vocab()), default=1)
        return self.engine.max_length * max(longest, 1)

    def check_fits(self, text: str, param: str) -> None:
        """400 naming `param` when `text` cannot fit in the maximum length (runs anywhere)."""
        limit = self.max_prompt_chars
        if len(text) > limit and len(text) - sum(map(text.count, " \t\r\n")) > limit:
            raise APIError(400, f"{param}: {len(text)} characters cannot fit in the maximum "
                                f"length of {self.engine.max_length} tokens: "
                                + length_advice(self.engine.max_length), param=param)

    def token_str(self, token_id: int) -> str:
        return self._token_str(token_id)

    async def in_tokenizer_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def is_base(self, model: str | None) -> bool:
        """Whether `model` names the base model: None, its id, or an alias the engine accepts
        (the name maxjax served it by before)."""
        return model is None or model == self.model_id or (
            not self.cfg.served_model_name and model in getattr(self.engine, "model_aliases", ()))

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (None: the base model); 404 for an unknown one."""
        if self.is_base(model):
            return None
        if model in self.engine.lora_adapters():
            return model
        raise APIError(404, f"model {model!r} does not exist; this server serves "
                            f"{self.model_id!r}", param="model", code="model_not_found")

    # With several models the app's state is a RoutedState (server/router.py), which picks
    # the model a request names; with one there is nothing to pick.
    def begin_request(self) -> None:
        pass

    async def pick_model(self, model) -> None:
        pass

    def end_request(self) -> None:
        pass

    def check_ready(self) -> None:
        if getattr(self.engine, "dead", None) is not None:
            raise APIError(503, "the engine thread died; the server is shutting down")
        if not self.engine.is_ready:
            raise APIError(503, "the model is still loading; retry when /health answers 200")


STATE = web.AppKey("maxjax_state", ServerState)
# Set on the request (to the response's status) once a streamed response's last event has been
# written: the client has the whole response, so a disconnect after it is no 499 (app.py's
# middleware).
COMPLETED = (web.RequestKey("maxjax_response_completed", int) if hasattr(web, "RequestKey")
             else "maxjax_response_completed")     # older aiohttp has no RequestKey


async def read_json(request: web.Request) -> dict:
    """The request body as a JSON object; aiohttp raises 413 itself above client_max_size, a
    client that has not sent it all within --http-body-timeout gets a 408, and a body that
    cannot be read (bad Content-Encoding, broken chunks), decoded, nests too deep or holds
    invalid Unicode gets a 400."""
    cfg = request.app[STATE].cfg
    if (request.content_length or 0) > cfg.max_request_body_bytes:   # refused before reading
        raise web.HTTPRequestEntityTooLarge(cfg.max_request_body_bytes, request.content_length)
    timeout = cfg.http_body_timeout
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s "
                            "(--http-body-timeout)") from None
    except RequestPayloadError as e:
        raise APIError(400, f"the request body could not be read: {_first_line(e)}") from None
    try:
        body = json_body.loads(raw)
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"the request body is not valid JSON: {_first_line(e)}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    access_log.note_body(body)
    await request.app[STATE].pick_model(body.get("model"))
    return body


def _first_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def parse_request(model_cls: type[BaseModel], body: dict, allow_extra: bool):
    """Validate `body` as `model_cls`; unknown top-level fields are a 400 unless allow_extra,
    in which case they are dropped with a warning."""
    unknown = sorted(set(body) - set(model_cls.model_fields))
    if unknown:
        if not allow_extra:
            raise APIError(400, f"unknown field{'s' if len(unknown) > 1 else ''}: "
                                f"{', '.join(unknown)} (start the server with "
                                "--allow-extra-request-fields to drop them)", param=unknown[0])
        log.warning("dropping unknown request fields: %s", ", ".join(unknown))
        body = {k: v for k, v in body.items() if k not in unknown}
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
