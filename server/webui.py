"""The browser playground and dashboard (static files in server/webui/, served at `/` and `/ui/`)
and the stats they read: `GET /stats` (JSON) and `GET /stats/stream` (the same object as SSE,
every `interval` seconds). Stats come from ServerMetrics.snapshot, the registry /metrics renders,
so the dashboard and Prometheus see the same numbers."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from aiohttp import web

from .protocol import APIError
from .state import STATE, ServerState

STATIC_DIR = Path(__file__).parent / "webui"
PAGES = ("/", "/ui", "/ui/")   # the page (the static route alone answers /ui/ with a 403)
OPEN_PREFIXES = ("/ui/",)      # the page and its files need no API key; every API call does
_SHUTDOWN = web.AppKey("webui_shutdown", asyncio.Event)


def stats(st: ServerState) -> dict:
    ready = st.engine.is_ready
    info = st.engine.info() if ready else None
    chat = ready and st.engine.chat_template is not None
    return {
        "time": time.time(), "ready": ready, "model": st.model_id if ready else None,
        "metrics": st.metrics.snapshot(), "info": info,
        "capabilities": {"chat": chat, "json_schema": bool(info and info["structured_output"]),
                         "tools": bool(chat and st.tool_parser)},
    }


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html",
                            headers={"Cache-Control": "no-cache"})


async def stats_json(request: web.Request) -> web.Response:
    return web.json_response(stats(request.app[STATE]))


async def stats_stream(request: web.Request) -> web.StreamResponse:
    try:
        interval = float(request.query.get("interval", "1"))
    except ValueError:
        interval = float("nan")
    if not 0.1 <= interval <= 60:
        raise APIError(400, "interval: seconds between events, from 0.1 to 60", param="interval")
    st: ServerState = request.app[STATE]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    shutdown = request.app[_SHUTDOWN]
    while not shutdown.is_set():
        await resp.write(f"data: {json.dumps(stats(st))}\n\n".encode())
        try:
            await asyncio.wait_for(shutdown.wait(), interval)
        except asyncio.TimeoutError:
            pass
    return resp


def add_routes(app: web.Application, webui: bool) -> None:
    """Stats always; the page only with --webui (without it `/` is a 404)."""
    app[_SHUTDOWN] = asyncio.Event()

    async def _end_streams(app):   # open dashboards must not hold up the drain
        app[_SHUTDOWN].set()
    app.on_shutdown.append(_end_streams)
    app.router.add_get("/stats", stats_json)
    app.router.add_get("/stats/stream", stats_stream)
    if webui:
        for path in PAGES:
            app.router.add_get(path, index)
        app.router.add_static("/ui/", STATIC_DIR)
