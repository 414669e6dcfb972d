"""Tool calling on a tiny random Qwen2 checkpoint whose chat template handles tools
(tests/tiny_qwen.py), through the real server and the `openai` client: tools reach the template,
`auto` parses the hermes calls the model writes (here steered into that format by a regex, the
weights being random), `required` is forced in the model's format with its <tool_call> token, and
a tool result renders through the template in the next turn."""
import json

import jsonschema
import openai
import pytest
from server_harness import ServerThread, http
from tiny_qwen import write_tiny_qwen

from maxjax.engine.async_engine import AsyncEngine
from maxjax.engine.build import build_core
from maxjax.engine.config import EngineConfig

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
          "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_qwen(tmp_path_factory.mktemp("qwen"))
    core = build_core(path, EngineConfig(max_length=512, max_batch_size=4,
                                         max_batch_input_tokens=64, kv_cache_page_size=16,
                                         num_kv_pages=80))
    eng = AsyncEngine(core, core.model.tokenizer, "qwen", core.model.chat_template)
    eng.start()
    s = ServerThread(eng)
    yield s
    s.close()
    assert core.stats().kv.pages_used == 0 and core.step_compiles == 0
    eng.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def prompt_text(server, messages, **kw) -> str:
    ids = http("POST", server.url + "/tokenize", {"messages": messages}).json()["tokens"]
    return http("POST", server.url + "/detokenize", {"tokens": ids}).json()["prompt"]


def test_auto_parses_hermes_output(client, server):
    # <tool_call> is one added token: a Lark grammar names it by id (server/tools.py _lit)
    call = ('<[49152]> "\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" '
            '/[A-Za-z]{1,10}/ "\\"}}\\n" <[49153]>')
    for stream in (False, True):
        kw = dict(model="qwen", messages=MSGS, tools=TOOLS, tool_choice="auto", max_tokens=60,
                  temperature=0, extra_body={"structured_outputs": {"grammar": f"start: {call}"}})
        if stream:
            names, args, finish = [], "", None
            for chunk in client.chat.completions.create(stream=True, **kw):
                d = chunk.choices[0].delta
                assert not d.content, "no partial tag in content"
                for tc in d.tool_calls or []:
                    names += [tc.function.name] if tc.id else []
                    args += tc.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            assert names == ["get_weather"] and finish == "tool_calls"
            jsonschema.validate(json.loads(args), PARAMS)
        else:
            ch = client.chat.completions.create(**kw).choices[0]
            assert ch.finish_reason == "tool_calls" and ch.message.content is None
            jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments), PARAMS)


def test_required_is_forced_in_the_model_format(client):
    r = client.chat.completions.create(model="qwen", messages=MSGS, tools=TOOLS,
                                       tool_choice="required", max_tokens=80, temperature=0.7,
                                       seed=1)
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), PARAMS)


def test_tools_and_tool_results_render_through_the_template(server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    text = prompt_text(server, turn)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            in text)
    assert "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>" in text
    r = http("POST", server.url + "/v1/chat/completions",
             {"messages": turn, "tools": TOOLS, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > len(text) // 8   # the <tools> prompt is in


def test_grammar_starts_after_the_reasoning(server):
    """deepseek_r1: the output starts inside <think>. A +100 bias on </think> makes the random
    model end the block at once; the JSON grammar applies only from the next token (it would
    have masked </think> otherwise), so the content is the JSON and the block is reasoning."""
    from maxjax.server.config import ServeConfig
    think_end = server.engine.tokenizer.convert_tokens_to_ids("</think>")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = {"messages": MSGS, "max_tokens": 30, "temperature": 0,
            "logit_bias": {str(think_end): 100},
            "response_format": {"type": "json_schema", "json_schema": {"name": "s",
                                                                       "schema": schema}}}
    plain = http("POST", server.url + "/v1/chat/completions", body).json()
    assert json.loads(plain["choices"][0]["message"]["content"]) in ({"ok": True}, {"ok": False})
    reasoning = ServerThread(server.engine, ServeConfig(reasoning_parser="deepseek_r1"))
    try:
        r = http("POST", reasoning.url + "/v1/chat/completions", body).json()
    finally:
        reasoning.close()
    msg = r["choices"][0]["message"]
    jsonschema.validate(json.loads(msg["content"]), schema)
    assert r["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] + 1
