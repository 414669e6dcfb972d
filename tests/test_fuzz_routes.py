"""Every route fuzz-clean against the mock engine (fast; tests/test_reliability.py runs the fuzz
on the real model): the 500s the fuzz and the new-user probes found, each a 4xx naming the field
in the route's own error shape (OpenAI's on chat, completions and embeddings, with the
Responses field names on /v1/responses, Anthropic's on /v1/messages), then tools/fuzz.py's
shaped cases over /v1/responses, /v1/messages, /v1/embeddings and image parts, with valid
traffic beside them."""
import json
import os
import sys
import types

import numpy as np
import pytest
from mock_engine import MockEngine
from server_harness import ServerThread, http, validate

from maxjax.server.config import ServeConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))

from fuzz import run_fuzz  # noqa: E402

USER = [{"role": "user", "content": "hi"}]
DEEP = "[" * 5000 + "]" * 5000          # far past the C parser's stack, not only the limit
DEEPISH = "[" * 200 + "]" * 200         # parses, but nests past the limit


@pytest.fixture(scope="module")
def server():
    s = ServerThread(MockEngine(delay=0.001), ServeConfig(http_idle_timeout=2.0,
                                                          http_body_timeout=2.0))
    yield s
    s.close()


def openai_error(r, param: str, contains: str = "") -> dict:
    assert r.status_code == 400, r.text
    body = r.json()
    validate(body, "ErrorResponse")
    assert body["error"]["param"] == param, body
    assert param in body["error"]["message"] and contains in body["error"]["message"], body
    return body["error"]


def anthropic_error(r, param: str, contains: str = "") -> dict:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["param"] == param, body
    assert param in body["error"]["message"] and contains in body["error"]["message"], body
    return body["error"]


def post(server, route: str, body: dict):
    return http("POST", server.url + route, body)


# ---- the 500s of issue 56, each a regression test -------------------------------------------

X_GUIDANCE = {"type": "object", "x-guidance": 5}


def test_x_guidance_not_an_object_on_chat(server):
    r = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2,
             "response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": X_GUIDANCE}}})
    openai_error(r, "response_format.json_schema.schema", "x-guidance")


def test_x_guidance_not_an_object_on_responses(server):
    r = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "text": {
        "format": {"type": "json_schema", "name": "x", "schema": X_GUIDANCE}}})
    openai_error(r, "text.format.schema", "x-guidance")


def test_x_guidance_not_an_object_on_messages(server):
    r = post(server, "/v1/messages", {"model": "mock-model", "max_tokens": 2, "messages": USER,
                                      "output_config": {"format": {"type": "json_schema",
                                                                   "schema": X_GUIDANCE}}})
    anthropic_error(r, "output_config.format.schema", "x-guidance")


def test_allowed_tools_naming_a_list(server):
    r = post(server, "/v1/responses", {
        "input": "hi", "max_output_tokens": 2,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "allowed_tools", "mode": "auto",
                        "tools": [{"type": "function", "name": ["f"]}]}})
    openai_error(r, "tool_choice.tools[0].name", "string")


@pytest.mark.parametrize("args", [DEEP, DEEPISH])
def test_function_call_arguments_nesting_too_deep_on_responses(server, args):
    r = post(server, "/v1/responses", {"max_output_tokens": 2, "input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": args},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]})
    openai_error(r, "input[0].arguments", "nests deeper than 64")


@pytest.mark.parametrize("args", [DEEP, DEEPISH])
def test_tool_call_arguments_nesting_too_deep_on_chat(server, args):
    r = post(server, "/v1/chat/completions", {"max_tokens": 2, "messages": [
        *USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": args}}]}, {"role": "tool", "tool_call_id": "c",
                                                  "content": "x"}]})
    openai_error(r, "messages[1].tool_calls[0].function.arguments", "nests deeper than 64")


@pytest.mark.parametrize("route,body,param", [
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": ["x"]}]}]},
     "input[0].content[0].type"),
    ("/v1/messages", {"system": [{"type": ["x"], "text": "a"}],
                      "messages": [{"role": "user", "content": "hi"}]}, "system[0].type"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]},
     "messages[0].content[0].type"),
    ("/v1/messages/count_tokens", {"messages": [
        {"role": "assistant", "content": [{"type": ["a"]}]}, {"role": "user", "content": "x"}]},
     "messages[0].content[0].type"),
])
def test_a_block_type_that_is_a_list_or_an_object(server, route, body, param):
    """Found by the shaped fuzz: a content part or block whose type is a list or an object
    was looked up in a dict (`unhashable type`)."""
    if route.startswith("/v1/messages"):
        body = {"model": "mock-model", **({"max_tokens": 2} if route == "/v1/messages" else {}),
                **body}
        anthropic_error(post(server, route, body), param)
    else:
        openai_error(post(server, route, body), param)


def test_the_depth_limit_is_the_bodys_on_every_route(server):
    """One limit where the body is parsed: a field nesting past 64 levels is a 400 naming it,
    in each route's shape; arguments nesting 60 levels are served."""
    deep = {"a": 1}
    for _ in range(70):
        deep = [deep]
    cases = [("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "metadata": deep}),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": deep}),
             ("/v1/embeddings", {"input": deep}),
             ("/v1/responses", {"input": "hi", "metadata": deep})]
    for route, body in cases:
        name = next(k for k, v in body.items() if v is deep)
        openai_error(post(server, route, body), name, "nests deeper than 64")
    anthropic_error(post(server, "/v1/messages", {"model": "m", "max_tokens": 2, "messages": USER,
                                                  "metadata": deep}), "metadata", "nests deeper")
    fine = {"x": "y"}
    for _ in range(58):
        fine = [fine]
    r = post(server, "/v1/chat/completions", {"max_tokens": 2, "messages": [
        *USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": json.dumps({"a": fine})}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x"}]})
    assert r.status_code == 200, r.text


class VisionMock(MockEngine):
    """The mock engine as an image-text model: images are decoded (Pillow) and preprocessed
    into placeholder features, so image parts reach the whole server path."""
    vision = types.SimpleNamespace(config=None, processor=None, spec=types.SimpleNamespace(
        preprocess=lambda config, processor, image: np.zeros((2, 2), np.float32),
        expand_prompt=lambda config, tokenizer, text, images: text))

    def generate(self, *args, images=None, **kw):
        return super().generate(*args, **kw)


@pytest.mark.slow     # ~80 s: the raw cases wait out the idle timeouts
def test_every_route_is_fuzz_clean_with_valid_traffic_beside():
    """tools/fuzz.py against the mock engine: schema-driven and route-shaped cases over every
    POST route (Responses, Messages, embeddings and image parts included) and the raw-body
    cases on each generation route: no 5xx, every error in its route's envelope, every 200
    valid, the valid traffic beside all served, nothing leaked."""
    s = ServerThread(VisionMock(delay=0.001, max_length=8192), ServeConfig(
        http_idle_timeout=2.0, http_body_timeout=2.0, max_request_body_bytes=1 << 20))
    try:
        report = run_fuzz(s.url, cases=300, shaped=900, seed=7, streams=2,
                          limits={"http_idle_timeout": 2.0, "max_request_body_bytes": 1 << 20,
                                  "max_connections": 100})
    finally:
        s.close()
    statuses = report["statuses"]
    for route in ("/v1/responses", "/v1/messages", "/v1/embeddings", "/v1/chat/completions"):
        assert statuses.get(f"{route} 200", 0) > 5, statuses     # cases reach the engine
    assert not report["failures"], report["failures"]
    assert report["valid"]["errors"] == 0, report["valid"]["error_examples"]
    assert report["valid"]["requests"] > 0
    assert not report["leaks"]["problems"], report["leaks"]
