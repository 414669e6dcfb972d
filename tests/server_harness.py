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

from maxjax.server.app import build_app, runner_options
from maxjax.server.config import ServeConfig

_SCHEMAS = json.load(open(os.path.join(os.path.dirname(__file__), "openai_schemas.json")))


_VALIDATORS: dict = {}


def validate(obj: dict, schema_name: str) -> None:
    """Raise jsonschema.ValidationError unless obj matches the spec's schema `schema_name`."""
    v = _VALIDATORS.get(schema_name)
    if v is None:
        schema = {"$schema": _SCHEMAS["$schema"], "$defs": _SCHEMAS["$defs"],
                  "$ref": f"#/$defs/{schema_name}"}
        jsonschema.Draft202012Validator.check_schema(schema)
        v = _VALIDATORS[schema_name] = jsonschema.Draft202012Validator(schema)
    v.validate(obj)


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
        self.runner = web.AppRunner(self.app, **runner_options(self.cfg))
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]

    def close(self):
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Response:
    def __init__(self, status: int, headers, body: bytes):
        self.status_code, self.headers, self.content = status, headers, body
        self.text = body.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.content)


def http(method: str, url: str, body=None, headers: dict | None = None, raw: bytes | None = None,
         timeout: float = 30) -> Response:
    """A blocking HTTP call that returns error statuses instead of raising."""
    import urllib.error
    import urllib.request
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Response(r.status, r.headers, r.read())
    except urllib.error.HTTPError as e:
        return Response(e.code, e.headers, e.read())
