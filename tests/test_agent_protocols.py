"""What the agent CLIs send, at the protocol level on the mock engine (the CLIs themselves run in
tests/test_agent_clis.py). Claude Code on /v1/messages: `context_management` (also on
count_tokens), a max_tokens of 32000 cut to what the prompt leaves, server tools left out with
an X-Dropped-Tools header (a 400 when tool_choice names one). Codex on /v1/responses:
`client_metadata`, `store: false`, `include`, `prompt_cache_key`, no max_output_tokens (what the
prompt leaves), `namespace` tools flattened to Codex's names and their calls returned with
`namespace`, built-in tools left out (a 400 when forced). A prompt over the window is a 400
saying what to change, on both. A forced tool call cut off by max_tokens keeps its partial
tool_use block (Anthropic's behaviour), whole and streamed."""
import json

import anthropic
import pytest
from mock_engine import MockEngine
from server_harness import ServerThread, http, validate

from maxjax.engine.types import SamplingParams
from maxjax.engine.validate import EngineLimits, check_request
from maxjax.errors import RequestError

MAX_LENGTH = 2048
HI = [{"role": "user", "content": "Hi!"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}
CLEAR_THINKING = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
             "tools": [{"type": "function", "name": "close_agent", "description": "Close one",
                        "strict": False, "parameters": {
                            "type": "object", "properties": {"id": {"type": "string"}},
                            "required": ["id"], "additionalProperties": False}}]}
EXEC = {"type": "function", "name": "exec_command", "description": "Run a command",
        "strict": False, "parameters": {"type": "object",
                                        "properties": {"cmd": {"type": "string"}}}}
CODEX_FIELDS = {"store": False, "include": ["reasoning.encrypted_content"],
                "prompt_cache_key": "k1", "reasoning": {"summary": "auto"},
                "client_metadata": {"session_id": "s1", "x-codex-window-id": "s1:0"}}


@pytest.fixture(scope="module")
def engine():
    return MockEngine(max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def server(engine):
    s = ServerThread(engine)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def unscripted(engine):
    engine.script = None
    yield
    engine.script = None
    assert engine.pages_used == 0 and not engine.running


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)


def last(engine) -> tuple[str, SamplingParams]:
    _, prompt, params, _ = engine.requests[-1]
    return engine.tokenizer.decode(prompt), params


def messages(server, body: dict):
    return http("POST", server.url + "/v1/messages?beta=true",
                {"model": "mock-model", "messages": HI, **body})


def responses(server, body: dict):
    r = http("POST", server.url + "/v1/responses", {"model": "mock-model", **body})
    if r.status_code == 200 and not body.get("stream"):
        validate(r.json(), "Response")
    return r


def sse(text: str) -> list[dict]:
    return [json.loads(c.split("data: ", 1)[1]) for c in text.split("\n\n") if "data: " in c]


# ---- /v1/messages: Claude Code's request ---------------------------------------------------------

def test_context_management_is_accepted(server, engine):
    r = messages(server, {"max_tokens": 5, "context_management": CLEAR_THINKING,
                          "thinking": {"type": "adaptive", "display": "omitted"},
                          "output_config": {"effort": "high"}})
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "The q", r.text
    r = http("POST", server.url + "/v1/messages/count_tokens?beta=true",
             {"model": "mock-model", "messages": HI, "context_management": CLEAR_THINKING})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
    r = messages(server, {"max_tokens": 5, "context_management": {"edits": [{"type": "x"}]}})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["param"] == "context_management.edits[0].type", r.text


def test_a_large_max_tokens_is_cut_to_what_the_prompt_leaves(server, engine):
    r = messages(server, {"max_tokens": 32000})
    assert r.status_code == 200, r.text
    prompt, params = last(engine)
    assert params.max_new_tokens == MAX_LENGTH - len(engine.requests[-1][1])
    assert r.json()["stop_reason"] == "max_tokens"
    assert r.json()["usage"]["output_tokens"] == params.max_new_tokens


def test_server_tools_are_dropped_and_said_so(server, engine):
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    r = messages(server, {"max_tokens": 5, "tools": [WEATHER, search]})
    assert r.status_code == 200, r.text
    assert r.headers["X-Dropped-Tools"] == "tools[1] (web_search_20250305)"
    prompt, _ = last(engine)
    assert "get_weather" in prompt and "web_search" not in prompt
    assert "X-Dropped-Tools" not in messages(server, {"max_tokens": 5}).headers
    r = messages(server, {"max_tokens": 5, "tools": [WEATHER, search],
                          "tool_choice": {"type": "tool", "name": "web_search"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.name", r.text
    assert "web_search" in r.json()["error"]["message"]


def test_a_prompt_over_the_window_says_what_to_change(server, engine):
    n = len(engine.requests)
    long = [{"role": "user", "content": "word " * MAX_LENGTH}]
    r = messages(server, {"max_tokens": 32000, "messages": long})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "messages", err
    assert "--max-length" in err["message"] and f"maximum length {MAX_LENGTH}" in err["message"]
    r = responses(server, {"input": "word " * MAX_LENGTH})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "--max-length" in r.json()["error"]["message"]
    assert len(engine.requests) == n      # refused at admission


def test_the_window_advice_names_the_model_window():
    limits = EngineLimits(300, 8, window=32)
    with pytest.raises(RequestError, match=r"larger --max-length \(this model reads up to 32"):
        check_request(list(range(8)), SamplingParams(max_new_tokens=1), limits)
    with pytest.raises(RequestError, match="model's whole window of 8 tokens"):
        check_request(list(range(8)), SamplingParams(max_new_tokens=1),
                      EngineLimits(300, 8, window=8))


# ---- /v1/messages: a forced call cut off by max_tokens --------------------------------------------

PARTIAL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "cel'


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_a_cut_off_forced_call_keeps_its_partial_tool_use_block(client, engine, choice):
    engine.script = PARTIAL + 'sius"}}\n</tool_call>'
    kw = dict(model="mock-model", max_tokens=len(PARTIAL), messages=HI, tools=[WEATHER],
              tool_choice=choice)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    for m in (whole, final):
        assert m.stop_reason == "max_tokens"
        assert [b.type for b in m.content] == ["tool_use"], m.content
        use = m.content[0]
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        assert use.input == {"city": "Paris"}       # the cut string is left out
    # cut inside the name: the one function there is
    engine.script = PARTIAL
    r = client.messages.create(**{**kw, "max_tokens": 20, "tools": [WEATHER],
                                  "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert [(b.type, b.name, b.input) for b in r.content] == [("tool_use", "get_weather", {})]


def test_a_cut_off_call_on_chat_is_still_dropped(server, engine):
    """OpenAI's chat API keeps its own rule: an unfinished call is not a call."""
    engine.script = PARTIAL + 'sius"}}\n</tool_call>'
    tool = {"type": "function", "function": {"name": "get_weather",
                                             "parameters": WEATHER["input_schema"]}}
    r = http("POST", server.url + "/v1/chat/completions", {
        "model": "mock-model", "messages": HI, "tools": [tool], "tool_choice": "required",
        "max_tokens": len(PARTIAL)})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert not msg.get("tool_calls") and r.json()["choices"][0]["finish_reason"] == "length"


# ---- /v1/responses: Codex's request -----------------------------------------------------------

def test_codex_fields_and_no_max_output_tokens(server, engine):
    r = responses(server, {"input": "Say hi", "tools": [EXEC], "tool_choice": "auto",
                           "parallel_tool_calls": True, **CODEX_FIELDS})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "incomplete" and r.json()["store"] is False
    prompt, params = last(engine)
    assert params.max_new_tokens == MAX_LENGTH - len(engine.requests[-1][1])
    assert http("GET", f"{server.url}/v1/responses/{r.json()['id']}").status_code == 404
    r = responses(server, {"input": "Say hi", "max_output_tokens": 10**6})
    assert r.status_code == 200 and last(engine)[1].max_new_tokens < MAX_LENGTH, r.text


def test_namespace_tools_are_flattened_and_their_calls_go_back_namespaced(server, engine):
    flat = "multi_agent_v1__close_agent"
    engine.script = f'<tool_call>\n{{"name": "{flat}", "arguments": {{"id": "a1"}}}}\n</tool_call>'
    body = {"input": "Close a1", "tools": [EXEC, NAMESPACE], **CODEX_FIELDS}
    r = responses(server, body)
    assert r.status_code == 200, r.text
    prompt, _ = last(engine)
    assert f'"name": "{flat}"' in prompt and '"name": "exec_command"' in prompt
    call = r.json()["output"][0]
    assert (call["type"], call["namespace"], call["name"]) == \
        ("function_call", "multi_agent_v1", "close_agent")
    assert json.loads(call["arguments"]) == {"id": "a1"}
    assert [t["name"] for t in r.json()["tools"]] == ["exec_command", flat]
    events = sse(responses(server, {**body, "stream": True}).text)
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert (added[0]["namespace"], added[0]["name"]) == ("multi_agent_v1", "close_agent")
    # the next turn sends the call back as it came: the prompt holds the flat name again
    engine.script = "Closed."
    items = [{"type": "message", "role": "user", "content": "Close a1"},
             {k: call[k] for k in ("type", "name", "namespace", "arguments", "call_id")},
             {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"}]
    r = responses(server, {**body, "input": items})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "Closed."
    assert f'{{"name": "{flat}", "arguments": {{"id": "a1"}}}}' in last(engine)[0]


def test_built_in_tools_are_dropped_unless_forced(server, engine):
    search = {"type": "web_search", "external_web_access": False}
    r = responses(server, {"input": "Hi", "tools": [EXEC, search, {"type": "image_generation"}]})
    assert r.status_code == 200, r.text
    assert r.headers["X-Dropped-Tools"] == "tools[1] (web_search), tools[2] (image_generation)"
    assert [t["name"] for t in r.json()["tools"]] == ["exec_command"]
    assert "web_search" not in last(engine)[0]
    r = responses(server, {"input": "Hi", "tools": [search]})
    assert r.status_code == 200 and "<tools>" not in last(engine)[0], r.text
    n = len(engine.requests)
    r = responses(server, {"input": "Hi", "tools": [EXEC, search],
                           "tool_choice": {"type": "web_search"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert "'web_search'" in r.json()["error"]["message"]
    validate(r.json(), "ErrorResponse")
    assert len(engine.requests) == n
