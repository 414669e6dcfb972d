"""The Responses API around a response (server/responses_api.py): its input items listed, a
request's input counted, truncation "auto", and the `include` values. The mock engine's byte
tokenizer makes a token of each byte, so lengths here are the prompts' bytes."""
import openai
import pydantic
import pytest
from mock_engine import MockEngine
from openai.types.responses import ResponseItem
from openai.types.responses.input_token_count_response import InputTokenCountResponse
from server_harness import ServerThread, http

MAX_LENGTH = 600


@pytest.fixture(scope="module")
def engine():
    return MockEngine(max_length=MAX_LENGTH)


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
    engine.script = "Hello there."
    yield
    assert engine.pages_used == 0 and not engine.running


def prompt_of(engine) -> str:
    return engine.tokenizer.decode(engine.requests[-1][1])


def test_input_items_list_the_conversation(client, server):
    first = client.responses.create(model="mock-model", input="Hi")
    second = client.responses.create(model="mock-model", previous_response_id=first.id,
                                     input=[{"role": "user", "content": "Again"}])
    page = client.responses.input_items.list(second.id)
    items = [pydantic.TypeAdapter(ResponseItem).validate_python(i.model_dump())
             for i in page.data]
    # newest first: this turn's input, the first turn's answer (its own id), its input
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"),
                                                 ("message", "user")]
    assert items[0].content[0].text == "Again" and items[2].content[0].text == "Hi"
    assert items[1].id == first.output[0].id and items[1].content[0].text == "Hello there."
    assert len({i.id for i in items}) == 3 and not page.has_more
    asc = http("GET", f"{server.url}/v1/responses/{second.id}/input_items?order=asc&limit=1")
    body = asc.json()
    assert asc.status_code == 200 and body["object"] == "list" and body["has_more"]
    assert body["data"][0]["id"] == items[2].id == body["first_id"] == body["last_id"]
    rest = http("GET", f"{server.url}/v1/responses/{second.id}/input_items?order=asc"
                       f"&after={items[2].id}").json()
    assert [i["id"] for i in rest["data"]] == [items[1].id, items[0].id]
    assert not rest["has_more"]
    # the ids are the same on every listing
    assert [i.id for i in client.responses.input_items.list(second.id).data] == \
        [i.id for i in items]


@pytest.mark.parametrize("query, param, status", [
    ("?limit=0", "limit", 400), ("?limit=x", "limit", 400), ("?order=up", "order", 400),
    ("?after=msg_nope", "after", 404)])
def test_input_items_bad_queries_name_the_field(client, server, query, param, status):
    r = client.responses.create(model="mock-model", input="Hi")
    got = http("GET", f"{server.url}/v1/responses/{r.id}/input_items{query}")
    assert got.status_code == status and got.json()["error"]["param"] == param, got.text
    gone = http("GET", f"{server.url}/v1/responses/resp_nope/input_items")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"


def test_input_tokens_count_what_create_would_prompt(client, engine):
    tool = {"type": "function", "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    fields = dict(model="mock-model", input="Weather in Paris?", instructions="Be brief.",
                  tools=[tool])
    counted = client.responses.input_tokens.count(**fields)
    InputTokenCountResponse.model_validate(counted.model_dump())
    client.responses.create(**fields)
    assert counted.input_tokens == len(engine.requests[-1][1])
    assert counted.input_tokens > client.responses.input_tokens.count(
        model="mock-model", input="Weather in Paris?").input_tokens


def test_truncation_auto_drops_the_oldest_items(server, engine):
    items = [{"role": "user" if i % 2 == 0 else "assistant",
              "content": f"item {i} " + "x" * 150} for i in range(5)]
    items.append({"role": "user", "content": "The last question?"})
    body = {"model": "mock-model", "input": items, "instructions": "Stay brief.",
            "max_output_tokens": 16}
    whole = http("POST", server.url + "/v1/responses", body)
    assert whole.status_code == 400 and whole.json()["error"]["param"] == "input"
    n = len(engine.requests)
    cut = http("POST", server.url + "/v1/responses", {**body, "truncation": "auto"})
    assert cut.status_code == 200, cut.text
    assert len(engine.requests) == n + 1 and cut.json()["truncation"] == "auto"
    prompt = prompt_of(engine)
    assert "Stay brief." in prompt and "The last question?" in prompt
    kept = [i for i in range(5) if f"item {i} " in prompt]
    assert kept and kept == list(range(kept[0], 5)) and kept[0] > 0
    assert len(engine.requests[-1][1]) + 16 <= MAX_LENGTH
    # the fewest dropped: one more item would not fit
    back = {**body, "input": items[kept[0] - 1:]}
    assert http("POST", server.url + "/v1/responses", back).status_code == 400


def test_truncation_auto_leaves_no_orphan_tool_output(server, engine):
    """Dropping a function call drops the output that answers it (a tool message without its
    call is no conversation a template renders)."""
    call = {"type": "function_call", "call_id": "call_1", "name": "f",
            "arguments": '{"a": "%s"}' % ("z" * 300)}
    out = {"type": "function_call_output", "call_id": "call_1", "output": "y" * 250}
    items = [{"role": "user", "content": "x" * 50}, call, out, {"role": "user", "content": "Now?"}]
    r = http("POST", server.url + "/v1/responses", {"model": "mock-model", "input": items,
                                                    "truncation": "auto"})
    assert r.status_code == 200, r.text
    prompt = prompt_of(engine)
    assert "Now?" in prompt and "x" * 50 not in prompt and "z" * 300 not in prompt
    assert "y" * 250 not in prompt


def test_include_values(server):
    ok = http("POST", server.url + "/v1/responses", {
        "model": "mock-model", "input": "Hi", "include": ["reasoning.encrypted_content"]})
    assert ok.status_code == 200, ok.text
    for bad in (["bogus"], ["message.output_text.logprobs"]):
        r = http("POST", server.url + "/v1/responses", {"model": "mock-model", "input": "Hi",
                                                        "include": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("include"), r.text


def test_a_stored_response_is_not_streamed_back(client, server):
    r = client.responses.create(model="mock-model", input="Hi")
    got = http("GET", f"{server.url}/v1/responses/{r.id}?stream=true")
    assert got.status_code == 400 and got.json()["error"]["param"] == "stream"
    assert http("GET", f"{server.url}/v1/responses/{r.id}?stream=false").status_code == 200
