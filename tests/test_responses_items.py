"""The Responses API around a response (server/responses_api.py): its input items listed, a
request's input counted, truncation "auto", the `include` values, the output text's logprobs
(whole and streamed), and background responses (polled, cancelled, deleted, bounded, ended at
shutdown). The mock engine's byte tokenizer makes a token of each byte, so lengths here are the
prompts' bytes and a text's logprobs are one per character."""
import time

import openai
import pydantic
import pytest
from mock_engine import MockEngine, token_logprob
from openai.types.responses import ResponseItem
from openai.types.responses.input_token_count_response import InputTokenCountResponse
from server_harness import ServerThread, http, validate
from test_responses_api import CALL, WEATHER_TOOL, check_order, events_of

from maxjax.server.config import ServeConfig

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
    engine.script, engine.delay, engine.fail_on = "Hello there.", 0.0, None
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
    for include in (["reasoning.encrypted_content"], ["message.output_text.logprobs"]):
        ok = http("POST", server.url + "/v1/responses", {
            "model": "mock-model", "input": "Hi", "include": include})
        assert ok.status_code == 200, ok.text
    for bad in (["bogus"],):
        r = http("POST", server.url + "/v1/responses", {"model": "mock-model", "input": "Hi",
                                                        "include": bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("include"), r.text


def test_a_stored_response_is_not_streamed_back(client, server):
    r = client.responses.create(model="mock-model", input="Hi")
    got = http("GET", f"{server.url}/v1/responses/{r.id}?stream=true")
    assert got.status_code == 400 and got.json()["error"]["param"] == "stream"
    assert http("GET", f"{server.url}/v1/responses/{r.id}?stream=false").status_code == 200


# ---- logprobs ------------------------------------------------------------------------------------

LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}


def create(server, body: dict):
    r = http("POST", server.url + "/v1/responses", {"model": "mock-model", **body})
    if r.status_code == 200 and not body.get("stream"):
        validate(r.json(), "Response")
    return r


def expected_logprobs(text: str) -> list[dict]:
    """The mock's: a token per byte, logprob -(t % 10) / 10, alternatives t + 1, t + 2..."""
    def entry(t, lp):
        return {"token": chr(t), "logprob": lp, "bytes": [t]}
    return [{**entry(t, token_logprob(t)),
             "top_logprobs": [entry(t + j, token_logprob(t) - j) for j in range(2)]}
            for t in text.encode()]


def test_output_text_logprobs_whole_and_streamed(server, engine):
    whole = create(server, {"input": "Hi", **LOGPROBS}).json()
    part = whole["output"][0]["content"][0]
    validate(part, "OutputTextContent")
    assert part["logprobs"] == expected_logprobs("Hello there.") and whole["top_logprobs"] == 2
    p = engine.requests[-1][2]
    assert (p.logprobs, p.top_logprobs) == (True, 2)
    events = events_of(create(server, {"input": "Hi", "stream": True, **LOGPROBS}).text)
    final = check_order(events)
    assert final["output"][0]["content"][0]["logprobs"] == part["logprobs"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [e["logprobs"] for e in deltas] == [
        [{"token": d["delta"], "logprob": token_logprob(ord(d["delta"])),
          "top_logprobs": [{"token": chr(ord(d["delta"]) + j),
                            "logprob": token_logprob(ord(d["delta"])) - j} for j in range(2)]}]
        for d in deltas]
    done, = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == [lp for e in deltas for lp in e["logprobs"]]


def test_logprobs_only_when_included(server, engine):
    """As OpenAI and vLLM: top_logprobs alone returns none (and asks the engine for none)."""
    r = create(server, {"input": "Hi", "top_logprobs": 3}).json()
    assert r["output"][0]["content"][0]["logprobs"] == [] and r["top_logprobs"] == 3
    assert engine.requests[-1][2].logprobs is False
    r = create(server, {"input": "Hi", "include": ["message.output_text.logprobs"]}).json()
    assert [e["top_logprobs"] for e in r["output"][0]["content"][0]["logprobs"]] == [[]] * 12


def test_logprobs_are_the_message_texts_tokens():
    """The tokens of a tool call or of reasoning (its end tag too) are not the text's."""
    engine = MockEngine(max_length=4096)         # room for the tool prompt
    s = ServerThread(engine, ServeConfig(reasoning_parser="qwen3"))
    try:
        for script, body, text in [
                ("Let me check.\n" + CALL, {"tools": [WEATHER_TOOL]}, "Let me check.\n"),
                ("<think>Paris is in France.</think>It is Paris.", {}, "It is Paris.")]:
            engine.script = script
            for stream in (False, True):
                r = create(s, {"input": "Hi", "stream": stream, **body, **LOGPROBS})
                out = check_order(events_of(r.text)) if stream else r.json()
                msg, = [it for it in out["output"] if it["type"] == "message"]
                assert len(out["output"]) == 2 and msg["content"][0]["text"] == text
                assert msg["content"][0]["logprobs"] == expected_logprobs(text), (script, stream)
    finally:
        s.close()
    assert engine.pages_used == 0


# ---- background ----------------------------------------------------------------------------------

def wait_for(cond, what: str, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)
    return got


def retrieve(server, rid: str):
    r = http("GET", f"{server.url}/v1/responses/{rid}")
    if r.status_code == 200:
        validate(r.json(), "Response")
    return r


def test_background_runs_on_and_is_polled(client, server, engine):
    engine.delay = 0.02
    r = create(server, {"input": "Hi", "background": True})
    queued = r.json()
    assert r.status_code == 200 and queued["background"] is True
    assert queued["status"] in ("queued", "in_progress") and queued["output"] == []
    done = wait_for(lambda: (j := retrieve(server, queued["id"]).json())["status"] not in
                    ("queued", "in_progress") and j, "the background response to end")
    assert done["status"] == "completed" and done["background"] is True
    assert done["output"][0]["content"][0]["text"] == "Hello there."
    assert done["usage"]["output_tokens"] == 12
    # answered (its connection closed) before any output, it ran on to its end
    assert f"{queued['id']}-0" in engine.finished and f"{queued['id']}-0" not in engine.aborted
    assert client.responses.retrieve(queued["id"]).output_text == "Hello there."
    nxt = create(server, {"input": "And?", "previous_response_id": queued["id"]})
    assert nxt.status_code == 200 and "Hello there." in engine.tokenizer.decode(
        engine.requests[-1][1])


def test_cancel_aborts_and_frees_pages(client, server, engine):
    engine.script, engine.delay = None, 0.02
    rid = create(server, {"input": "Hi", "background": True, "max_output_tokens": 400,
                          **LOGPROBS}).json()["id"]
    wait_for(lambda: engine.pages_used > 0 and retrieve(server, rid).json()["output"],
             "tokens held in pages")
    running = retrieve(server, rid).json()
    assert running["status"] == "in_progress" and running["output"][0]["content"][0]["text"]
    follow = create(server, {"input": "More", "previous_response_id": rid})
    assert follow.status_code == 400 and follow.json()["error"]["param"] == \
        "previous_response_id"
    r = http("POST", f"{server.url}/v1/responses/{rid}/cancel")
    assert r.status_code == 200, r.text
    validate(r.json(), "Response")
    cancelled = r.json()
    assert cancelled["status"] == "cancelled" and cancelled["id"] == rid
    assert engine.pages_used == 0 and not engine.running and f"{rid}-0" in engine.aborted
    text = cancelled["output"][0]["content"][0]["text"]
    assert 0 < len(text) < 400 and cancelled["usage"]["output_tokens"] >= len(text)
    assert len(cancelled["output"][0]["content"][0]["logprobs"]) == len(text)
    assert retrieve(server, rid).json() == cancelled
    assert http("POST", f"{server.url}/v1/responses/{rid}/cancel").json() == cancelled
    assert client.responses.cancel(rid).status == "cancelled"


def test_cancel_errors(server, engine):
    sync = create(server, {"input": "Hi"}).json()["id"]
    r = http("POST", f"{server.url}/v1/responses/{sync}/cancel")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    assert "Cannot cancel a synchronous response." in r.json()["error"]["message"]
    validate(r.json(), "ErrorResponse")
    finished = create(server, {"input": "Hi", "background": True}).json()["id"]
    wait_for(lambda: retrieve(server, finished).json()["status"] == "completed", "the end")
    r = http("POST", f"{server.url}/v1/responses/{finished}/cancel")
    assert r.status_code == 400 and "completed" in r.json()["error"]["message"]
    r = http("POST", f"{server.url}/v1/responses/resp_nope/cancel")
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


def test_a_failed_background_response_says_why(server, engine):
    engine.fail_on = "boom"
    rid = create(server, {"input": "boom", "background": True}).json()["id"]
    failed = wait_for(lambda: (j := retrieve(server, rid).json())["status"] == "failed" and j,
                      "the failure")
    assert failed["error"]["code"] == "server_error" and "engine" in failed["error"]["message"]


def test_delete_cancels_a_running_response(server, engine):
    engine.script, engine.delay = None, 0.02
    rid = create(server, {"input": "Hi", "background": True, "max_output_tokens": 400}
                 ).json()["id"]
    wait_for(lambda: engine.pages_used > 0, "the generation to run")
    r = http("DELETE", f"{server.url}/v1/responses/{rid}")
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert engine.pages_used == 0 and f"{rid}-0" in engine.aborted
    assert retrieve(server, rid).status_code == 404


def test_background_is_bounded_and_ends_at_shutdown(engine):
    """No more run at once than the store keeps; a server that stops cancels what still
    runs (its pages freed)."""
    from maxjax.server.responses_api import RESPONSES
    s = ServerThread(engine)
    engine.script, engine.delay = None, 0.02
    try:
        s.app[RESPONSES].max_count = 1
        first = create(s, {"input": "Hi", "background": True, "max_output_tokens": 400})
        assert first.status_code == 200
        r = create(s, {"input": "Hi", "background": True})
        assert r.status_code == 429 and r.json()["error"]["param"] == "background"
        wait_for(lambda: engine.pages_used > 0, "the generation to run")
    finally:
        s.close()
    assert engine.pages_used == 0 and f"{first.json()['id']}-0" in engine.aborted

