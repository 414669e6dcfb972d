"""The aiohttp application: routes, the error/auth/metrics middleware, and `run_server` (bind,
announce readiness, drain on SIGTERM/SIGINT). The CLI's `serve` command calls run_server with the
real engine; tests call build_app with tests/mock_engine.py. Chat and completions handlers live
in server/openai_routes.py."""
from __future__ import annotations

import asyncio
import hmac
import signal
import socket
import time

from aiohttp import web

from maxjax.errors import RequestError, UserError

from . import access_log
from .config import ServeConfig
from .engine_client import EngineClient
from .generation import AdmissionState
from .metrics import ServerMetrics
from .chat_prompt import chat_prompt
from .embeddings_api import embeddings
from .openai_routes import chat_completions, completions
from .anthropic_api import count_tokens, is_anthropic, json_error as anthropic_json_error
from .anthropic_api import messages as anthropic_messages
from .openapi import describe, openapi_json
from .protocol import (APIError, ChatCompletionRequest, DetokenizeRequest, LoadLoraRequest,
                       TokenizeRequest, UnloadLoraRequest, error_body, model_card, now)
from .responses import DetokenizeResponse, Health, ModelCard, ModelList, TokenizeResponse
from .router import ModelRouter, RoutedState
from .state import COMPLETED, STATE, ServerState, log, parse_request, read_json
from .tools import tool_setup
from .webui import OPEN_PREFIXES, PAGES, add_routes as add_webui_routes

_OPEN_PATHS = ("/health", "/v1/health", *PAGES)   # and the web UI's files (OPEN_PREFIXES)


def _json_error(status: int, message: str, param=None, code=None, headers=None):
    return web.json_response(error_body(status, message, param, code), status=status,
                             headers=headers)


@web.middleware
async def _middleware(request: web.Request, handler):
    st: ServerState = request.app[STATE]
    key = st.cfg.resolved_api_key()
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "unmatched"
    status = 500
    json_error = anthropic_json_error if is_anthropic(request.path) else _json_error
    record = access_log.begin()
    st.begin_request()
    try:
        open_path = request.path in _OPEN_PATHS or request.path.startswith(OPEN_PREFIXES)
        if key and not open_path:
            auth = request.headers.get("Authorization", "")
            given = auth[7:] if auth[:7].lower() == "bearer " else \
                request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), key.encode()):
                raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY "
                                    "or x-api-key: KEY)", code="invalid_api_key")
        resp = await handler(request)
        status = resp.status
        return resp
    except APIError as e:
        status = e.status
        return json_error(e.status, e.message, e.param, e.code, e.headers)
    except web.HTTPException as e:   # aiohttp's own: 404 route, 405 method, 413 body too large
        status = e.status
        msg = {404: f"no route {request.method} {request.path}",
               405: f"method {request.method} is not allowed on {request.path}",
               413: f"the request body is over the limit of {st.cfg.max_request_body_bytes} "
                    "bytes"}.get(e.status, e.reason)
        return json_error(e.status, msg, headers={k: v for k, v in e.headers.items()
                                                  if k == "Allow"})
    except asyncio.CancelledError:
        # 499: the client went away before the response was complete (the Generation's cleanup
        # has aborted its requests). A stream whose last event went out is complete: a client
        # that closes as soon as it reads it cancels the handler in its cleanup after that
        # write, and the response keeps its own status (SSE.finish sets COMPLETED).
        status = request.get(COMPLETED, 499)
        raise
    except ConnectionResetError:
        # The same, found by a read of the body or a write: nothing to answer, and no
        # traceback for what clients do (aiohttp drops a response to a closed connection).
        status = request.get(COMPLETED, 499)
        return web.Response(status=499)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_error(500, "internal server error")
    finally:
        st.metrics.requests.labels(endpoint, str(status)).inc()
        if not st.cfg.disable_log_requests:
            access_log.write(request, status, access_log.current(), lambda: st.model_id)
        access_log.end(record)
        st.end_request()


@describe(response=Health)
async def health(request: web.Request) -> web.Response:
    """200 once the model is loaded and the engine runs; 503 while loading or after it failed."""
    engine = request.app[STATE].engine
    if engine.is_ready:
        return web.json_response({"status": "ok"})
    failed = getattr(engine, "dead", None) is not None
    return web.json_response({"status": "failed" if failed else "loading"}, status=503)


@describe(response=ModelList)
async def list_models(request: web.Request) -> web.Response:
    """The served model and its loaded LoRA adapters."""
    st = request.app[STATE]
    st.check_ready()
    adapters = st.engine.lora_adapters()
    return web.json_response({"object": "list", "data": [
        _card(st, name) for name in [None, *adapters]]})


@describe(response=ModelCard)
async def get_model(request: web.Request) -> web.Response:
    """One model (or adapter) by id."""
    st = request.app[STATE]
    st.check_ready()
    return web.json_response(_card(st, st.check_model(request.match_info["model_id"])))


def _card(st: ServerState, lora: str | None) -> dict:
    defaults = st.sampling_defaults.in_force()
    if lora is None:
        return model_card(st.model_id, st.created, st.engine.max_length, defaults)
    return model_card(lora, st.created, st.engine.max_length, defaults, parent=st.model_id,
                      root=st.engine.lora_adapters().get(lora))


@describe(request=LoadLoraRequest, content_type="text/plain")
async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's route: {lora_name, lora_path}; loading compiles nothing."""
    st = request.app[STATE]
    req = parse_request(LoadLoraRequest, await read_json(request), False)
    st.check_ready()
    if st.is_base(req.lora_name):      # requests for that name would reach the base model
        raise APIError(400, f"lora_name: {req.lora_name!r} names the base model",
                       param="lora_name")
    await _lora_call(st.engine.load_lora(req.lora_name, req.lora_path))
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@describe(request=UnloadLoraRequest, content_type="text/plain")
async def unload_lora_adapter(request: web.Request) -> web.Response:
    """{lora_name}: waits for the requests using it (new ones get a 404 at once); a 400 when
    they have not ended within --lora-unload-timeout; 404 when not loaded."""
    st = request.app[STATE]
    name = parse_request(UnloadLoraRequest, await read_json(request), False).lora_name
    st.check_ready()
    if name not in st.engine.lora_adapters():
        raise APIError(404, f"adapter {name!r} is not loaded", param="lora_name",
                       code="model_not_found")
    await _lora_call(st.engine.unload_lora(name))
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _lora_call(coro) -> None:
    try:
        await coro
    except RequestError as e:
        raise APIError(400, str(e), param=e.param) from None


async def metrics(request: web.Request) -> web.Response:
    """Prometheus metrics (text format)."""
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


@describe(request=TokenizeRequest, response=TokenizeResponse)
async def tokenize(request: web.Request) -> web.Response:
    """A prompt (or chat messages, through the chat template) as token ids."""
    st: ServerState = request.app[STATE]
    req = parse_request(TokenizeRequest, await read_json(request), False)
    st.check_ready()
    st.check_model(req.model)
    tok = st.engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if req.messages is not None:    # the prompt a chat request of these fields gets
        chat = ChatCompletionRequest(messages=req.messages, tools=req.tools,
                                     tool_choice=req.tool_choice,
                                     chat_template_kwargs=req.chat_template_kwargs,
                                     add_generation_prompt=req.add_generation_prompt)
        ids = (await chat_prompt(st, chat, tool_setup(chat, st.tool_parser)))[0]
    else:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        st.check_fits(req.prompt, "prompt")
        ids = await st.in_tokenizer_thread(lambda: tok.encode(req.prompt,
                                                              add_special_tokens=special))
    # the tokenizer's own token strings ("Ġis"), as vLLM returns them, not decoded text
    strs = await st.in_tokenizer_thread(tok.convert_ids_to_tokens, ids) \
        if req.return_token_strs else None
    return web.json_response({"count": len(ids), "max_model_len": st.engine.max_length,
                              "tokens": ids, "token_strs": strs})


@describe(request=DetokenizeRequest, response=DetokenizeResponse)
async def detokenize(request: web.Request) -> web.Response:
    """Token ids as text."""
    st: ServerState = request.app[STATE]
    req = parse_request(DetokenizeRequest, await read_json(request), False)
    st.check_ready()
    st.check_model(req.model)
    bad = next((t for t in req.tokens if not 0 <= t < st.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens: id {bad} is outside the vocabulary [0, {st.vocab_size})",
                       param="tokens")
    text = await st.in_tokenizer_thread(st.engine.tokenizer.decode, req.tokens)
    return web.json_response({"prompt": text})


def build_app(engine: EngineClient | ModelRouter,
              cfg: ServeConfig | None = None) -> web.Application:
    """`engine`: the one model's, or a ModelRouter of several (server/router.py)."""
    cfg = cfg or ServeConfig()
    app = web.Application(middlewares=[_middleware], client_max_size=cfg.max_request_body_bytes)
    if isinstance(engine, ModelRouter):
        state = RoutedState(engine, cfg)
    else:
        m = ServerMetrics(engine)
        state = ServerState(engine=engine, cfg=cfg, metrics=m,
                            admission=AdmissionState(cfg.max_queue_size, m), created=now())
    app[STATE] = state
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    from .responses_api import add_routes as add_responses_routes     # the Responses API
    add_responses_routes(app)
    app.router.add_post("/v1/messages", anthropic_messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    if isinstance(engine, ModelRouter):
        from .model_routes import add_routes as add_model_routes
        add_model_routes(app)
    else:
        app.router.add_get("/v1/models", list_models)
        app.router.add_get("/v1/models/{model_id:.+}", get_model)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_json)
    for prefix in ("", "/v1"):
        app.router.add_post(f"{prefix}/tokenize", tokenize)
        app.router.add_post(f"{prefix}/detokenize", detokenize)
    add_webui_routes(app, cfg.webui)

    async def _close_pool(app):
        state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
    app.on_cleanup.append(_close_pool)
    return app


def runner_options(cfg: ServeConfig) -> dict:
    """aiohttp's connection handling: the idle timeout also cuts a client that never finishes
    its request head (aiohttp's own default is an hour); after an early answer (413, 408) the
    rest of a body is read for at most 2 s; header sizes are aiohttp's defaults, stated here so
    the limits live in one place."""
    return {"handle_signals": False, "handler_cancellation": True, "access_log": None,
            # past the grace period run_server aborts what still runs; its handlers then answer
            # (a 503, or a stream's error event) within this margin
            "shutdown_timeout": cfg.shutdown_grace_period + DRAIN_MARGIN,
            "keepalive_timeout": cfg.http_idle_timeout, "lingering_time": 2.0,
            "max_line_size": 8190,
            "max_field_size": 8190, "max_headers": 128}


DRAIN_MARGIN = 5.0     # seconds past the grace period for the aborted requests' answers


def _end_the_drain(app: web.Application, cfg: ServeConfig, why: str | None = None) -> None:
    """The grace period is over (or `why`: a second signal came): abort what still runs, each
    request answered (aiohttp alone would cut the connections, only after waiting the period a
    second time)."""
    n = app[STATE].admission.abort_all()
    if n:
        log.warning("%s: aborted what still ran (%d engine requests)",
                    why or f"the {cfg.shutdown_grace_period:.0f} s grace period is over", n)


async def run_server(engine: EngineClient, cfg: ServeConfig, on_ready=None,
                     stop: asyncio.Event | None = None, on_listen=None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set): then stop accepting connections, give
    in-flight requests cfg.shutdown_grace_period seconds to finish, and return. `on_listen()`
    runs once the port is bound (a port in use is a UserError before it)."""
    app = build_app(engine, cfg)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # engine requests instead of generating tokens nobody reads.
    runner = web.AppRunner(app, **runner_options(cfg))
    await runner.setup()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = []
    t0, served, deadline = time.perf_counter(), False, None
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            signals.append(sig)
        except (NotImplementedError, RuntimeError):   # not the main thread, or Windows
            pass
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port)
        try:
            await site.start()
        except socket.gaierror as e:
            raise UserError(f"--host {cfg.host}: not an address of this machine "
                            f"({e.strerror or e})") from None
        except OSError as e:
            raise UserError(f"--port {cfg.port}: cannot listen on {cfg.host}:{cfg.port}: "
                            f"{e.strerror or e} (another server on that port? pick another "
                            f"--port)") from None
        if on_listen is not None:
            on_listen()
        port = cfg.port or runner.addresses[0][1]
        waiter = asyncio.ensure_future(stop.wait())
        while not engine.is_ready and not stop.is_set():
            await asyncio.wait([waiter], timeout=0.05)
        if not stop.is_set():
            served = True
            print(f"Server ready on http://{cfg.host}:{port}", flush=True)
            if on_ready is not None:
                on_ready(port)
        await waiter
        if served:      # else a failed start, whose one error line is the last
            log.info("shutting down: draining in-flight requests (up to %.0f s)",
                     cfg.shutdown_grace_period)
            deadline = loop.call_later(cfg.shutdown_grace_period, _end_the_drain, app, cfg)
            for sig in signals:     # a second SIGTERM/SIGINT ends the drain now, not the process
                loop.add_signal_handler(sig, _end_the_drain, app, cfg,
                                        f"{signal.Signals(sig).name} during the drain")
        t0 = time.perf_counter()
    finally:
        try:
            await runner.cleanup()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            if deadline is not None:
                deadline.cancel()
    if served:
        log.info("server stopped after %.1f s of draining", time.perf_counter() - t0)
