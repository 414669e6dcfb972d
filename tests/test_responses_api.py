"""The Responses API (POST/GET/DELETE /v1/responses) on the mock engine, with the official
`openai` client and openai-agents' default (Responses) model: string and item input,
instructions, streamed events (order, sequence numbers, the same output as the whole response),
structured output through responses.parse, a function tool round trip over
previous_response_id (the second prompt holds the call and its output), store: false, DELETE,
the store's bounds, and 400s naming the field. Every response and every streamed event
validates against the official schemas. Last, one real SmolLM2 turn, whole and streamed."""
import json

import openai
import pytest
from mock_engine import MockEngine
from pydantic import BaseModel
from server_harness import _SCHEMAS, ServerThread, http, validate

from maxjax.server.config import ServeConfig
from maxjax.server.response_store import ResponseStore

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"], "additionalProperties": False},
                "strict": True}
# Stream event type -> its schema in the spec (the members of ResponseStreamEvent).
EVENT_SCHEMAS = {_SCHEMAS["$defs"][r["$ref"].rsplit("/", 1)[1]]["properties"]["type"]["enum"][0]:
                 r["$ref"].rsplit("/", 1)[1]
                 for r in _SCHEMAS["$defs"]["ResponseStreamEvent"]["anyOf"]}


class ScriptedEngine(MockEngine):
    """A mock whose script may depend on the prompt (`script_for(prompt_text)`), and which can
    fail after `fail_after` outputs."""
    script_for = None
    fail_after = None

    def generate(self, request_id, prompt_token_ids, params, cache_salt=None, lora=None):
        if self.script_for is not None:
            self.script = self.script_for(self.tokenizer.decode(prompt_token_ids))
        gen = super().generate(request_id, prompt_token_ids, params, cache_salt, lora)
        return gen if self.fail_after is None else self._failing(gen, self.fail_after)

    @staticmethod
    async def _failing(gen, n: int):
        async for out in gen:
            if n == 0:
                await gen.aclose()
                raise RuntimeError("mock engine failure mid-stream")
            n -= 1
            yield out


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(max_length=4096)


@pytest.fixture(scope="module")
def server(engine):
    s = ServerThread(engine)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def reset(engine):
    engine.script, engine.script_for, engine.fail_after = "Hello there.", None, None
    yield
    assert engine.pages_used == 0 and not engine.running


def post(server, body: dict):
    r = http("POST", server.url + "/v1/responses", {"model": "mock-model", **body})
    if r.status_code == 200 and not body.get("stream"):
        validate(r.json(), "Response")
    return r


def prompt_of(engine, back: int = 1) -> str:
    return engine.tokenizer.decode(engine.requests[-back][1])


def events_of(text: str) -> list[dict]:
    """The SSE body as events; each names its type in `event:`, validates against its own
    schema, and the sequence numbers count from 0."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and \
            lines[1].startswith("data: "), block
        ev = json.loads(lines[1][len("data: "):])
        assert ev["type"] == lines[0][len("event: "):]
        validate(ev, EVENT_SCHEMAS[ev["type"]])
        validate(ev, "ResponseStreamEvent")
        events.append(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def check_order(events: list[dict]) -> dict:
    """The events' nesting (created, in_progress, per item added ... done, then the final
    event); the deltas add up to each done. Returns the final response."""
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    validate(final, "Response")
    items, open_item, text = [], None, ""
    for e in events[2:-1]:
        t = e["type"]
        if t == "response.output_item.added":
            assert open_item is None and e["output_index"] == len(items)
            open_item, text = e["item"], ""
            assert e["item"]["status"] == "in_progress"
        elif t == "response.output_item.done":
            assert e["item"]["id"] == open_item["id"]
            items.append(e["item"])
            open_item = None
        else:
            assert open_item is not None and e["item_id"] == open_item["id"], e
            assert e["output_index"] == len(items)
            if t.endswith(".delta"):
                text += e["delta"]
            elif t in ("response.output_text.done", "response.reasoning_text.done"):
                assert e["text"] == text
            elif t == "response.function_call_arguments.done":
                assert e["arguments"] == text and e["name"] == open_item["name"]
    assert open_item is None and items == final["output"]
    return final


def stripped(output: list[dict]) -> list[dict]:
    """Output items without their ids (fresh per response)."""
    return [{k: v for k, v in it.items() if k != "id"} for it in output]


# ---- whole responses ------------------------------------------------------------------------

def test_string_input(client, server, engine):
    r = client.responses.create(model="mock-model", input="Hi!")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello there."
    msg = r.output[0]
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.usage.input_tokens == len(engine.requests[-1][1]) and r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    assert prompt_of(engine).endswith("<|im_start|>user\nHi!<|im_end|>\n"
                                      "<|im_start|>assistant\n")
    raw = post(server, {"input": "Hi!", "metadata": {"k": "v"}, "temperature": 0.5}).json()
    assert raw["metadata"] == {"k": "v"} and raw["temperature"] == 0.5
    assert engine.requests[-1][2].temperature == 0.5


def test_items_and_instructions(client, engine):
    r = client.responses.create(model="mock-model", instructions="Be brief.", input=[
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Red."}]},
        {"role": "user", "content": "Another one."}])
    assert r.output_text == "Hello there." and r.instructions == "Be brief."
    assert prompt_of(engine) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>developer\nAnswer in English."
        "<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\nRed."
        "<|im_end|>\n<|im_start|>user\nAnother one.<|im_end|>\n<|im_start|>assistant\n")


def test_max_output_tokens_is_incomplete(server, engine):
    engine.script = None                       # the mock's endless text
    r = post(server, {"input": "Hi", "max_output_tokens": 9}).json()
    assert r["status"] == "incomplete" and r["incomplete_details"] == {
        "reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete"
    assert r["output"][0]["content"][0]["text"] == "The quick" and r["completed_at"] is None
    assert engine.requests[-1][2].max_new_tokens == 9


# ---- streaming --------------------------------------------------------------------------------

def test_stream_matches_the_whole_response(client, server, engine):
    whole = client.responses.create(model="mock-model", input="Hi!")
    with client.responses.stream(model="mock-model", input="Hi!") as stream:
        seen = [(e.type, e.sequence_number) for e in stream]
        final = stream.get_final_response()
    assert [s for _, s in seen] == list(range(len(seen)))
    assert [t for t, _ in seen] == (
        ["response.created", "response.in_progress", "response.output_item.added",
         "response.content_part.added"] + ["response.output_text.delta"] * 12 +
        ["response.output_text.done", "response.content_part.done",
         "response.output_item.done", "response.completed"])
    assert final.output_text == whole.output_text == "Hello there."
    r = http("POST", server.url + "/v1/responses", {"model": "mock-model", "input": "Hi!",
                                                    "stream": True})
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text
    final = check_order(events_of(r.text))
    assert stripped(final["output"]) == stripped(whole.model_dump(exclude_unset=True)["output"])


def test_stream_incomplete(server, engine):
    engine.script = None
    r = http("POST", server.url + "/v1/responses", {"model": "mock-model", "input": "Hi",
                                                    "stream": True, "max_output_tokens": 5})
    events = events_of(r.text)
    final = check_order(events)
    assert events[-1]["type"] == "response.incomplete" and final["status"] == "incomplete"
    assert final["output"][0]["content"][0]["text"] == "The q"


def test_content_then_call_streamed_and_whole_agree(server, engine):
    engine.script = "Let me check.\n" + CALL
    body = {"input": "Weather in Paris?", "tools": [WEATHER_TOOL]}
    whole = post(server, body).json()
    assert [it["type"] for it in whole["output"]] == ["message", "function_call"]
    assert whole["output"][0]["content"][0]["text"] == "Let me check.\n"
    events = events_of(http("POST", server.url + "/v1/responses",
                            {"model": "mock-model", "stream": True, **body}).text)
    final = check_order(events)
    assert stripped(final["output"]) == [
        {k: v for k, v in it.items() if k not in ("id", "call_id")} | (
            {"call_id": final["output"][1]["call_id"]} if it["type"] == "function_call" else {})
        for it in whole["output"]]
    types = [e["type"] for e in events]
    assert types.index("response.function_call_arguments.delta") < \
        types.index("response.function_call_arguments.done")


# ---- structured output ------------------------------------------------------------------------

class City(BaseModel):
    name: str
    population: int


def test_parse_with_a_pydantic_model(client, engine):
    engine.script = '{"name":"Paris","population":2100000}'
    r = client.responses.parse(model="mock-model", input="A city?", text_format=City)
    assert r.output_parsed == City(name="Paris", population=2100000)
    p = engine.requests[-1][2]
    assert p.structured_output is not None and p.structured_output.param == \
        "response_format.json_schema.schema"
    r = client.responses.create(model="mock-model", input="JSON?",
                                text={"format": {"type": "json_object"}})
    assert r.text.format.type == "json_object"


# ---- tools and previous_response_id -------------------------------------------------------------

def test_function_call_round_trip(client, server, engine):
    engine.script = CALL
    first = client.responses.create(model="mock-model", input="What is the weather in Paris?",
                                    tools=[WEATHER_TOOL])
    call = first.output[0]
    assert len(first.output) == 1 and call.type == "function_call"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.status == "completed" and first.status == "completed"
    assert "get_weather" in prompt_of(engine)          # the server's tool prompt
    engine.script = "It is 22 C and sunny in Paris."
    second = client.responses.create(
        model="mock-model", previous_response_id=first.id, tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "22 C, sunny"}])
    assert second.output_text == "It is 22 C and sunny in Paris."
    assert second.previous_response_id == first.id
    prompt = prompt_of(engine)
    assert "What is the weather in Paris?" in prompt and "22 C, sunny" in prompt
    assert prompt.index("What is the weather") < prompt.index('"name": "get_weather", '
                                                              '"arguments": {"city": "Paris"}') \
        < prompt.index("22 C, sunny")
    # A third turn chains on: the whole conversation is there, once.
    engine.script = "You are welcome."
    third = client.responses.create(model="mock-model", previous_response_id=second.id,
                                    input="Thanks!")
    prompt = prompt_of(engine)
    assert prompt.count("What is the weather in Paris?") == 1
    assert "It is 22 C and sunny in Paris." in prompt and prompt.count("Thanks!") == 1
    assert third.output_text == "You are welcome."


def test_tool_choice_forms(server, engine):
    engine.script = CALL
    for choice in ("required", {"type": "function", "name": "get_weather"},
                   {"type": "allowed_tools", "mode": "required",
                    "tools": [{"type": "function", "name": "get_weather"}]}):
        r = post(server, {"input": "Weather?", "tools": [WEATHER_TOOL], "tool_choice": choice,
                          "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        assert r.json()["output"][0]["type"] == "function_call"
        assert r.json()["tool_choice"] == choice and r.json()["parallel_tool_calls"] is False
    engine.script = "No tools."
    r = post(server, {"input": "Weather?", "tools": [WEATHER_TOOL], "tool_choice": "none"})
    assert r.json()["output"][0]["content"][0]["text"] == "No tools."
    assert "get_weather" not in prompt_of(engine)


# ---- stored responses -------------------------------------------------------------------------

def test_get_and_delete(client, server):
    r = client.responses.create(model="mock-model", input="Hi")
    got = http("GET", f"{server.url}/v1/responses/{r.id}")
    assert got.status_code == 200 and got.json() == r.model_dump(exclude_unset=True)
    validate(got.json(), "Response")
    assert client.responses.retrieve(r.id).output_text == "Hello there."
    d = http("DELETE", f"{server.url}/v1/responses/{r.id}")
    assert d.status_code == 200 and d.json() == {"id": r.id, "object": "response.deleted",
                                                 "deleted": True}
    for method in ("GET", "DELETE"):
        gone = http(method, f"{server.url}/v1/responses/{r.id}")
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_store_false_keeps_nothing(client, server):
    r = client.responses.create(model="mock-model", input="Hi", store=False)
    assert http("GET", f"{server.url}/v1/responses/{r.id}").status_code == 404
    nxt = post(server, {"input": "Hi", "previous_response_id": r.id})
    assert nxt.status_code == 404 and nxt.json()["error"]["param"] == "previous_response_id"
    s = http("POST", server.url + "/v1/responses", {"model": "mock-model", "input": "Hi",
                                                    "stream": True})
    rid = events_of(s.text)[-1]["response"]["id"]
    assert http("GET", f"{server.url}/v1/responses/{rid}").status_code == 200


def test_store_bounds():
    def resp(i, size=10):
        return {"id": f"resp_{i}", "output": ["x" * size]}
    s = ResponseStore(max_count=3, max_bytes=10_000)
    for i in range(5):
        assert s.put(resp(i), [])
    assert len(s) == 3 and "resp_0" not in s and "resp_1" not in s
    assert s.get("resp_2") is not None          # a use: now resp_3 is the oldest
    s.put(resp(5), [])
    assert "resp_3" not in s and "resp_2" in s
    s = ResponseStore(max_count=100, max_bytes=1000)
    for i in range(4):
        s.put(resp(i, 300), [{"role": "user", "content": "hi"}])
    assert len(s) == 2 and s.bytes <= 1000 and "resp_3" in s and "resp_2" in s
    assert not s.put(resp(9, 2000), []) and "resp_9" not in s and len(s) == 2
    before = s.bytes
    assert s.delete("resp_3") and not s.delete("resp_3") and s.bytes < before
    s.put(resp(2, 10), [])                      # replacing one counts its new size only
    assert len(s) == 1 and s.bytes < 100
    assert len(ResponseStore(max_count=0)) == 0 and not ResponseStore(max_count=0).put(
        resp(1), [])


def test_server_store_evicts(engine):
    from maxjax.server.responses_api import RESPONSES
    s = ServerThread(engine)
    try:
        s.app[RESPONSES].max_count = 2
        ids = [post(s, {"input": f"Hi {i}"}).json()["id"] for i in range(3)]
        assert [http("GET", f"{s.url}/v1/responses/{i}").status_code for i in ids] == \
            [404, 200, 200]
    finally:
        s.close()


def test_engine_failure(server, engine):
    engine.fail_after = 3
    try:
        r = http("POST", server.url + "/v1/responses", {"model": "mock-model", "input": "Hi",
                                                        "stream": True})
        events = events_of(r.text)
        assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert failed["output"][0]["content"][0]["text"] == "Hel"   # what had been sent
        assert http("GET", f"{server.url}/v1/responses/{failed['id']}").status_code == 404
        whole = post(server, {"input": "Hi"})
        assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"
        engine.fail_after = 0                   # before the first token: an HTTP error
        r = post(server, {"input": "Hi", "stream": True})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    finally:
        engine.fail_after = None


# ---- bad requests -------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "tools": [{"type": "custom", "name": "x"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "namespace", "name": "n", "description": "",
                                "tools": [{"type": "custom", "name": "x"}]}]},
     "tools[0].tools[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "background": True, "stream": True}, "background"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": 5}}},
     "text.format.schema"),
    ({"input": "hi", "tools": [{**WEATHER_TOOL, "name": "bad name"}]}, "tools[0].name"),
    ({"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                             "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "truncation": "sometimes"}, "truncation"),
    ({"input": "hi", "n": 2}, "n"),
    ({"input": "hi", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "hi", "model": "other-model"}, "model"),
])
def test_bad_requests_name_the_field(server, engine, body, param):
    n = len(engine.requests)
    r = post(server, body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param in err["message"] or param == "model", err
    validate(r.json(), "ErrorResponse")
    assert len(engine.requests) == n             # nothing reached the engine
    assert post(server, {"input": "still serving"}).status_code == 200


def test_truncation_auto_is_accepted(server):
    r = post(server, {"input": "hi", "truncation": "auto", "reasoning": {"effort": "low",
                                                                         "summary": "auto"}})
    assert r.status_code == 200 and r.json()["reasoning"] == {"effort": "low",
                                                              "summary": "auto"}


# ---- reasoning ------------------------------------------------------------------------------------

def test_reasoning_item(engine):
    s = ServerThread(engine, ServeConfig(reasoning_parser="qwen3"))
    try:
        engine.script = "<think>Paris is in France.</think>It is Paris."
        whole = post(s, {"input": "Capital of France?"}).json()
        assert [it["type"] for it in whole["output"]] == ["reasoning", "message"]
        rs = whole["output"][0]
        assert rs["id"].startswith("rs_") and rs["summary"] == []
        assert rs["content"] == [{"type": "reasoning_text", "text": "Paris is in France."}]
        assert whole["output"][1]["content"][0]["text"] == "It is Paris."
        events = events_of(http("POST", s.url + "/v1/responses", {
            "model": "mock-model", "input": "Capital of France?", "stream": True}).text)
        final = check_order(events)
        assert stripped(final["output"]) == stripped(whole["output"])
        assert "response.reasoning_text.delta" in [e["type"] for e in events]
        # A reasoning item given back as input is dropped, not an error.
        nxt = post(s, {"input": whole["output"] + [{"role": "user", "content": "And Spain?"}]})
        assert nxt.status_code == 200 and "Paris is in France" not in prompt_of(engine)
    finally:
        s.close()


# ---- openai-agents ---------------------------------------------------------------------------------

def test_openai_agents_runs_a_tool(server, engine):
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"22 degrees in {city}"

    engine.script_for = lambda prompt: ("The weather in Paris is 22 degrees."
                                        if "22 degrees in Paris" in prompt else CALL)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=server.url + "/v1",
                                                        api_key="x", max_retries=0),
                                     use_for_tracing=False)
    agents.set_tracing_disabled(True)
    agent = agents.Agent(name="weather", instructions="Answer with the tool.",
                         model="mock-model", tools=[get_weather])
    assert isinstance(agents.OpenAIProvider().get_model("mock-model"),
                      agents.OpenAIResponsesModel)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert calls == ["Paris"]
    assert result.final_output == "The weather in Paris is 22 degrees."
    # The second turn carried the call and its result back in its input items.
    prompt = prompt_of(engine)
    assert "Answer with the tool." in prompt and "22 degrees in Paris" in prompt


def test_openai_agents_streamed(server, engine):
    agents = pytest.importorskip("agents")
    import asyncio

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"22 degrees in {city}"

    engine.script_for = lambda prompt: ("The weather in Paris is 22 degrees."
                                        if "22 degrees in Paris" in prompt else CALL)
    model = agents.OpenAIResponsesModel("mock-model", openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="x", max_retries=0))
    agents.set_tracing_disabled(True)
    agent = agents.Agent(name="weather", model=model, tools=[get_weather])

    async def run():
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?")
        kinds = [e.type async for e in result.stream_events()]
        return result, kinds
    result, kinds = asyncio.run(run())
    assert result.final_output == "The weather in Paris is 22 degrees."
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


# ---- the real model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_chat):
    return smollm2_chat


def test_smollm2_whole_and_streamed(smollm2):
    eng, s = smollm2
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="smollm2", input="What is the capital of France?", max_output_tokens=12,
              temperature=0, instructions="Answer in one short sentence.",
              include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**kw)
    validate(whole.model_dump(exclude_unset=True), "Response")
    assert whole.output_text.strip() and whole.status in ("completed", "incomplete")
    assert whole.usage.output_tokens <= 12
    logprobs = whole.output[0].content[0].logprobs     # the text's tokens, the argmax each
    assert "".join(lp.token for lp in logprobs) == whole.output_text
    assert all(lp.top_logprobs[0].token == lp.token for lp in logprobs)
    r = http("POST", s.url + "/v1/responses", {**kw, "stream": True}, timeout=120)
    final = check_order(events_of(r.text))
    assert final["output"][0]["content"][0]["text"] == whole.output_text
    assert [e["token"] for e in final["output"][0]["content"][0]["logprobs"]] == \
        [lp.token for lp in logprobs]
    assert final["status"] == whole.status
    st = eng.core.stats()
    assert st.kv.pages_used == 0 and st.scheduler.running == 0
