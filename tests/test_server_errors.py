"""Every client-visible error of the server: status code, OpenAI error envelope (validated
against the spec's ErrorResponse schema), the named param, and that the server keeps serving."""
import json
import threading

import pytest
from mock_engine import MockEngine
from server_harness import ServerThread, http, validate

from maxjax.server.config import ServeConfig
from maxjax.server.state import STATE

MSGS = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    s = ServerThread(MockEngine(max_length=64), ServeConfig(max_request_body_bytes=4096))
    yield s
    s.close()


def error(resp, status: int, param: str | None = "-", contains: str = "") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    validate(body, "ErrorResponse")
    assert "Traceback" not in resp.text
    if param != "-":
        assert body["error"]["param"] == param, body
    assert contains.lower() in body["error"]["message"].lower(), body
    return body["error"]


def chat(server, **kw):
    return http("POST", server.url + CHAT, {"model": "mock-model", "messages": MSGS,
                                            "max_tokens": 2, **kw})


@pytest.mark.parametrize("field,value,param", [
    ("temperature", 5, "temperature"), ("n", 0, "n"), ("top_p", 0, "top_p"),
    ("top_logprobs", 21, "top_logprobs"), ("max_tokens", 0, "max_tokens"),
    ("presence_penalty", 3, "presence_penalty"), ("stop", 7, "stop"),
    ("messages", [], "messages"), ("messages", [{"role": "robot", "content": "x"}],
                                   "messages[0].role"),
    ("logit_bias", {"x": 1}, "logit_bias"), ("min_tokens", 5, "min_tokens"),
    ("messages", [{"role": "user"}], "messages[0].content"),
    ("stream_options", {"include_usage": True}, "stream_options"),      # without stream
])
def test_validation_names_the_field(server, field, value, param):
    e = error(chat(server, **{field: value}), 400, param)
    assert e["type"] == "invalid_request_error"
    assert param.split(".")[0].split("[")[0] in e["message"]


@pytest.mark.parametrize("route,body,param,contains", [
    (CHAT, {"logit_bias": {str(i): 1 for i in range(65)}}, "logit_bias", "at most 64"),
    (CHAT, {"logit_bias": {"300": 1}}, "logit_bias", "vocabulary"),
    (CHAT, {"logit_bias": {"65": 150}}, "logit_bias", "[-100, 100]"),
    (CHAT, {"stop": ["x"] * 17}, "stop", "at most 16"),
    (CHAT, {"stop": "x" * 257}, "stop", "256 characters"),
    (CHAT, {"stop_token_ids": [300]}, "stop_token_ids", "vocabulary"),
    (CHAT, {"stop_token_ids": list(range(16)), "min_tokens": 1}, "stop_token_ids", "besides EOS"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens", "2"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", ""),
    ("/v1/completions", {"prompt": [[1], []]}, "prompt", "empty"),
])
def test_engine_limits_name_the_field(server, route, body, param, contains):
    """Limits the engine's validator checks at admission come back as 400s with the request's
    name for the field; nothing is left running."""
    body = {"messages": MSGS, "max_tokens": 2, **body} if route == CHAT else body
    error(http("POST", server.url + route, body), 400, param, contains)
    assert server.engine.pages_used == 0 and not server.engine.running


def test_unsupported_features_are_400(server):
    error(chat(server, response_format={"type": "xml"}), 400, "response_format.type")
    error(chat(server, top_logprobs=2), 400, "top_logprobs", "logprobs")
    error(http("POST", server.url + "/v1/completions", {"prompt": "x", "suffix": "y"}), 400,
          "suffix")
    assert chat(server, tool_choice="none", tools=[], response_format={"type": "text"},
                store=False, metadata={"a": "b"}).status_code == 200


def test_content_part_types(server):
    msgs = [{"role": "user", "content": [
        {"type": "text", "text": "hi"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    e = error(chat(server, messages=msgs), 400, "messages[0].content[1].type")
    assert "image_url" in e["message"]


def test_unknown_fields(server):
    error(chat(server, frobnicate=1), 400, "frobnicate", "unknown field")
    s = ServerThread(MockEngine(), ServeConfig(allow_extra_request_fields=True))
    try:
        assert chat(s, frobnicate=1).status_code == 200
    finally:
        s.close()


def test_too_long(server):
    e = error(chat(server, max_tokens=60), 400, "max_tokens", "maximum length 64")
    assert "60" in e["message"]
    error(http("POST", server.url + "/v1/completions", {"prompt": "x" * 70}), 400, "prompt")
    error(http("POST", server.url + "/v1/completions", {"prompt": [10**7]}), 400, "prompt")
    error(http("POST", server.url + "/v1/completions", {"prompt": ""}), 400, "prompt")


def test_unknown_model_is_404(server):
    e = error(chat(server, model="gpt-9"), 404, "model", "gpt-9")
    assert e["code"] == "model_not_found"
    error(http("GET", server.url + "/v1/models/gpt-9"), 404)


def test_bad_bodies(server):
    error(http("POST", server.url + CHAT, raw=b"{not json"), 400, None, "json")
    error(http("POST", server.url + CHAT, raw=b"[1, 2]"), 400, None, "object")
    for number in (b"NaN", b"Infinity", b"-Infinity"):    # Python's json reads them; JSON has none
        error(http("POST", server.url + CHAT, raw=b'{"messages": [{"role": "user", "content": '
                   b'"x"}], "temperature": ' + number + b"}"), 400, None, "not a JSON number")
    error(http("POST", server.url + CHAT, raw=json.dumps(
        {"messages": [{"role": "user", "content": "x" * 5000}]}).encode()), 413)
    error(http("GET", server.url + "/v1/nothing"), 404)
    error(http("GET", server.url + CHAT), 405)


def test_no_chat_template():
    s = ServerThread(MockEngine(chat_template=None))
    try:
        error(chat(s), 400, "messages", "chat template")
        assert http("POST", s.url + "/v1/completions", {"prompt": "x"}).status_code == 200
    finally:
        s.close()


def test_engine_failure_is_500_for_that_request_only():
    engine = MockEngine()
    engine.fail_on = "BOOM"
    s = ServerThread(engine)
    try:
        e = error(chat(s, messages=[{"role": "user", "content": "BOOM"}]), 500)
        assert e["type"] == "server_error"
        r = http("POST", s.url + CHAT, {"messages": [{"role": "user", "content": "BOOM"}],
                                         "stream": True})
        assert r.status_code == 500       # failed before the first token: still a clean status
        assert chat(s).status_code == 200
        assert engine.pages_used == 0
    finally:
        s.close()


def test_engine_error_output_mid_stream():
    """An engine that fails after some tokens: the stream ends with an error event + [DONE]."""
    from maxjax.engine.types import RequestOutput

    class Failing(MockEngine):
        async def _run(self, rid, prompt, p):
            yield RequestOutput(rid, [65], "A", completion_tokens=1)
            yield RequestOutput(rid, [], finished=True, finish_reason="error", error="oom")
    s = ServerThread(Failing())
    try:
        r = http("POST", s.url + CHAT, {"messages": MSGS, "stream": True})
        assert r.status_code == 200
        events = [ln[6:] for ln in r.text.split("\n\n") if ln]
        assert events[-1] == "[DONE]"
        validate(json.loads(events[-2]), "ErrorResponse")
        assert "oom" in json.loads(events[-2])["error"]["message"]
        error(chat(s), 500, contains="oom")
    finally:
        s.close()


def test_queue_full_is_429():
    engine = MockEngine(max_queue=0)
    s = ServerThread(engine)
    try:
        r = chat(s)
        error(r, 429)
        assert r.headers["Retry-After"]
    finally:
        s.close()
    # n=2 where the engine takes only one: 429, and the admitted choice is aborted.
    engine = MockEngine(max_queue=1, delay=0.2)
    s = ServerThread(engine)
    try:
        error(chat(s, n=2), 429)
        assert len(engine.requests) == 1 and engine.aborted == [engine.requests[0][0]]
        assert engine.pages_used == 0 and s.app[STATE].admission.waiting == 0
    finally:
        s.close()
    # The server's own cap: one slow request waiting holds the only slot.
    engine = MockEngine(delay=0.5)
    s = ServerThread(engine, ServeConfig(max_queue_size=1))
    try:
        first = threading.Thread(target=chat, args=(s,))
        first.start()
        while not engine.requests:
            threading.Event().wait(0.01)
        r = chat(s)
        error(r, 429, contains="max-queue-size")
        assert r.headers["Retry-After"] == "1"
        first.join()
        assert chat(s).status_code == 200
    finally:
        s.close()


def test_api_key():
    s = ServerThread(MockEngine(), ServeConfig(api_key="sekret"))
    try:
        e = error(chat(s), 401)
        assert e["code"] == "invalid_api_key"
        error(http("POST", s.url + CHAT, {"messages": MSGS},
                   headers={"Authorization": "Bearer wrong"}), 401)
        error(http("GET", s.url + "/v1/models"), 401)
        ok = http("POST", s.url + CHAT, {"messages": MSGS, "max_tokens": 1},
                  headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert http("GET", s.url + "/health").status_code == 200
        assert http("GET", s.url + "/metrics").status_code == 401
        assert http("GET", s.url + "/metrics",
                    headers={"Authorization": "Bearer sekret"}).status_code == 200
    finally:
        s.close()


def test_api_key_from_env(monkeypatch):
    monkeypatch.setenv("MAXJAX_API_KEY", "envkey")
    s = ServerThread(MockEngine())
    try:
        error(chat(s), 401)
        assert http("GET", s.url + "/v1/models",
                    headers={"Authorization": "Bearer envkey"}).status_code == 200
    finally:
        s.close()
