"""Sampling defaults on real engines (maxjax/models/sampling_defaults.py): a tiny random HF
checkpoint's generation_config.json reaches the offline LLM and the server's requests that set no
sampling field; the embedded SmolLM2's defaults (its card's temperature 0.2 and top_p 0.9 with
llama.cpp's min_p 0.05) hold token by token on seeded greetings, and a request's own
temperature 1, top_p 1, min_p 0 samples past them."""
from __future__ import annotations

import concurrent.futures
import math

import pytest
from server_harness import ServerThread, http
from test_sampling_defaults import hf_dir

import maxjax
from maxjax.engine.async_engine import AsyncEngine
from maxjax.engine.types import SamplingParams
from maxjax.models import sampling_defaults as sd

pytestmark = pytest.mark.slow

# top_k 1: whatever the temperature, a request that takes these defaults is greedy
GENERATION = {"temperature": 0.7, "top_p": 0.8, "top_k": 1, "min_p": 0.1,
              "repetition_penalty": 1.1}
PROMPT = "w5 w9 w17 w33"


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    path = hf_dir(tmp_path_factory.mktemp("tiny") / "m", GENERATION)
    return path, maxjax.LLM(path, max_batch_size=4, max_batch_input_tokens=16, max_length=64,
                            num_kv_pages=40, kv_cache_page_size=8)


def test_offline_generate_without_params_takes_generation_config(tiny_llm):
    _, llm = tiny_llm
    p = llm.get_default_sampling_params()
    assert {f: getattr(p, f) for f in sd.FIELDS} == GENERATION
    p.max_new_tokens = 12
    taken = llm.generate([PROMPT] * 3, p)
    greedy = llm.generate([PROMPT], SamplingParams(max_new_tokens=12, temperature=0,
                                                   repetition_penalty=1.1))[0].token_ids
    assert [o.token_ids for o in taken] == [greedy] * 3
    # ...and not by chance: this random model samples other tokens at OpenAI's defaults
    raw = llm.generate([PROMPT] * 3, [SamplingParams(max_new_tokens=12, seed=s)
                                      for s in range(3)])
    assert all(o.token_ids != greedy for o in raw)


def test_served_requests_without_sampling_fields_take_generation_config(tiny_llm):
    """Last in the module: the server's engine runs the LLM's core from here on."""
    path, llm = tiny_llm
    engine = AsyncEngine(llm.core, llm.tokenizer, "tiny", None)
    seen = []
    generate = engine.generate

    def spy(rid, ids, params, *args, **kw):
        seen.append({f: getattr(params, f) for f in sd.FIELDS})
        return generate(rid, ids, params, *args, **kw)
    engine.generate = spy
    engine.start()
    server = ServerThread(engine)
    try:
        card = http("GET", server.url + "/v1/models").json()["data"][0]["sampling_defaults"]
        assert card == {**GENERATION, "source": f"{path}/generation_config.json"}
        texts = set()
        for _ in range(3):
            r = http("POST", server.url + "/v1/completions",
                     {"prompt": PROMPT, "max_tokens": 12}, timeout=120)
            assert r.status_code == 200, r.text
            texts.add(r.json()["choices"][0]["text"])
        assert seen == [GENERATION] * 3 and len(texts) == 1      # greedy by top_k 1
        raw = {"temperature": 1, "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1}
        r = http("POST", server.url + "/v1/completions",
                 {"prompt": PROMPT, "max_tokens": 12, "seed": 1, **raw}, timeout=120)
        assert r.status_code == 200, r.text
        assert seen[-1] == {**raw, "top_k": 0}
    finally:
        server.close()
        engine.shutdown()


GREETINGS = ["Hi!", "Hello!", "Hey there", "Good morning!", "Hi, how are you?", "Hello, who are "
             "you?", "Hey!", "Good evening", "Hi there!", "Hello again", "Yo!", "Greetings!",
             "Hi :)", "Hello friend", "Hey, what's up?", "Good afternoon!", "Howdy!",
             "Hi, nice to meet you", "Hello there!", "Hiya"]


def greet(url: str, text: str, seed: int, **sampling) -> list[tuple[float, float]]:
    """(the sampled token's logprob, its step's top logprob) of each answer token."""
    r = http("POST", url + "/v1/chat/completions", {
        "model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": 24,
        "seed": seed, "logprobs": True, "top_logprobs": 1, **sampling}, timeout=300)
    assert r.status_code == 200, r.text
    return [(t["logprob"], t["top_logprobs"][0]["logprob"])
            for t in r.json()["choices"][0]["logprobs"]["content"]]


def all_greetings(url: str, **sampling) -> list[tuple[float, float]]:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = pool.map(lambda a: greet(url, *a, **sampling), zip(GREETINGS, range(20)))
        return [t for answer in answers for t in answer]


def test_embedded_greetings_keep_to_the_default_min_p(smollm2_chat):
    """The logprobs are of the processed logits at temperature 1 (graphs/sampling.py), while
    min-p keeps a token when p_T(token) >= min_p * p_T(top) for p_T = softmax(logits / T).
    p_T(a) / p_T(b) = exp((l_a - l_b) / T) = exp((logprob_a - logprob_b) / T), so a kept token
    has logprob >= top logprob + T * ln(min_p): at the card's T 0.2 and llama.cpp's min_p 0.05,
    within 0.6 nats of the step's top token. A request's own temperature 1, top_p 1 and min_p 0
    gets the raw distribution (the embedded model has no top_k default) and samples tokens far
    below that bound."""
    _, server = smollm2_chat
    card = http("GET", server.url + "/v1/models").json()["data"][0]["sampling_defaults"]
    assert card == {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.05,
                    "repetition_penalty": 1.0, "source": "SmolLM2-135M-Instruct's model card, "
                                                         "llama.cpp's min_p"}
    bound = card["temperature"] * math.log(card["min_p"])
    tokens = all_greetings(server.url)
    assert len(tokens) >= 100
    below = [(lp, top) for lp, top in tokens if lp < top + bound - 1e-3]
    assert not below, below
    raw = all_greetings(server.url, temperature=1, top_p=1, min_p=0)
    assert sum(lp < top + bound - 1e-3 for lp, top in raw) >= 10
