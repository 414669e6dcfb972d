"""Sampled structured output through the server never leaves its grammar (issue: "A sampler that
never leaves the grammar"): the reported request (a long integer array at the default sampling,
1,000 tokens) for seeds 0-49, and a stream at temperature 1 over every structured-output schema.
A grammar fault would be a 500 and a count in maxjax_grammar_faults, never a 400."""
import concurrent.futures
import json

import jsonschema
import pytest
import requests
from server_harness import ServerThread
from structured_schemas import SCHEMAS, prompt

pytestmark = pytest.mark.slow

ENGINE = dict(max_length=1152, max_batch_size=32, max_batch_input_tokens=256,
              kv_cache_page_size=16, num_kv_pages=2400)
LONG_ARRAY = {"type": "object", "required": ["v"], "properties": {
    "v": {"type": "array", "items": {"type": "integer"}, "minItems": 1500}}}


@pytest.fixture(scope="module")
def server():
    from maxjax.engine.async_engine import AsyncEngine
    from maxjax.engine.build import build_core
    from maxjax.engine.config import EngineConfig
    core = build_core(None, EngineConfig(**ENGINE))
    eng = AsyncEngine(core, core.model.tokenizer, "smollm2", core.model.chat_template)
    eng.start()
    srv = ServerThread(eng)
    yield srv
    srv.close()
    eng.shutdown()


def _chat(server, body: dict, stream: bool = False):
    return requests.post(f"{server.url}/v1/chat/completions", json=body, stream=stream,
                         timeout=900)


def _grammar_faults(server) -> float:
    for line in requests.get(f"{server.url}/metrics", timeout=60).text.splitlines():
        if line.startswith("maxjax_grammar_faults_total"):
            return float(line.split()[-1])
    raise AssertionError("maxjax_grammar_faults_total is not in /metrics")


@pytest.mark.timeout(3600)     # 50,000 tokens: ~3 minutes on a quiet 2-core machine
def test_the_reported_request_passes_for_seeds_0_to_49(server):
    def one(seed):
        r = _chat(server, {
            "model": "smollm2", "seed": seed, "max_tokens": 1000,
            "messages": [{"role": "user", "content": "List many random integers."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": LONG_ARRAY}}})
        return seed, r.status_code, r.json()
    with concurrent.futures.ThreadPoolExecutor(25) as pool:
        results = list(pool.map(one, range(50)))
    for seed, status, body in results:
        assert status == 200, (seed, body)
        choice = body["choices"][0]
        # 1,500 integers do not fit 1,000 tokens: each output is a valid prefix cut by length
        assert choice["finish_reason"] == "length", (seed, choice)
        text = choice["message"]["content"]
        assert text.startswith('{"v":') or text.startswith('{ "v"'), (seed, text[:80])
        assert all(c in '{}[]":v, -0123456789\n\t' for c in text), (seed, text)
    assert _grammar_faults(server) == 0


@pytest.mark.timeout(1800)
def test_constrained_streams_at_temperature_1_keep_their_grammar(server):
    def one(i):
        what, schema = SCHEMAS[i]
        r = _chat(server, {
            "model": "smollm2", "seed": 1000 + i, "temperature": 1.0, "top_p": 1.0,
            "min_p": 0.0, "top_k": 0, "max_tokens": 400, "stream": True,
            "messages": prompt(what),
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema}}}, stream=True)
        assert r.status_code == 200, r.text
        text, finish = "", None
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, (what, event)
            for c in event["choices"]:
                text += c["delta"].get("content") or ""
                finish = c.get("finish_reason") or finish
        return what, schema, text, finish
    with concurrent.futures.ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(one, range(len(SCHEMAS))))
    for what, schema, text, finish in results:
        assert finish in ("stop", "length"), (what, finish, text)
        if finish == "stop":       # complete: it validates; cut by length: a prefix, unchecked
            jsonschema.validate(json.loads(text), schema)
    assert _grammar_faults(server) == 0
