"""GET /openapi.json: an OpenAPI 3.1 description of the routes this app serves, generated from
what declares them: the aiohttp router (methods and paths), each handler's `@describe(...)`
(its pydantic request model and its response TypedDicts from server/responses.py) and the
handler's docstring. tools/fuzz.py generates its requests from it; tests/test_openapi.py checks
it against the official OpenAI schemas."""
from __future__ import annotations

import re

from aiohttp import web
from pydantic import TypeAdapter

from .responses import ErrorResponse

_REF = "#/components/schemas/{model}"
_ERRORS = {"400": "Invalid request (the OpenAI error envelope; `param` names the field)",
           "401": "Missing or wrong API key", "404": "Unknown route or model",
           "413": "Body over --max-request-body-bytes", "429": "Queue full (Retry-After)",
           "503": "Model loading or engine failed"}


def describe(request=None, response=None, stream=None, content_type: str = "application/json"):
    """Mark a handler with its request model and response type(s); `stream`: the type of each
    `data:` event when the request sets stream: true."""
    def mark(handler):
        handler.openapi = {"request": request, "response": response, "stream": stream,
                           "content_type": content_type}
        return handler
    return mark


def openapi_document(app: web.Application, title: str, version: str) -> dict:
    types: dict[str, object] = {"ErrorResponse": ErrorResponse}
    paths: dict[str, dict] = {}
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        spec = getattr(route.handler, "openapi", None)
        path = re.sub(r"\{(\w+)(:[^}]*)?\}", r"{\1}", route.resource.canonical)
        if spec is None and route.method != "GET":
            continue
        paths.setdefault(path, {})[route.method.lower()] = _operation(route, path, spec or {},
                                                                      types)
    seen: set[str] = set()
    for path, ops in sorted(paths.items()):      # one handler on several paths (/, /ui/)
        for op in ops.values():
            while op["operationId"] in seen:
                op["operationId"] += "_" + (re.sub(r"\W+", "_", path).strip("_") or "root")
            seen.add(op["operationId"])
    schemas = _schemas(types)
    return {"openapi": "3.1.0", "info": {"title": title, "version": version},
            "paths": dict(sorted(paths.items())), "components": {"schemas": schemas}}


def _operation(route, path: str, spec: dict, types: dict) -> dict:
    doc = (route.handler.__doc__ or route.handler.__name__).strip().split("\n\n")[0]
    op = {"operationId": f"{route.method.lower()}_{route.handler.__name__}_"
                         f"{'v1' if path.startswith('/v1') else 'root'}",
          "summary": " ".join(doc.split())}
    params = re.findall(r"\{(\w+)\}", path)
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True,
                             "schema": {"type": "string"}} for p in params]
    if spec.get("request") is not None:
        model = spec["request"]
        types[model.__name__] = model
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=model.__name__)}}}}
    content = {}
    if spec.get("response") is not None:
        name = spec["response"].__name__
        types[name] = spec["response"]
        content[spec["content_type"]] = {"schema": {"$ref": _REF.format(model=name)}}
    else:
        content[spec.get("content_type", "text/plain")] = {"schema": {"type": "string"}}
    if spec.get("stream") is not None:
        name = spec["stream"].__name__
        types[name] = spec["stream"]
        content["text/event-stream"] = {"schema": {"type": "string"},
                                        "x-event-schema": {"$ref": _REF.format(model=name)}}
    op["responses"] = {"200": {"description": "OK", "content": content}, **{
        code: {"description": why, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model="ErrorResponse")}}}}
        for code, why in _ERRORS.items()}}
    return op


def _schemas(types: dict) -> dict:
    keys = [(name, "validation", TypeAdapter(t)) for name, t in types.items()]
    refs, defs = TypeAdapter.json_schemas(keys, ref_template=_REF)
    schemas = dict(defs.get("$defs", {}))
    for (name, _), schema in refs.items():
        if "$ref" not in schema:
            schemas[name] = schema
    return dict(sorted(schemas.items()))


async def openapi_json(request: web.Request) -> web.Response:
    """This description."""
    from maxjax import __version__
    from .state import STATE
    st = request.app[STATE]
    return web.json_response(openapi_document(request.app, f"maxjax serve ({st.model_id})",
                                              __version__))
