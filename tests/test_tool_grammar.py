"""Tool calls that frameworks can trust, without a model: the grammars (forced and auto's lazy
one) over a byte tokenizer, and the server through the official `openai` client with a
scripted engine that decodes under the request's grammar the way the real engine does (a
scripted byte the grammar refuses is replaced by the first byte it allows). Covers: a forced call
cut off by max_tokens (no markup in content, finish_reason length, streamed too), `$ref`/`$defs`
parameters under required and named tools, a tool without parameters, `auto` unable to name an
unknown function, whitespace after the last call not committing to another call, non-strict
schemas served with the unenforced keywords named in a header while strict ones are refused,
and completions' max_tokens null meaning 16."""
import json

import llguidance
import llguidance.hf
import openai
import pytest
from mock_engine import EOS_ID, MockEngine, byte_tokenizer
from server_harness import ServerThread, http

from maxjax.engine.types import RequestOutput
from maxjax.server.structured import WARNINGS_HEADER
from maxjax.server.tools import lazy_tool_grammar, tool_grammar
from maxjax.structured.backend import GrammarBackend

CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["name"]}
NESTED = {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
          "required": ["city"], "$defs": {"City": CITY}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": NESTED}},
         {"type": "function", "function": {"name": "get_time"}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": {"name": "Paris"}}}\n</tool_call>'
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def matcher(grammar: str):
    lt = llguidance.hf.from_tokenizer(byte_tokenizer())
    m = llguidance.LLMatcher(lt, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(grammar: str, text: str) -> bool:
    m = matcher(grammar)
    return m.consume_tokens(byte_tokenizer().encode(text, add_special_tokens=False)) \
        and m.is_accepting()


FNS = [t["function"] for t in TOOLS]


def test_forced_grammar_takes_refs_and_no_parameters():
    g = tool_grammar("hermes", FNS, True)
    assert accepts(g, CALL)
    assert accepts(g, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(g, '<tool_call>\n{"name": "get_time", "arguments": {"x": 1}}\n</tool_call>')
    assert not accepts(g, CALL.replace("Paris", "P" * 13))         # the $ref's maxLength


def test_newline_after_the_last_call_can_end_the_output():
    """A model writes a newline after </tool_call> before its end-of-turn token; a grammar
    whose separator is that newline forced another call (the repeats seen with parallel)."""
    m = matcher(tool_grammar("hermes", FNS, True))
    assert m.consume_tokens(byte_tokenizer().encode(CALL + "\n", add_special_tokens=False))
    assert m.is_accepting()
    assert accepts(tool_grammar("hermes", FNS, True), CALL + "\n" + CALL)


@pytest.mark.parametrize("parallel", [False, True])
def test_auto_grammar_holds_calls_not_text(parallel):
    g = lazy_tool_grammar("hermes", FNS, parallel)
    assert accepts(g, "Just some text, no tools.")
    assert accepts(g, "Let me check. " + CALL)
    assert not accepts(g, '<tool_call>\n{"name": "calm_weather", "arguments": {}}\n</tool_call>')
    assert accepts(g, CALL + "\n" + CALL) == parallel


class GrammarMockEngine(MockEngine):
    """Decodes its script under the request's grammar (llguidance over the byte tokenizer): a
    byte the grammar refuses becomes EOS where the grammar may end, else the first byte it
    allows. So a test scripts what a model would like to write."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.grammars = GrammarBackend(self.tokenizer, len(self.tokenizer), [EOS_ID])

    def info(self):
        return {**super().info(), "structured_output": True}

    def generate(self, request_id, prompt_token_ids, params, cache_salt=None, lora=None):
        spec = params.structured_output
        if spec is None:
            return super().generate(request_id, prompt_token_ids, params, cache_salt, lora)
        self.requests.append((request_id, list(prompt_token_ids), params, cache_salt))
        return self._constrained(request_id, params, spec)

    async def _constrained(self, rid, params, spec):
        state = self.grammars.new_state(await self.grammars.compiled_async(spec), spec)
        want, out = list(self.script.encode()), []
        while len(out) < params.max_new_tokens:
            mask = self.grammars.fill_masks([state])[0] if state.mask_needed else None
            allowed = (lambda t: True) if mask is None else \
                (lambda t: (int(mask[t // 32]) >> (t % 32)) & 1)
            t = want[len(out)] if len(out) < len(want) else EOS_ID
            if not allowed(t):
                t = EOS_ID if allowed(EOS_ID) else \
                    next(i for i in range(len(self.tokenizer)) if allowed(i))
            if t == EOS_ID:
                break
            state.accept([t])
            out.append(t)
        reason = "length" if len(out) == params.max_new_tokens else "stop"
        yield RequestOutput(request_id=rid, new_token_ids=out,
                            new_text=self.tokenizer.decode(out), finished=True,
                            finish_reason=reason, prompt_tokens=1, completion_tokens=len(out))


@pytest.fixture
def serve():
    servers = []

    def start(script, cls=GrammarMockEngine):
        s = ServerThread(cls(script=script, max_length=4096))
        servers.append(s)
        return s, openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    yield start
    for s in servers:
        s.close()


def test_a_forced_call_cut_off_is_length_without_markup(serve):
    _, client = serve(CALL + "\n" + CALL)
    r = client.chat.completions.create(model="mock-model", messages=MSGS, tools=TOOLS,
                                       tool_choice="required", max_tokens=len(CALL) + 10)
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert not c.message.content and len(c.message.tool_calls) == 1
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": {"name": "Paris"}}
    chunks = list(client.chat.completions.create(
        model="mock-model", messages=MSGS, tools=TOOLS, tool_choice="required",
        max_tokens=len(CALL) + 10, stream=True))
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    r = client.chat.completions.create(model="mock-model", messages=MSGS, tools=TOOLS,
                                       tool_choice="required", max_tokens=20)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.content
    assert not r.choices[0].message.tool_calls


def test_nested_pydantic_tool_under_required_and_named(serve):
    import pydantic

    class City(pydantic.BaseModel):
        name: str

    class GetWeather(pydantic.BaseModel):
        city: City
    _, client = serve('<tool_call>\n{"name": "GetWeather", "arguments": {"city": {"name": '
                      '"Oslo"}}}\n</tool_call>')
    tool = openai.pydantic_function_tool(GetWeather)
    assert "$defs" in json.dumps(tool)
    for choice in ("required", {"type": "function", "function": {"name": "GetWeather"}}):
        r = client.chat.completions.parse(model="mock-model", messages=MSGS, tools=[tool],
                                          tool_choice=choice, max_tokens=200)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.parsed_arguments == GetWeather(city=City(name="Oslo"))


def test_a_tool_without_parameters_gets_empty_arguments(serve):
    _, client = serve('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC", "x": 1}}')
    r = client.chat.completions.create(model="mock-model", messages=MSGS, tools=TOOLS[1:],
                                       tool_choice="required", max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.arguments == "{}"


def test_auto_cannot_name_an_unknown_function(serve):
    _, client = serve('Sure. <tool_call>\n{"name": "calm_weather", "arguments": {}}\n</tool_call>')
    r = client.chat.completions.create(model="mock-model", messages=MSGS, tools=TOOLS,
                                       max_tokens=120)
    m = r.choices[0].message
    assert m.content == "Sure. "
    assert [c.function.name for c in m.tool_calls] in (["get_weather"], ["get_time"])


def test_unheld_auto_calls_to_unknown_functions_are_content(serve):
    text = '<tool_call>\n{"name": "Paris", "arguments": {}}\n</tool_call>'
    _, client = serve(text, MockEngine)        # no grammar engine: the parser is the guard
    r = client.chat.completions.create(model="mock-model", messages=MSGS, tools=TOOLS,
                                       max_tokens=120)
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls


def test_non_strict_schemas_are_served_and_strict_ones_refused(serve):
    s, _ = serve('{"tags":["a","b"]}')
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True,
                                                        "items": {"type": "string"}}},
              "required": ["tags"]}
    body = {"messages": MSGS, "max_tokens": 40, "response_format": {
        "type": "json_schema", "json_schema": {"name": "t", "schema": schema}}}
    r = http("POST", s.url + "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert "uniqueItems" in r.headers[WARNINGS_HEADER]
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"tags": ["a", "b"]}
    body["response_format"]["json_schema"]["strict"] = True
    r = http("POST", s.url + "/v1/chat/completions", body)
    assert r.status_code == 400 and "uniqueItems" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"
    # a strict tool's parameters: refused naming the tool, in a line without the grammar
    tool = {"type": "function", "function": {"name": "tag", "parameters": schema,
                                             "strict": True}}
    for choice in ("auto", "required"):
        r = http("POST", s.url + "/v1/chat/completions", {
            "messages": MSGS, "max_tokens": 40, "tools": [TOOLS[0], tool], "tool_choice": choice})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tools[1].function.parameters", err
        assert "uniqueItems" in err["message"] and "%json" not in err["message"], err


def test_completions_max_tokens_null_is_16(serve):
    s, _ = serve("x" * 100, MockEngine)
    r = http("POST", s.url + "/v1/completions", {"prompt": "a", "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
