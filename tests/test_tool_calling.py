"""Tool calling and structured output through the real server on SmolLM2 (its chat template
ignores `tools`, so the server adds the tool prompt), with the official `openai` client:
tool_choice required (2 tools, parallel) and named give calls whose arguments validate against
the tool's schema, streamed deltas reassemble to the non-streamed result, a tool result renders
in the next turn, response_format json_schema validates; bad input is a 400 naming the field
and the server keeps serving. No compile after warm-up, no page leaked."""
import json
import os

import jsonschema
import openai
import pytest
from server_harness import http


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "Current weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MSGS = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module")
def engine(smollm2_chat):
    return smollm2_chat[0]


@pytest.fixture(scope="module")
def server(smollm2_chat):
    return smollm2_chat[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def no_leak_no_compile(engine):
    yield
    s = engine.core.stats()
    assert s.kv.pages_used == 0 and s.scheduler.running == 0, s
    assert s.xla_compiles_since_ready == 0


def check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def streamed(client, **kw):
    """(content, {index: (id, name, arguments)}, finish_reason) reassembled from the deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            if tc.id:
                assert tc.index not in calls, "a call's name is sent once"
                calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
            else:
                calls[tc.index][2] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_required_parallel_calls(client, temperature):
    kw = dict(model="smollm2", messages=MSGS, tools=TOOLS, tool_choice="required",
              max_tokens=160, temperature=temperature, seed=3)
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    check_calls(ch.message.tool_calls)
    content, calls, finish = streamed(client, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(n, a) for _, n, a in calls.values()] == [
        (c.function.name, c.function.arguments) for c in ch.message.tool_calls]


def test_named_tool_and_single_call(client):
    for parallel in (True, False):
        r = client.chat.completions.create(
            model="smollm2", messages=MSGS, tools=TOOLS, max_tokens=100, temperature=0,
            tool_choice={"type": "function", "function": {"name": "add"}},
            parallel_tool_calls=parallel)
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1, "a named tool is called once"
        check_calls(calls, {"add"})


def test_tool_result_renders_in_the_next_turn(client, server):
    first = client.chat.completions.create(
        model="smollm2", messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=160,
        temperature=0, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    turn = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "RESULT-1234"}]
    tok = http("POST", server.url + "/tokenize", {"messages": turn})
    bare = tok.json()["count"]
    text = http("POST", server.url + "/detokenize", {"tokens": tok.json()["tokens"]}
                ).json()["prompt"]
    assert "RESULT-1234" in text and call.function.name in text
    r = client.chat.completions.create(model="smollm2", messages=turn, tools=TOOLS,
                                       max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # /tokenize with the tools counts the prompt the chat request got (tools prompt included)
    tok = http("POST", server.url + "/tokenize", {"messages": turn, "tools": TOOLS})
    assert tok.json()["count"] == r.usage.prompt_tokens > bare, tok.text


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0,
                                                              "maximum": 10**8}},
              "required": ["city", "population"], "additionalProperties": False}
    for stream in (False, True):
        kw = dict(model="smollm2", max_tokens=80, temperature=0,
                  messages=[{"role": "user", "content": "The largest city of France, as JSON."}],
                  response_format={"type": "json_schema", "json_schema": {
                      "name": "city", "schema": schema, "strict": True}})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **kw) if c.choices)
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
    r = client.completions.create(model="smollm2", prompt="My phone number is", max_tokens=20,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert r.choices[0].text[3] == "-" and len(r.choices[0].text) == 8


def chat_error(server, param: str, **body):
    r = http("POST", server.url + "/v1/chat/completions",
             {"messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert "Traceback" not in r.text
    return err["message"]


def test_bad_input_is_a_400_naming_the_field(server, engine, monkeypatch):
    rf = lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}  # noqa
    assert "type" in chat_error(server, "response_format.json_schema.schema",
                                response_format=rf({"type": "objekt"}))
    strict = {**rf({"not": {"type": "string"}}), "json_schema": {
        "name": "x", "schema": {"not": {"type": "string"}}, "strict": True}}
    assert "not" in chat_error(server, "response_format.json_schema.schema",
                               response_format=strict)
    r = http("POST", server.url + "/v1/chat/completions", {   # not strict: served, and said
        "messages": MSGS, "max_tokens": 3, "response_format": rf({"not": {"type": "string"}})})
    assert r.status_code == 200 and "not" in r.headers["X-Structured-Output-Warnings"]
    chat_error(server, "structured_outputs.regex", structured_outputs={"regex": "(a"})
    chat_error(server, "guided_json", guided_json=[1, 2])
    chat_error(server, "tool_choice", tools=TOOLS,
               tool_choice={"type": "function", "function": {"name": "nope"}})
    chat_error(server, "tools[0].function.parameters.type", tools=[{"type": "function",
               "function": {"name": "f", "parameters": {"type": "string"}}}])
    chat_error(server, "tools[0].function.parameters.properties", tools=[{"type": "function",
               "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}])
    chat_error(server, "tools", tool_choice="required")
    monkeypatch.setattr(engine.core.grammars, "compile_timeout", 0.01)
    big = {"enum": [f"v{i}y{i * 3}" for i in range(40000)]}
    assert "within" in chat_error(server, "response_format.json_schema.schema",
                                  response_format=rf(big))
    monkeypatch.undo()
    r = http("POST", server.url + "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3})
    assert r.status_code == 200


def test_structured_output_off_is_a_400(server, engine, monkeypatch):
    monkeypatch.setattr(engine.core, "grammars", None)
    assert "off" in chat_error(server, "response_format", response_format={"type": "json_object"})


# ---- through the clients agents are built on ----------------------------------------------------

SINGLE = ["What is the weather in Tokyo?", "Add 17 and 25.", "Is it raining in Berlin?",
          "What is 300 plus 12?"]


def test_parallel_allowed_repeats_no_call_and_keeps_the_first(client):
    """The grammar's separator after a call was the newline a model writes there, so that
    newline committed to another call and the model copied the last one (2-8 identical calls
    on 55 of 57 single-call questions). Now whitespace may end the calls and a repeated call
    is dropped: the first call is the one parallel_tool_calls false gives, none repeats."""
    for q in SINGLE:
        kw = dict(model="smollm2", messages=[{"role": "user", "content": q}], tools=TOOLS,
                  tool_choice="required", max_tokens=160, temperature=0)
        calls = client.chat.completions.create(**kw).choices[0].message.tool_calls
        one = client.chat.completions.create(**kw, parallel_tool_calls=False)
        check_calls(calls)
        seen = [(c.function.name, c.function.arguments) for c in calls]
        assert len(set(seen)) == len(seen), (q, seen)
        assert seen[0] == (one.choices[0].message.tool_calls[0].function.name,
                           one.choices[0].message.tool_calls[0].function.arguments)


def test_seeded_output_does_not_depend_on_cache_or_batch(client):
    import concurrent.futures
    prompts = [f"Write one sentence about a {w}." for w in
               ("cat", "dog", "robot", "wizard", "sailor", "baker", "knight", "pilot")]

    def ask(p):
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user",
                                           "content": p}], max_tokens=24, temperature=1.0,
                                           seed=11)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens
    cold = [ask(p) for p in prompts]
    warm = [ask(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        batch = list(pool.map(ask, prompts))
    assert any(c for _, c in warm), "the repeats should hit the prefix cache"
    assert [t for t, _ in cold] == [t for t, _ in warm] == [t for t, _ in batch]


def test_instructor_tools_mode_with_a_nested_model(client):
    import instructor
    import pydantic

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)

    class Weather(pydantic.BaseModel):
        city: City
        unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")
    ic = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    w = ic.chat.completions.create(model="smollm2", response_model=Weather, max_tokens=120,
                                   temperature=0, max_retries=0, messages=[
                                       {"role": "user", "content": "Weather in Rome, celsius."}])
    assert isinstance(w, Weather) and isinstance(w.city, City)


def test_langchain_tool_round_trip(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="smollm2", temperature=0,
                     max_tokens=100, max_retries=0)
    msgs = [HumanMessage("What is the weather in Lima?")]
    ai = llm.bind_tools([get_weather], tool_choice="required").invoke(msgs)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    assert "<tool_call>" not in ai.content
    msgs += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]),
                             tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.bind_tools([get_weather]).invoke(msgs)
    assert "<tool_call>" not in final.content
    for c in final.tool_calls:
        assert c["name"] == "get_weather"


def test_litellm_cut_off_forced_call(server):
    """The issue's repro: a forced call cut off by max_tokens is finish_reason length with no
    markup in the content, through litellm."""
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"   # it fetches a price list otherwise
    import litellm
    weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    r = litellm.completion(model="openai/smollm2", api_base=server.url + "/v1", api_key="x",
                           messages=[{"role": "user", "content": "Weather in Paris and Rome?"}],
                           tools=weather, tool_choice="required", max_tokens=40, seed=3)
    c = r.choices[0]
    assert c.finish_reason == "length", c
    assert "<tool_call>" not in (c.message.content or "")
