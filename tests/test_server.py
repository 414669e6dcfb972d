"""The OpenAI-compatible server against tests/mock_engine.py, with the real `openai` client:
chat and completions, streaming and not, n, stop, logprobs, echo, usage, content parts,
parameter mapping, models, health, tokenize. Response bodies are validated against the
official spec's schemas (tests/openai_schemas.json)."""
import json

import openai
import pytest
from mock_engine import (CHAT_TEMPLATE, OUTPUT_TEXT, MockEngine, byte_tokenizer, expected_text,
                         token_logprob)
from server_harness import ServerThread, http, validate

from maxjax.engine.stats import EngineStats
from maxjax.server.config import ServeConfig

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    s = ServerThread(MockEngine())
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_prompt_len(messages) -> int:
    tok = byte_tokenizer()
    text = tok.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                   add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


def post(server, path, body, **kw):
    return http("POST", server.url + path, body, **kw)


def get(url):
    return http("GET", url)


def sse_events(resp) -> list:
    """The data payloads of an SSE body; the last must be [DONE]."""
    lines = [ln for ln in resp.text.split("\n\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_models_and_health(server):
    r = get(server.url + "/v1/models")
    assert r.status_code == 200
    validate(r.json(), "ListModelsResponse")
    assert [m["id"] for m in r.json()["data"]] == ["mock-model"]
    r = get(server.url + "/v1/models/mock-model")
    validate(r.json(), "Model")
    for path in ("/health", "/v1/health"):
        assert get(server.url + path).status_code == 200


class Loading:
    """An engine still loading: no tokenizer, name or max_length yet (like maxjax/cli/serve.py's
    LoadingEngine); the server must be built and answer 503 without touching them."""

    def __init__(self):
        self.inner = None

    @property
    def is_ready(self):
        return self.inner is not None

    def __getattr__(self, name):
        if self.__dict__.get("inner") is None:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def stats(self):
        return EngineStats()


def test_not_ready_is_503():
    engine = Loading()
    s = ServerThread(engine)
    try:
        assert get(s.url + "/health").status_code == 503
        assert get(s.url + "/v1/health").status_code == 503
        for path, body in [("/v1/chat/completions", {"model": "mock-model", "messages": MSGS}),
                           ("/v1/completions", {"prompt": "x"}), ("/v1/tokenize", {"prompt": "x"})]:
            r = post(s, path, body)
            assert r.status_code == 503, r.text
            validate(r.json(), "ErrorResponse")
        assert get(s.url + "/v1/models").status_code == 503
        assert get(s.url + "/metrics").status_code == 200
        engine.inner = MockEngine()
        assert get(s.url + "/health").status_code == 200
        r = post(s, "/v1/chat/completions", {"model": "mock-model", "messages": MSGS,
                                             "max_tokens": 2})
        assert r.json()["choices"][0]["message"]["content"] == "Th"
    finally:
        s.close()


def test_chat(server, client):
    r = client.chat.completions.create(model="mock-model", messages=MSGS, max_tokens=12)
    text, reason = expected_text(12)
    assert r.choices[0].message.content == text == "The quick br"
    assert r.choices[0].finish_reason == reason == "length"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == chat_prompt_len(MSGS)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    raw = post(server, "/v1/chat/completions", {"model": "mock-model", "messages": MSGS,
                                                "max_tokens": 5})
    validate(raw.json(), "CreateChatCompletionResponse")
    assert raw.json()["system_fingerprint"]


def test_chat_default_max_tokens_fills_context(server, client):
    r = client.chat.completions.create(model="mock-model", messages=MSGS)
    assert r.usage.total_tokens == server.engine.max_length
    assert r.choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream(server, client):
    kw = dict(model="mock-model", messages=MSGS, max_tokens=40, stop=["lazy"])
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content == "The quick brown fox jumps over the "
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        full.usage.completion_tokens == len("The quick brown fox jumps over the lazy")
    assert all(c.usage is None for c in chunks[:-1])
    raw = post(server, "/v1/chat/completions", {**kw, "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    for e in events:
        validate(e, "CreateChatCompletionStreamResponse")
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"


def test_chat_n2_with_seed(server, client):
    r = client.chat.completions.create(model="mock-model", messages=MSGS, max_tokens=6, n=2,
                                       seed=4)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == expected_text(6, seed=4)[0]
    assert r.choices[1].message.content == expected_text(6, seed=5)[0]
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == chat_prompt_len(MSGS)   # the shared prompt counts once
    reqs = server.engine.requests[-2:]
    assert reqs[0][1] == reqs[1][1]
    chunks = list(client.chat.completions.create(model="mock-model", messages=MSGS,
                                                 max_tokens=6, n=2, stream=True))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(ch.delta.content or "" for ch in mine) == expected_text(6)[0]
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == ["length"]


def test_stop_strings(client):
    r = client.chat.completions.create(model="mock-model", messages=MSGS, max_tokens=40,
                                       stop="fox")
    assert r.choices[0].message.content == "The quick brown "
    assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="mock-model", prompt="x", max_tokens=40,
                                  stop=["dog", "over"])
    assert r.choices[0].text == "The quick brown fox jumps "
    assert r.choices[0].finish_reason == "stop"


def test_chat_logprobs(server, client):
    r = client.chat.completions.create(model="mock-model", messages=MSGS, max_tokens=4,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == list("The ")
    for t in content:
        b = ord(t.token)
        assert t.logprob == pytest.approx(token_logprob(b))
        assert t.bytes == [b]
        assert [x.token for x in t.top_logprobs] == [chr(b), chr(b + 1), chr(b + 2)]
        assert t.top_logprobs[2].logprob == pytest.approx(token_logprob(b) - 2)
    raw = post(server, "/v1/chat/completions", {"model": "mock-model", "messages": MSGS,
                                                "max_tokens": 3, "logprobs": True,
                                                "top_logprobs": 2})
    validate(raw.json(), "CreateChatCompletionResponse")
    raw = post(server, "/v1/chat/completions", {"model": "mock-model", "messages": MSGS,
                                                "max_tokens": 3, "logprobs": True,
                                                "stream": True})
    events = sse_events(raw)
    for e in events:
        validate(e, "CreateChatCompletionStreamResponse")
    toks = [t["token"] for e in events for ch in e["choices"] if ch["logprobs"]
            for t in ch["logprobs"]["content"]]
    assert toks == list("The")


def test_completions(server, client):
    r = client.completions.create(model="mock-model", prompt="hello", max_tokens=7)
    assert r.choices[0].text == "The qui"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 7
    raw = post(server, "/v1/completions", {"model": "mock-model", "prompt": "hello",
                                           "max_tokens": 3, "logprobs": 2})
    validate(raw.json(), "CreateCompletionResponse")
    lp = raw.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["T", "h", "e"]
    assert lp["text_offset"] == [0, 1, 2]
    assert lp["token_logprobs"] == pytest.approx([token_logprob(ord(c)) for c in "The"])
    assert lp["top_logprobs"][0] == pytest.approx({"T": token_logprob(84),
                                                   "U": token_logprob(84) - 1})


def test_completions_echo(client):
    r = client.completions.create(model="mock-model", prompt="hi", max_tokens=3, echo=True,
                                  logprobs=1)
    c = r.choices[0]
    assert c.text == "hiThe"
    assert c.logprobs.tokens == list("hiThe")
    assert c.logprobs.token_logprobs[0] is None          # the first prompt token has no logprob
    assert c.logprobs.token_logprobs[1] == pytest.approx(token_logprob(ord("i")))
    assert c.logprobs.text_offset == [0, 1, 2, 3, 4]
    chunks = list(client.completions.create(model="mock-model", prompt="hi", max_tokens=3,
                                            echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == "hiThe"
    # a character split over tokens (each piece shown as U+FFFD): the offsets went back to
    # len(prompt text) after the prompt's pieces, and past the text's end
    for stream in (False, True):
        got = client.completions.create(model="mock-model", prompt="a\U0001F40Bb", max_tokens=3,
                                        echo=True, logprobs=1, stream=stream)
        chunks = list(got) if stream else [got]
        text = "".join(ch.choices[0].text for ch in chunks)
        offsets = [o for ch in chunks if ch.choices[0].logprobs
                   for o in ch.choices[0].logprobs.text_offset]
        assert text == "a\U0001F40BbThe" and len(offsets) == 9
        assert offsets == sorted(offsets) and offsets[-3:] == [3, 4, 5], offsets


def test_best_of_below_n_is_refused(server):
    r = post(server, "/v1/completions", {"model": "mock-model", "prompt": "hi", "max_tokens": 2,
                                         "n": 3, "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def test_null_takes_the_default(server):
    """The spec's "integer or null, default 1": a field sent as null is the field left out."""
    r = post(server, "/v1/chat/completions", {"model": "mock-model", "messages": MSGS,
                                              "max_tokens": 2, "n": None, "min_tokens": None,
                                              "ignore_eos": None, "skip_special_tokens": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    r = post(server, "/v1/completions", {"model": "mock-model", "prompt": "hi", "n": None,
                                         "max_tokens": 2, "echo": None})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Th", r.text
    r = post(server, "/tokenize", {"model": "mock-model", "prompt": "hi",
                                   "return_token_strs": None})
    assert r.status_code == 200 and r.json()["tokens"] == [104, 105], r.text
    r = post(server, "/v1/chat/completions", {"model": "mock-model", "messages": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_completions_default_max_tokens_is_what_the_prompt_leaves(server):
    """OpenAI's default of 16, cut to what the prompt leaves of the maximum length (vLLM's):
    a long prompt without max_tokens is not a 400 about a field the client never sent."""
    most = server.engine.max_length
    r = post(server, "/v1/completions", {"model": "mock-model", "prompt": [104] * (most - 3)})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = post(server, "/v1/completions", {"model": "mock-model", "prompt": [104] * (most - 3),
                                         "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = post(server, "/v1/completions", {"model": "mock-model", "prompt": [104] * most})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_completions_echo_with_max_tokens_0_scores_the_prompt(server, client):
    """The legacy API's prompt scoring (lm-evaluation-harness's loglikelihood request): the
    prompt and its logprobs, nothing generated."""
    r = client.completions.create(model="mock-model", prompt="hi", max_tokens=0, echo=True,
                                  logprobs=1)
    c = r.choices[0]
    assert (c.text, c.finish_reason, r.usage.completion_tokens) == ("hi", "length", 0)
    assert c.logprobs.tokens == ["h", "i"] and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1] == pytest.approx(token_logprob(ord("i")))
    chunks = list(client.completions.create(model="mock-model", prompt="hi", max_tokens=0,
                                            echo=True, logprobs=1, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == "hi"
    assert [t for ch in chunks for t in ch.choices[0].logprobs.tokens] == ["h", "i"]
    assert chunks[-1].choices[0].finish_reason == "length"
    r = post(server, "/v1/completions", {"model": "mock-model", "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    for field in ("max_tokens", "max_completion_tokens"):     # chat has no prompt to echo
        r = post(server, "/v1/chat/completions", {"model": "mock-model", "messages": MSGS,
                                                  field: 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_completions_prompt_forms(server, client):
    r = client.completions.create(model="mock-model", prompt=["ab", "cde"], max_tokens=2, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text == "Th" for c in r.choices)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8
    r = client.completions.create(model="mock-model", prompt=[104, 105], max_tokens=2)
    assert server.engine.requests[-1][1] == [104, 105]
    r = client.completions.create(model="mock-model", prompt=[[104], [105, 106]], max_tokens=2)
    assert [req[1] for req in server.engine.requests[-2:]] == [[104], [105, 106]]
    assert r.usage.prompt_tokens == 3


def test_completions_stream_equals_non_stream(server, client):
    kw = dict(model="mock-model", prompt="x", max_tokens=20, stop=["jumps"])
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices
            and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 20
    events = sse_events(post(server, "/v1/completions", {**kw, "stream": True}))
    for e in events:
        # The spec reuses CreateCompletionResponse for chunks but cannot express the null
        # finish_reason every chunk before the last carries (as OpenAI's own stream does).
        assert e["choices"][0]["finish_reason"] in (None, "length")
        e["choices"][0]["finish_reason"] = "length"
        validate(e, "CreateCompletionResponse")


def test_content_parts_and_roles(server, client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    client.chat.completions.create(model="mock-model", messages=parts, max_tokens=1)
    joined = server.engine.requests[-1][1]
    client.chat.completions.create(model="mock-model", messages=[
        {"role": "user", "content": "a\nb"}], max_tokens=1)
    assert server.engine.requests[-1][1] == joined
    convo = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
             {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"},
             {"role": "tool", "content": "T", "tool_call_id": "c1"}]
    client.chat.completions.create(model="mock-model", messages=convo, max_tokens=1)
    prompt = server.engine.tokenizer.decode(server.engine.requests[-1][1])
    for role, content in [("system", "S"), ("developer", "D"), ("user", "U"),
                          ("assistant", "A"), ("tool", "T")]:
        assert f"<|im_start|>{role}\n{content}<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_sampling_parameters_reach_the_engine(server):
    r = post(server, "/v1/chat/completions", {
        "model": "mock-model", "messages": MSGS, "max_tokens": 9, "max_completion_tokens": 3,
        "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 11,
        "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.2,
        "logit_bias": {"65": 5, "66": -100}, "min_tokens": 2, "ignore_eos": True,
        "stop_token_ids": [256], "cache_salt": "salt", "user": "u1", "store": False})
    assert r.status_code == 200, r.text
    _, _, p, salt = server.engine.requests[-1]
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == \
        (3, 0.5, 0.9, 7, 0.1, 11)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logit_bias == {65: 5.0, 66: -100.0}
    assert (p.min_tokens, p.ignore_eos, p.stop_token_ids, salt) == (2, True, [256], "salt")
    post(server, "/v1/completions", {"model": "mock-model", "prompt": "x"})
    p = server.engine.requests[-1][2]
    assert (p.max_new_tokens, p.temperature, p.top_k, p.logprobs) == (16, 1.0, 0, False)


def test_any_int64_seed_on_every_route(server):
    """A seed is any int64, as OpenAI and vLLM take it (the spec's format int64): negative and
    extreme seeds reach the engine as sent, n > 1 wraps choice j's seed + j within int64, and
    just outside int64 is a 400 naming seed."""
    bodies = {"/v1/chat/completions": {"messages": MSGS, "max_tokens": 4},
              "/v1/completions": {"prompt": "x", "max_tokens": 4},
              "/v1/responses": {"input": "x", "max_output_tokens": 4}}
    for path, body in bodies.items():
        for seed in (-1, -2**63, 2**63 - 1):
            r = post(server, path, {**body, "model": "mock-model", "seed": seed})
            assert r.status_code == 200, (path, seed, r.text)
            assert server.engine.requests[-1][2].seed == seed
        for seed in (-2**63 - 1, 2**63):
            r = post(server, path, {**body, "seed": seed})
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed", (path, r.text)
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "n": 3,
                                         "seed": 2**63 - 2})
    assert [q[2].seed for q in server.engine.requests[-3:]] == [2**63 - 2, 2**63 - 1, -2**63]
    texts = [post(server, "/v1/completions", {"prompt": "x", "max_tokens": 6, "seed": -7}
                  ).json()["choices"][0]["text"] for _ in range(2)]
    assert texts == [expected_text(6, seed=-7)[0]] * 2


def test_server_sampling_defaults():
    s = ServerThread(MockEngine(), ServeConfig(temperature=0.25, top_k=5,
                                               served_model_name="alias"))
    try:
        r = post(s, "/v1/completions", {"model": "alias", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "alias"
        p = s.engine.requests[-1][2]
        assert (p.temperature, p.top_k) == (0.25, 5)
        post(s, "/v1/completions", {"prompt": "x", "max_tokens": 1, "temperature": 0,
                                    "top_k": 0})
        p = s.engine.requests[-1][2]
        assert (p.temperature, p.top_k) == (0.0, 0)
    finally:
        s.close()


def test_tokenize_detokenize(server):
    r = post(server, "/v1/tokenize", {"prompt": "Hi"})
    assert r.json() == {"count": 2, "max_model_len": 512, "tokens": [72, 105],
                        "token_strs": None}
    r = post(server, "/tokenize", {"messages": MSGS})
    assert r.json()["count"] == chat_prompt_len(MSGS)
    # token_strs: the tokenizer's own tokens (vLLM's convert_ids_to_tokens), a byte-level
    # space as "Ġ" and each byte of "é" as its byte's character, not decoded text ("\ufffd")
    r = post(server, "/tokenize", {"prompt": "a é", "return_token_strs": True})
    assert r.json()["tokens"] == [97, 32, 0xC3, 0xA9]
    assert r.json()["token_strs"] == ["a", "Ġ", "Ã", "©"]
    r = post(server, "/v1/tokenize", {"messages": MSGS, "return_token_strs": True})
    assert r.json()["token_strs"] == server.engine.tokenizer.convert_ids_to_tokens(
        r.json()["tokens"]) and "<|im_start|>" in r.json()["token_strs"]
    r = post(server, "/v1/detokenize", {"tokens": [72, 105]})
    assert r.json() == {"prompt": "Hi"}
    r = post(server, "/v1/detokenize", {"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_mock_output_text_is_what_tests_assume():
    assert OUTPUT_TEXT.startswith("The quick brown fox jumps over the lazy dog")
