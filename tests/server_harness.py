"""Runs a server app (build_app) on 127.0.0.1 with a random port in a background event-loop
thread, so tests can use blocking clients (the `openai` package, urllib, raw sockets) against it;
plus validation of response bodies against the OpenAI spec's schemas (tests/openai_schemas.json,
copied from the spec by tests/make_openai_schemas.py)."""
from __future__ import annotations

import asyncio
import json
import os
import threading

import jsonschema
from aiohttp import web

from maxjax.server.app import build_app
from maxjax.server.config import ServeConfig

_SCHEMAS = json.load(open(os.path.join(os.path.dirname(__file__), "openai_schemas.json")))


def validate(obj: dict, schema_name: str) -> None:
    schema = {"$schema": _SCHEMAS["$schema"], "$defs": _SCHEMAS["$defs"],
              "$ref": f"#/$defs/{schema_name}"}
    jsonschema.validate(obj, schema, cls=jsonschema.Draft202012Validator)


class ServerThread:
    def __init__(self, engine, cfg: ServeConfig | None = None):
        self.engine = engine
        self.cfg = cfg or ServeConfig()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self._start())
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self):
        self.app = build_app(self.engine, self.cfg)
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]

    def close(self):
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
