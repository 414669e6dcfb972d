"""Chat output parsing (server/chat_output.py, reasoning.py, tools.py): every tool-call format
and both reasoning parsers, whole and fed one character at a time (the streamed deltas must
reassemble to the whole message, no partial tag in content); the forcing grammars accept what the
parsers read; reasoning through the server with a scripted engine emitting <think>a</think>b,
streaming and not; a grammar that starts after </think>."""
import json

import numpy as np
import openai
import pytest
from mock_engine import MockEngine
from server_harness import ServerThread

from maxjax.server import chat_render
from maxjax.server.chat_output import ChatOutput
from maxjax.server.config import ServeConfig
from maxjax.server.tools import format_calls, parse_calls, tool_grammar

CALLS = [{"function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
         {"function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
FNS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}},
       {"name": "add", "parameters": {"type": "object", "properties": {
           "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}]


def whole_and_streamed(text, **kw):
    """The whole message and the streamed deltas, as chat completions renders them."""
    fields = ("reasoning_content", "reasoning")
    whole = ChatOutput(**kw)
    whole.feed(text)
    whole.finish()
    st = ChatOutput(**kw)
    deltas = [chat_render.delta(p, fields) for ch in text for p in st.feed(ch)] + [
        chat_render.delta(p, fields) for p in st.finish()]
    got = {"content": "", "reasoning": "", "calls": {}}
    for d in deltas:
        assert set(d) <= {"content", "reasoning", "reasoning_content", "tool_calls"}, d
        got["content"] += d.get("content", "")
        got["reasoning"] += d.get("reasoning", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                got["calls"][tc["index"]] = [tc["function"]["name"], ""]
            else:
                got["calls"][tc["index"]][1] += tc["function"]["arguments"]
    m = chat_render.message(whole.message(), fields)
    assert got["content"] == (m["content"] or "")
    assert got["reasoning"] == m.get("reasoning", "")
    assert list(got["calls"].values()) == [[c["function"]["name"], c["function"]["arguments"]]
                                           for c in m.get("tool_calls", [])]
    return m


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_each_format_round_trips(parser):
    text = format_calls(parser, CALLS)
    m = whole_and_streamed(text, tool_parser=parser)
    assert m["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in m["tool_calls"]] == [(c["function"]["name"], json.loads(
                c["function"]["arguments"])) for c in CALLS]
    assert parse_calls(parser, text) is not None


def test_forcing_grammars_accept_the_format():
    import llguidance
    import llguidance.hf
    from mock_engine import byte_tokenizer
    tok = byte_tokenizer()
    lt = llguidance.hf.from_tokenizer(tok)
    for parser in ("hermes", "llama3_json", "mistral", "pythonic"):
        for parallel, calls in ((False, CALLS[:1]), (True, CALLS)):
            m = llguidance.LLMatcher(lt, llguidance.grammar_from(
                "lark", tool_grammar(parser, FNS, parallel)), log_level=0)
            assert m.consume_tokens(tok.encode(format_calls(parser, calls),
                                               add_special_tokens=False)), (parser, m.get_error())
            assert m.is_accepting()
        m = llguidance.LLMatcher(lt, llguidance.grammar_from(
            "lark", tool_grammar(parser, FNS, False)), log_level=0)
        assert not m.consume_tokens(tok.encode(format_calls(parser, CALLS),
                                               add_special_tokens=False)), parser


@pytest.mark.parametrize("text,content,calls", [
    ('Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "Sure. ", 1),
    ("Not a <tool_ call, <tool_call", "Not a <tool_ call, <tool_call", 0),
    ('<tool_call>\n{"name": broken</tool_call>', '<tool_call>\n{"name": broken</tool_call>', 0),
])
def test_hermes_content_and_broken_calls(text, content, calls):
    m = whole_and_streamed(text, tool_parser="hermes")
    assert (m["content"] or "") == content and len(m.get("tool_calls", [])) == calls


def test_plain_text_is_content_for_whole_output_formats():
    for parser in ("llama3_json", "pythonic"):
        assert whole_and_streamed("Hello there", tool_parser=parser)["content"] == "Hello there"


@pytest.mark.parametrize("parser,prompt,text,reasoning,content", [
    ("qwen3", "", "<think>a</think>b", "a", "b"),
    ("qwen3", "", "<think>\nlong thought</think>\n\nanswer", "\nlong thought", "answer"),
    ("qwen3", "", "no thinking <think>", "", "no thinking <think>"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "a</think>b", "a", "b"),
    ("deepseek_r1", "", "a</think>b", "a", "b"),
    ("deepseek_r1", "", "<think>a</think>b", "a", "b"),
])
def test_reasoning_split(parser, prompt, text, reasoning, content):
    m = whole_and_streamed(text, reasoning_parser=parser, prompt_text=prompt)
    assert (m.get("reasoning", ""), m["content"]) == (reasoning, content)
    if reasoning:
        assert m["reasoning_content"] == reasoning


def test_typed_parts_carry_the_parsed_call():
    """The parser's output is typed: a call is a start (id, name) then its arguments' JSON, and
    the whole message keeps the parsed arguments (Anthropic's tool_use input is them, not a
    re-parse of the JSON); a call's finish is TOOL_CALLS with the engine's STOP kept, unless
    the output was cut (LENGTH)."""
    from maxjax.engine.types import FinishReason
    from maxjax.server.chat_events import Text, ToolCallArgs, ToolCallStart
    from maxjax.server.chat_run import finish
    from maxjax.server.generation import Choice
    out = ChatOutput(tool_parser="hermes")
    parts = out.feed('Hi <tool_call>\n{"name": "f", "arguments": {"x": [1, "é"]}}\n</tool_call>')
    parts += out.finish()
    call = out.message().tool_calls[0]
    assert parts == [Text("Hi "), ToolCallStart(0, call.id, "f"),
                     ToolCallArgs(0, '{"x": [1, "é"]}')]
    assert call.args == {"x": [1, "é"]} and out.message().content == "Hi "
    c = Choice(0, "r", 0, 1, finish_reason=FinishReason.STOP)
    assert (finish(c, out).reason, finish(c, out).raw) == (FinishReason.TOOL_CALLS,
                                                           FinishReason.STOP)
    c.finish_reason = FinishReason.LENGTH
    assert finish(c, out).reason == FinishReason.LENGTH and finish(c, out).truncated


@pytest.fixture(scope="module")
def server():
    s = ServerThread(MockEngine(script="<think>a</think>b"), ServeConfig(reasoning_parser="qwen3"))
    yield s
    s.close()


def test_reasoning_through_the_server(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="mock-model", messages=[{"role": "user", "content": "hi"}], max_tokens=50)
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.content == "b"
    assert msg.model_extra["reasoning_content"] == "a" == msg.model_extra["reasoning"]
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        assert "<" not in (delta.content or "") + (delta.model_extra.get("reasoning") or "")
        reasoning += delta.model_extra.get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == ("a", "b")


def test_emit_reasoning_content_flags():
    assert ServeConfig(emit_reasoning_content=True).reasoning_fields() == ("reasoning_content",)
    assert ServeConfig(emit_reasoning_content=False).reasoning_fields() == ("reasoning",)


def test_grammar_starts_after_think():
    """GrammarState: unconstrained (no mask) through the reasoning block, then the JSON grammar
    from the first token after </think>."""
    from mock_engine import byte_tokenizer

    from maxjax.structured import GrammarSpec
    from maxjax.structured.backend import GrammarBackend
    tok = byte_tokenizer()
    backend = GrammarBackend(tok, len(tok), [tok.eos_token_id])
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"]}).after("</think>")
    state = backend.new_state(backend.compiled(spec), spec)
    for ch in "<think>I may write { or anything</think>":
        assert not state.mask_needed
        assert state.accept(tok.encode(ch, add_special_tokens=False))
    assert state.mask_needed
    bits = np.unpackbits(backend.fill_masks([state])[0].view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [ord("{")]
    assert state.accept(tok.encode('{"a":12}', add_special_tokens=False)) and state.is_stopped
    backend.shutdown()


def test_chat_template_kwargs_reach_the_template():
    from server_harness import http
    template = ("{% if enable_thinking is defined and not enable_thinking %}NOTHINK{% endif %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    s = ServerThread(MockEngine(chat_template=template))
    try:
        def prompt_tokens(**kw):
            r = http("POST", s.url + "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **kw})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == \
            prompt_tokens() + len("NOTHINK")
        r = http("POST", s.url + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"tools": []}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.tools"
    finally:
        s.close()
