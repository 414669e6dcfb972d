"""The Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official
`anthropic` SDK, on the mock engine (tests/mock_engine.py; `script` makes it write exactly a given
text): text with a system prompt, max_tokens and stop_sequences; a stream reassembles to the
whole answer and its events come in Anthropic's order; a tool_use -> tool_result round trip
(the result reaches the prompt the engine gets); tool_choice any / tool / none; thinking blocks
from the reasoning parser; count_tokens equals the prompt the engine then receives; errors in
Anthropic's envelope (SDK exception classes, the field named); x-api-key auth. Last, one real
SmolLM2 answer, whole and streamed."""
import json

import anthropic
import pytest
from mock_engine import CHAT_TEMPLATE, MockEngine, expected_text
from server_harness import ServerThread, http

from maxjax.server.chat_run import ChatTurn
from maxjax.server.config import ServeConfig
from maxjax.server.protocol import APIError

MODEL = "mock-model"
HI = [{"role": "user", "content": "Hi!"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# The mock's template, plus Qwen3's closed think block when enable_thinking is false.
THINK_TEMPLATE = CHAT_TEMPLATE + ("{% if enable_thinking is defined and not enable_thinking %}"
                                  "<think>\n\n</think>\n\n{% endif %}")


@pytest.fixture(scope="module")
def engine():
    return MockEngine(max_length=4096, chat_template=THINK_TEMPLATE)


@pytest.fixture(scope="module")
def server(engine):
    s = ServerThread(engine, ServeConfig(reasoning_parser="qwen3"))
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


def last_prompt(engine) -> str:
    return engine.tokenizer.decode(engine.requests[-1][1])


def events(server, body: dict, headers=None) -> list[tuple[str, dict]]:
    """A streamed answer's (event, data) pairs, read raw."""
    r = http("POST", server.url + "/v1/messages", {**body, "stream": True}, headers)
    assert r.status_code == 200 and r.headers["Content-Type"] == "text/event-stream", r.text
    out = []
    for chunk in r.text.split("\n\n"):
        if chunk.strip():
            head, data = chunk.split("\n", 1)
            assert head.startswith("event: ") and data.startswith("data: "), chunk
            obj = json.loads(data[6:])
            assert obj["type"] == head[7:]
            out.append((head[7:], obj))
    return out


# ---- text --------------------------------------------------------------------------------------

def test_text_system_and_max_tokens(client, engine):
    r = client.messages.create(model=MODEL, max_tokens=10, system="Be brief.", messages=HI)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert r.model == MODEL
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == expected_text(10)[0]
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    prompt = last_prompt(engine)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!")
    assert r.usage.input_tokens == len(engine.requests[-1][1]) and r.usage.output_tokens == 10
    assert r.usage.cache_read_input_tokens == 0
    # system as text blocks, and a system-role message, render the same
    r2 = client.messages.create(model=MODEL, max_tokens=3, messages=HI,
                                system=[{"type": "text", "text": "Be"},
                                        {"type": "text", "text": "brief."}])
    assert "<|im_start|>system\nBe\nbrief.<|im_end|>" in last_prompt(engine)
    assert r2.content[0].text == "The"


def test_end_turn_and_stop_sequences(client, engine):
    r = client.messages.create(model=MODEL, max_tokens=40, messages=HI,
                               stop_sequences=["zebra", "fox"], metadata={"user_id": "u1"},
                               # sampling fields older SDKs send (this one has none)
                               extra_body={"temperature": 0.5, "top_k": 5, "top_p": 0.9})
    assert r.content[0].text == "The quick brown "
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "fox")
    p = engine.requests[-1][2]
    assert (p.stop, p.temperature, p.top_k, p.top_p) == (["zebra", "fox"], 0.5, 5, 0.9)
    engine.script = "All done."
    r = client.messages.create(model=MODEL, max_tokens=40, messages=HI, stop_sequences=["x"])
    assert r.content[0].text == "All done."
    assert (r.stop_reason, r.stop_sequence) == ("end_turn", None)


def test_stream_equals_the_whole_answer(client, server):
    kw = dict(model=MODEL, max_tokens=24, messages=HI, stop_sequences=["lazy"])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text == expected_text(24)[0]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 24
    assert final.usage.input_tokens == whole.usage.input_tokens
    evs = events(server, kw)
    kinds = [k for k, _ in evs]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = evs[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    assert evs[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


def test_stream_start_splits_the_cache_reads_as_the_end_does(server, engine):
    """A prefix-cache hit: message_start's usage already holds it, as message_delta's does."""
    engine.cached_tokens = 8
    try:
        evs = events(server, dict(model=MODEL, max_tokens=4, messages=HI))
    finally:
        engine.cached_tokens = 0
    start, end = evs[0][1]["message"]["usage"], evs[-2][1]["usage"]
    assert start["cache_read_input_tokens"] == end["cache_read_input_tokens"] == 8
    assert start["input_tokens"] == end["input_tokens"] and start["output_tokens"] == 0


def test_stream_stop_sequence(client):
    with client.messages.stream(model=MODEL, max_tokens=40, messages=HI,
                                stop_sequences=["brown"]) as s:
        assert "".join(s.text_stream) == "The quick "
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "brown")


# ---- tools -------------------------------------------------------------------------------------

def test_tool_use_then_tool_result(client, engine):
    engine.script = CALL
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.messages.create(model=MODEL, max_tokens=200, messages=ask, tools=[WEATHER])
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["tool_use"]
    use = r.content[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == {"city": "Paris"}
    prompt = last_prompt(engine)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt   # the hermes tool prompt
    engine.script = "It is sunny in Paris."
    turn = ask + [{"role": "assistant", "content": r.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": use.id,
                       "content": [{"type": "text", "text": "RESULT-1234: 18C, sunny"}]},
                      {"type": "tool_result", "tool_use_id": "toolu_x", "is_error": True,
                       "content": "timed out"},
                      {"type": "text", "text": "Thanks"}]}]
    r2 = client.messages.create(model=MODEL, max_tokens=200, messages=turn, tools=[WEATHER])
    assert r2.content[0].text == "It is sunny in Paris." and r2.stop_reason == "end_turn"
    prompt = last_prompt(engine)
    assert "<|im_start|>tool\nRESULT-1234: 18C, sunny<|im_end|>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<|im_start|>tool\nError: timed out<|im_end|>" in prompt
    assert prompt.index("RESULT-1234") < prompt.index("user\nThanks")


def test_tool_use_streamed(client, server, engine):
    engine.script = "Let me check. " + CALL
    kw = dict(model=MODEL, max_tokens=200, messages=HI, tools=[WEATHER])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    for m in (whole, final):
        assert [b.type for b in m.content] == ["text", "tool_use"]
        assert m.content[0].text == "Let me check. " and m.content[1].input == {"city": "Paris"}
        assert m.stop_reason == "tool_use"
    deltas = [d["delta"] for k, d in events(server, kw) if k == "content_block_delta"]
    assert {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'} in deltas


def test_tool_choice(client, engine):
    engine.script = CALL
    other = {**WEATHER, "name": "get_time"}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"},
                   {"type": "any", "disable_parallel_tool_use": True}):
        r = client.messages.create(model=MODEL, max_tokens=200, messages=HI,
                                   tools=[WEATHER, other], tool_choice=choice)
        assert r.stop_reason == "tool_use" and r.content[0].input == {"city": "Paris"}
        grammar = engine.requests[-1][2].structured_output
        assert grammar is not None and grammar.kind == "lark", choice   # the call is forced
        assert ("get_time" in grammar.source) == (choice["type"] == "any")
        assert ("~0.." in grammar.source) == (choice == {"type": "any"})  # parallel calls
    r = client.messages.create(model=MODEL, max_tokens=5, messages=HI, tools=[WEATHER],
                               tool_choice={"type": "none"})
    assert "<tools>" not in last_prompt(engine)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=HI, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
    assert e.value.body["error"]["param"] == "tool_choice" and "nope" in e.value.message


def test_output_format_json_schema(client, engine):
    engine.script = '{"city": "Paris"}'
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    r = client.messages.create(model=MODEL, max_tokens=50, messages=HI, output_config={
        "format": {"type": "json_schema", "schema": schema}})
    assert json.loads(r.content[0].text) == {"city": "Paris"}
    grammar = engine.requests[-1][2].structured_output
    assert grammar.kind == "json_schema" and json.loads(grammar.source)["required"] == ["city"]
    e = bad_request(client, output_config={"format": {"type": "json_schema", "schema": 5}})
    assert e.body["error"]["param"].startswith("output_config.format"), e.body


# ---- thinking ----------------------------------------------------------------------------------

def test_thinking_blocks(client, server, engine):
    engine.script = "<think>Paris is in France.</think>\n\nIt is Paris."
    kw = dict(model=MODEL, max_tokens=100, messages=HI,
              thinking={"type": "enabled", "budget_tokens": 1024})
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    for m in (whole, final):
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert m.content[0].thinking == "Paris is in France." and m.content[0].signature == ""
        assert m.content[1].text == "It is Paris." and m.stop_reason == "end_turn"
    starts = [d["content_block"]["type"] for k, d in events(server, kw)
              if k == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert "<think>" not in last_prompt(engine)
    engine.script = "Paris."
    r = client.messages.create(model=MODEL, max_tokens=100, messages=HI,
                               thinking={"type": "disabled"})
    assert last_prompt(engine).endswith("assistant\n<think>\n\n</think>\n\n")   # enable_thinking
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "Paris."
    # an assistant turn's thinking blocks are dropped from the next prompt
    client.messages.create(model=MODEL, max_tokens=3, messages=HI + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "SECRET-THOUGHT", "signature": ""},
            {"type": "text", "text": "Hello."}]},
        {"role": "user", "content": "Again"}])
    assert "SECRET-THOUGHT" not in last_prompt(engine)
    assert "<|im_start|>assistant\nHello.<|im_end|>" in last_prompt(engine)


# ---- count_tokens ------------------------------------------------------------------------------

def test_count_tokens_is_the_prompt_the_engine_gets(client, engine):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for extra in ({}, {"system": "You are terse.", "tools": [WEATHER]}):
        n = client.messages.count_tokens(model=MODEL, messages=ask, **extra).input_tokens
        r = client.messages.create(model=MODEL, max_tokens=4, messages=ask, **extra)
        assert n == len(engine.requests[-1][1]) == r.usage.input_tokens
    assert n > 200       # the tool prompt is counted
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=ask)


# ---- errors ------------------------------------------------------------------------------------

def bad_request(client, **kw) -> anthropic.BadRequestError:
    body = {"model": MODEL, "max_tokens": 5, "messages": HI, **kw}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**body)
    err = e.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert "Traceback" not in err["error"]["message"]
    return e.value


def test_errors_in_anthropic_shape(client, server, engine):
    assert "bogus" in bad_request(client, extra_body={"bogus": 1}).message
    assert "temperature" in bad_request(client, extra_body={"temperature": 1.5}).message
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    e = bad_request(client, messages=[{"role": "user", "content": [image]}])
    assert e.body["error"]["param"] == "messages[0].content[0].type" and "image" in e.message
    e = bad_request(client, messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1",
         "content": [{"type": "document", "source": {}}]}]}])
    assert e.body["error"]["param"] == "messages[0].content[0].content[0].type"
    search = {"type": "web_search_20250305", "name": "web_search"}
    e = bad_request(client, tools=[WEATHER, search],
                    tool_choice={"type": "tool", "name": "web_search"})
    assert e.body["error"]["param"] == "tool_choice.name" and "server tool" in e.message
    e = bad_request(client, tools=[{"type": "bash_20250124", "name": "bash"}])
    assert e.body["error"]["param"] == "tools[0].type"
    e = bad_request(client, tools=[{**WEATHER, "input_schema": {"type": "string"}}])
    assert e.body["error"]["param"] == "tools[0].input_schema.type"
    e = bad_request(client, tools=[{**WEATHER, "name": "bad name!"}])
    assert e.body["error"]["param"] == "tools[0].name"
    e = bad_request(client, messages=HI + [{"role": "assistant", "content": "Sure,"}])
    assert e.body["error"]["param"] == "messages[1].role" and "prefill" in e.message
    e = bad_request(client, stop_sequences=[f"s{i}" for i in range(17)])   # the engine's limit
    assert e.body["error"]["param"] == "stop_sequences", e.body
    e = bad_request(client, tool_choice={"type": "any"})
    assert e.body["error"]["param"] == "tools" and "'any'" in e.message
    assert "thinking.type" in bad_request(client, thinking={"type": "sometimes"}).message
    assert "max_tokens" in bad_request(client, max_tokens=0).message
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-unknown-model", max_tokens=5, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert "claude-unknown-model" in e.value.message
    r = http("POST", server.url + "/v1/messages/nope", {})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http("POST", server.url + "/v1/messages", raw=b"{not json")
    assert r.status_code == 400 and r.json()["type"] == "error"
    # the OpenAI routes keep their own envelope
    r = http("POST", server.url + "/v1/chat/completions", {"messages": HI, "bogus": 1})
    assert r.status_code == 400 and "type" not in r.json() and r.json()["error"]["param"]
    engine.fail_on = "EXPLODE"
    try:
        with pytest.raises(anthropic.InternalServerError) as e:
            client.messages.create(model=MODEL, max_tokens=5,
                                   messages=[{"role": "user", "content": "EXPLODE"}])
        assert e.value.body["error"]["type"] == "api_error"
    finally:
        engine.fail_on = None


def test_an_error_mid_stream_is_an_error_event(client, server, monkeypatch):
    real = ChatTurn.events

    async def failing(self):
        async for ev in real(self):
            yield ev
            raise APIError(500, "the engine failed on this request (test)")
    monkeypatch.setattr(ChatTurn, "events", failing)
    evs = events(server, {"model": MODEL, "max_tokens": 10, "messages": HI})
    assert evs[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "the engine failed on this request (test)"}})
    with pytest.raises(anthropic.APIStatusError, match="test"):
        with client.messages.stream(model=MODEL, max_tokens=10, messages=HI) as s:
            "".join(s.text_stream)


# ---- auth --------------------------------------------------------------------------------------

def test_x_api_key():
    s = ServerThread(MockEngine(), ServeConfig(api_key="sekret"))
    try:
        body = {"model": MODEL, "max_tokens": 3, "messages": HI}
        ok = {"x-api-key": "sekret", "anthropic-version": "2023-06-01"}
        r = http("POST", s.url + "/v1/messages", body, ok)
        assert r.status_code == 200 and r.json()["content"][0]["text"] == "The"
        for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": "sekretx"}):
            r = http("POST", s.url + "/v1/messages", body, headers)
            assert r.status_code == 401, headers
            assert r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "authentication_error"
        assert http("POST", s.url + "/v1/messages/count_tokens",
                    {"model": MODEL, "messages": HI}, ok).json()["input_tokens"] > 0
        assert http("GET", s.url + "/v1/models", headers=ok).status_code == 200
        good = anthropic.Anthropic(base_url=s.url, api_key="sekret", max_retries=0)
        assert good.messages.create(**body).content[0].text == "The"
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=s.url, api_key="nope", max_retries=0) \
                .messages.create(**body)
    finally:
        s.close()


# ---- the real model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_server(smollm2_chat):
    eng, server = smollm2_chat
    yield server
    st = eng.core.stats()
    assert st.kv.pages_used == 0 and st.scheduler.running == 0, st


def test_smollm2_answers(real_server):
    c = anthropic.Anthropic(base_url=real_server.url, api_key="k", max_retries=0)
    kw = dict(model="smollm2", max_tokens=12, extra_body={"temperature": 0},
              system="You are a geography tutor.", messages=[{"role": "user", "content": "What is the capital of France?"}])
    whole = c.messages.create(**kw)
    assert whole.content[0].type == "text" and whole.content[0].text.strip()
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert 0 < whole.usage.output_tokens <= 12
    with c.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text     # greedy: the same answer
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert c.messages.count_tokens(model="smollm2", system=kw["system"],
                                   messages=kw["messages"]).input_tokens == \
        whole.usage.input_tokens
