"""GET /openapi.json: every route the router serves is described; the request schemas agree with
the official OpenAI spec (tests/openai_schemas.json) on the fields both have (types, required
fields, numeric bounds, with the deviations listed and why); real answers of the server (mock
engine) validate against the description's response schemas and the official ones."""
import json

import jsonschema
import pytest
from mock_engine import MockEngine
from server_harness import ServerThread, http, validate

from maxjax.server.app import build_app
from maxjax.server.openapi import openapi_document

OFFICIAL = json.load(open(__file__.rsplit("/", 1)[0] + "/openai_schemas.json"))["$defs"]
MSGS = [{"role": "user", "content": "hi"}]
# (our request model, official request schema)
REQUESTS = [("ChatCompletionRequest", "CreateChatCompletionRequest"),
            ("CompletionRequest", "CreateCompletionRequest")]
# Bounds we set on purpose where the spec's differ: (schema, field) -> why.
NARROWER = {
    ("CompletionRequest", "max_tokens"): "0 new tokens (prompt scoring with echo) is refused",
    ("ChatCompletionRequest", "top_p"): "top_p 0 keeps no token: refused, not guessed",
    ("CompletionRequest", "top_p"): "top_p 0 keeps no token: refused, not guessed",
    ("ChatCompletionRequest", "seed"): "seeds are the engine's non-negative int64",
    ("CompletionRequest", "seed"): "seeds are the engine's non-negative int64",
    ("ChatCompletionRequest", "max_tokens"): "0 new tokens is refused",
    ("ChatCompletionRequest", "max_completion_tokens"): "0 new tokens is refused",
}


@pytest.fixture(scope="module")
def server():
    s = ServerThread(MockEngine(max_length=64))
    yield s
    s.close()


@pytest.fixture(scope="module")
def doc(server):
    r = http("GET", server.url + "/openapi.json")
    assert r.status_code == 200
    return r.json()


def resolver(defs: dict, prefix: str):
    def resolve(s: dict) -> dict:
        while "$ref" in s:
            s = defs[s["$ref"][len(prefix):]]
        return s
    return resolve


def properties(schema: dict, resolve) -> tuple[dict, set]:
    """(properties, required) of an object schema, allOf parts merged."""
    schema = resolve(schema)
    props, required = dict(schema.get("properties", {})), set(schema.get("required", ()))
    for part in schema.get("allOf", ()):
        p, r = properties(part, resolve)
        props.update(p)
        required |= r
    return props, required


def json_types(schema: dict, resolve) -> set:
    """The JSON types a schema admits ("any" when it does not say)."""
    schema = resolve(schema)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return set().union(*(json_types(s, resolve) for s in schema[key]))
    if "allOf" in schema:
        return set.intersection(*(json_types(s, resolve) for s in schema["allOf"]))
    if "type" in schema:
        t = schema["type"]
        return set(t) if isinstance(t, list) else {t}
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        return {{str: "string", bool: "boolean", int: "integer", float: "number",
                 type(None): "null"}[type(v)] for v in values}
    if "properties" in schema:
        return {"object"}
    return {"any"}


def bounds(schema: dict, resolve) -> tuple:
    """(lowest, highest) number a schema admits (None: unbounded or not a number)."""
    schema = resolve(schema)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            parts = [bounds(s, resolve) for s in schema[key]]
            parts = [p for p in parts if p != (None, None)]
            return parts[0] if len(parts) == 1 else (None, None)
    lo = schema.get("minimum", schema.get("exclusiveMinimum"))
    hi = schema.get("maximum", schema.get("exclusiveMaximum"))
    return lo, hi


def test_every_route_is_described(server, doc):
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    app = build_app(server.engine)
    for route in app.router.routes():
        path = route.resource.canonical.replace("{model_id:.+}", "{model_id}")
        if route.method == "HEAD" or (route.method != "GET" and
                                      not hasattr(route.handler, "openapi")):
            continue
        assert (route.method, path) in described, (route.method, path)
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionRequest")
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert openapi_document(app, "t", "0")["paths"].keys() == doc["paths"].keys()
    # OpenAPI: operationIds are unique (code generators key on them; / and /ui/ share a handler)
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(ids)


@pytest.mark.parametrize("ours_name, official_name", REQUESTS)
def test_shared_request_fields_agree_with_the_official_spec(doc, ours_name, official_name):
    comps = doc["components"]["schemas"]
    ours_resolve = resolver(comps, "#/components/schemas/")
    off_resolve = resolver(OFFICIAL, "#/$defs/")
    ours, ours_required = properties(comps[ours_name], ours_resolve)
    official, official_required = properties(OFFICIAL[official_name], off_resolve)
    shared = sorted(set(ours) & set(official))
    assert len(shared) >= 15 and official_required <= set(ours)
    assert ours_required <= official_required
    mismatches = []
    for field in shared:
        mine, theirs = json_types(ours[field], ours_resolve), json_types(official[field],
                                                                          off_resolve)
        if "any" in mine:
            continue
        # What a client of the spec may send, we take; what we take, the spec allows (or null).
        if not theirs - {"null"} <= widen(mine) or not mine - {"null"} <= widen(theirs):
            mismatches.append((field, "types", mine, theirs))
        if (ours_name, field) in NARROWER:
            continue
        (lo, hi), (olo, ohi) = bounds(ours[field], ours_resolve), bounds(official[field],
                                                                          off_resolve)
        if lo is not None and (olo is None or lo > olo) or \
                hi is not None and (ohi is None or hi < ohi):
            mismatches.append((field, "bounds", (lo, hi), (olo, ohi)))
    assert not mismatches


def widen(types: set) -> set:
    return types | {"integer"} if "number" in types else types


def test_answers_match_the_description_and_the_spec(server, doc):
    comps = doc["components"]["schemas"]

    def ours(obj, name):
        jsonschema.Draft202012Validator({**comps[name], "components": {"schemas": comps}}
                                        ).validate(obj)
    url = server.url
    chat = http("POST", url + "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3,
                                                      "logprobs": True, "top_logprobs": 2})
    ours(chat.json(), "ChatCompletion")
    validate(chat.json(), "CreateChatCompletionResponse")
    stream = http("POST", url + "/v1/chat/completions", {
        "messages": MSGS, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    events = [e[6:] for e in stream.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 3
    for e in events[:-1]:
        ours(json.loads(e), "ChatCompletionChunk")
        validate(json.loads(e), "CreateChatCompletionStreamResponse")
    comp = http("POST", url + "/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                                 "logprobs": 2, "echo": True})
    ours(comp.json(), "Completion")     # (echo's first token has a null logprob, as OpenAI's)
    comp = http("POST", url + "/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                                 "logprobs": 2})
    ours(comp.json(), "Completion")
    validate(comp.json(), "CreateCompletionResponse")
    models = http("GET", url + "/v1/models").json()
    ours(models, "ModelList")
    validate(models, "ListModelsResponse")
    err = http("POST", url + "/v1/chat/completions", {"messages": []}).json()
    ours(err, "ErrorResponse")
    validate(err, "ErrorResponse")
    ours(http("GET", url + "/health").json(), "Health")
    ours(http("POST", url + "/tokenize", {"prompt": "hi"}).json(), "TokenizeResponse")
    ours(http("POST", url + "/detokenize", {"tokens": [104, 105]}).json(), "DetokenizeResponse")
