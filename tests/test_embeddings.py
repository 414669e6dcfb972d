"""POST /v1/embeddings and the engine's embedding requests (prefill only, through the same steps
as generation): last-token and mean pooled vectors equal transformers' final hidden states
(after the final norm) pooled and normalized, on the embedded SmolLM2 and on a tiny random Qwen3,
through chunked prefill; 64 inputs in one request, and embeddings batched in the same steps as
generation streams (both still correct); the route through the official `openai` client (float
and base64) and bad input 400s naming the field (mock engine); a client gone aborts its inputs
(no page kept); no page leaked, no compile after warm-up."""
import base64
import json
import os
import socket
import threading
import time

import numpy as np
import openai
import pytest
from mock_engine import EMBED_DIM, MockEngine, mock_embedding
from server_harness import ServerThread, http, validate

from maxjax.engine.async_engine import AsyncEngine
from maxjax.engine.build import build_core
from maxjax.engine.config import EngineConfig

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

COS = 0.9999
TEXTS = ["Hello", "The capital of France is Paris.", "def fibonacci(n):\n    return n",
         "Embeddings map text to vectors; similar meanings land close together. " * 12]


def unit(v):
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


def cosine(a, b) -> float:
    return float(np.dot(unit(a), unit(b)))


def hf_embedding(model, ids, pooling: str):
    """transformers' reference: the last entry of output_hidden_states (after the final norm),
    pooled and L2-normalized."""
    import torch
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    h = out.hidden_states[-1][0].double().numpy()
    return unit(h[-1] if pooling == "last" else h.mean(0))


# ---- the scheduler's side, no model ----------------------------------------------------------

def test_scheduler_runs_an_embedding_as_a_prompt_that_samples_nothing():
    from maxjax.engine.block_manager import BlockManager
    from maxjax.engine.core import EMBEDDING_SAMPLING
    from maxjax.engine.request import Request
    from maxjax.engine.scheduler import Scheduler
    from maxjax.engine.types import PoolingParams, SamplingParams
    from pool_check import check_pool
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    sch = Scheduler(EngineConfig(max_batch_size=4, max_batch_input_tokens=8), bm, 64)
    emb = Request("e", list(range(3, 20)), EMBEDDING_SAMPLING, pooling=PoolingParams())
    gen = Request("g", [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=4, ignore_eos=True))
    sch.add(gen)
    sch.add(emb)                  # 17 tokens: chunks beside the decodes, the last of 1 token
    chunks, mixed = [], False
    while sch.has_unfinished():
        plan = sch.schedule()
        rows = {r.request.request_id: r for r in plan.rows}
        mixed |= len(rows) == 2
        if "e" in rows:
            assert not rows["e"].sample and rows["e"].num_samples == 0
            chunks.append(len(rows["e"].token_ids))
        updates = sch.update(plan, [7 if r.sample else None for r in plan.rows])
        if "e" in rows and emb.is_finished:
            assert [u.token_ids for u in updates if u.request is emb] == [[]]
        check_pool(bm, sch.running)
    assert sum(chunks) == 17 and len(chunks) >= 3 and mixed, chunks
    assert emb.finish_reason == "stop" and emb.num_output_tokens == 0 and not emb.pages
    assert gen.num_output_tokens == 4
    # only gen's full pages (8 of its 9 tokens computed) are cached
    assert bm.num_used_pages == 0 and bm.num_cached_pages == 2


def test_pooled_states_start_over_with_a_chunk_from_position_0():
    from maxjax.engine.output import pooled_embedding
    from maxjax.engine.request import Request
    from maxjax.engine.types import PoolingParams
    req = Request("e", [1, 2, 3, 4], pooling=PoolingParams("mean"))
    req.add_pooled(0, np.full(2, 100.0), np.ones(2))         # then preempted: recomputed
    req.add_pooled(0, np.array([1.0, 2.0]), np.array([0.0, 1.0]))
    req.add_pooled(2, np.array([3.0, 2.0]), np.array([3.0, 4.0]))
    np.testing.assert_allclose(pooled_embedding(req), unit([4.0, 4.0]), rtol=1e-6)
    req.pooling = PoolingParams("last")
    np.testing.assert_allclose(pooled_embedding(req), [0.6, 0.8], rtol=1e-6)
    req.pooling = PoolingParams("last", normalize=False)
    np.testing.assert_allclose(pooled_embedding(req), [3.0, 4.0])


# ---- the route, on the mock engine ----------------------------------------------------------

@pytest.fixture(scope="module")
def mock():
    return MockEngine(max_length=64)


@pytest.fixture(scope="module")
def mock_server(mock):
    s = ServerThread(mock)
    yield s
    s.close()


@pytest.fixture(scope="module")
def mock_client(mock_server):
    return openai.OpenAI(base_url=mock_server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_float_and_base64(mock, mock_server, mock_client):
    texts = ["hello", "a longer input", "x"]
    want = [mock_embedding(list(t.encode())) for t in texts]
    r = mock_client.embeddings.create(model="mock-model", input=texts, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2] and r.object == "list"
    np.testing.assert_allclose([d.embedding for d in r.data], want, rtol=1e-6)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, texts))
    # The client's default asks for base64 and decodes it; an explicit base64 is left as text.
    r = mock_client.embeddings.create(model="mock-model", input=texts)
    np.testing.assert_allclose([d.embedding for d in r.data], want, rtol=1e-6)
    r = mock_client.embeddings.create(model="mock-model", input="hello", encoding_format="base64")
    raw = np.frombuffer(base64.b64decode(r.data[0].embedding), "<f4")
    np.testing.assert_allclose(raw, want[0], rtol=1e-6)
    body = http("POST", mock_server.url + "/v1/embeddings",
                {"input": [[104, 105], [1, 2, 3]], "model": "mock-model",
                 "dimensions": EMBED_DIM, "user": "u1", "pooling_type": "mean"})
    assert body.status_code == 200, body.text
    validate(body.json(), "CreateEmbeddingResponse")
    np.testing.assert_allclose([d["embedding"] for d in body.json()["data"]],
                               [mock_embedding([104, 105], "mean"),
                                mock_embedding([1, 2, 3], "mean")], rtol=1e-6)
    assert mock.pages_used == 0


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["ok", "fine", "also", ""]}, "input[3]"),
    ({"input": ["ok", "fine", "also", "w " * 80]}, "input[3]"),
    ({"input": [[1, 2], [3, 4], [5], list(range(65))]}, "input[3]"),
    ({"input": [[1, 2], [3, 4], [5], [7, 100000]]}, "input[3]"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": [1, -5]}, "input"),
    ({"input": "hi", "dimensions": 4}, "dimensions"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "hi", "pooling_type": "max"}, "pooling_type"),
    ({"input": "hi", "model": "other-model"}, "model"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
])
def test_bad_input_is_a_400_naming_the_field(mock, mock_server, body, param):
    before = len(mock.requests)
    r = http("POST", mock_server.url + "/v1/embeddings", body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text
    assert len(mock.requests) == before, "a bad request must not reach the engine"


def test_client_gone_aborts_every_input(mock_server):
    slow = MockEngine(max_length=64, delay=0.05)
    s = ServerThread(slow)
    try:
        body = json.dumps({"input": ["a" * 40] * 8}).encode()
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        deadline = time.time() + 10
        while len(slow.running) < 8 and time.time() < deadline:
            time.sleep(0.01)
        assert slow.pages_used > 0
        sock.close()
        while slow.running and time.time() < deadline:
            time.sleep(0.01)
        assert slow.pages_used == 0 and len(slow.aborted) == 8 and not slow.finished
    finally:
        s.close()


# ---- SmolLM2 through the real engine and server ----------------------------------------------

@pytest.fixture(scope="module")
def engine():
    # test_engine_smollm2.py's engine (float32: the default int8 weights give cosine ~0.9993
    # against the float32 reference): the same graphs, from the compile cache
    core = build_core(None, EngineConfig(quantization_encoding="float32", max_length=512,
                                         max_batch_size=8, max_batch_input_tokens=32,
                                         kv_cache_page_size=16, num_kv_pages=48))
    eng = AsyncEngine(core, core.model.tokenizer, "smollm2", core.model.chat_template)
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    s = ServerThread(engine)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from maxjax.models.loader import embedded_model_path
    directory, name = os.path.split(embedded_model_path())
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                dtype=torch.float32).eval()


@pytest.fixture
def no_leak_no_compile(request):
    yield
    if "engine" in request.fixturenames:
        core = request.getfixturevalue("engine").core
        s = core.stats()
        assert s.kv.pages_used == 0 and s.scheduler.running == 0 and s.scheduler.waiting == 0, s
        assert s.xla_compiles_since_ready == 0, s
        # embeddings keep nothing in the prefix cache
        assert not any(r.is_embedding for r in core.scheduler.requests.values())


def embed(client, texts, pooling=None):
    extra = {"pooling_type": pooling} if pooling else None
    r = client.embeddings.create(model="smollm2", input=texts, encoding_format="float",
                                 extra_body=extra)
    return [d.embedding for d in sorted(r.data, key=lambda d: d.index)], r


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_smollm2_matches_transformers(engine, client, reference, pooling, no_leak_no_compile):
    cached = engine.core.block_manager.num_cached_pages
    got, r = embed(client, TEXTS, pooling)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    assert max(map(len, ids)) > 96, "the long input must prefill in several chunks"
    assert r.usage.prompt_tokens == sum(map(len, ids))
    for g, p in zip(got, ids):
        assert len(g) == engine.core.model.config.hidden_size
        assert abs(np.linalg.norm(g) - 1) < 1e-5
        assert cosine(g, hf_embedding(reference, p, pooling)) >= COS
    assert engine.core.block_manager.num_cached_pages == cached, "no prefix-cache entries"


def test_batch_of_64_beside_generation(engine, server, client, reference, no_leak_no_compile):
    texts = [f"Item {i}: the {c} {a} sits on the {t}." for i, (c, a, t) in enumerate(
        (c, a, t) for c in ("red", "green", "blue", "small") for a in ("cat", "dog", "bird", "fox")
        for t in ("mat", "roof", "table", "hill"))]
    assert len(texts) == 64
    prompts = ["The capital of France is", "Once upon a time there was a"]

    def complete(p):
        return client.completions.create(model="smollm2", prompt=p, max_tokens=24,
                                          temperature=0).choices[0].text
    alone = [complete(p) for p in prompts]

    plans = []
    scheduler = engine.core.scheduler
    schedule = scheduler.schedule

    def recording():
        plan = schedule()
        if plan is not None:
            plans.append((sum(r.request.is_embedding for r in plan.rows),
                          sum(not r.request.is_embedding for r in plan.rows)))
        return plan
    scheduler.schedule = recording
    try:
        beside = [None, None]
        threads = [threading.Thread(target=lambda i=i: beside.__setitem__(i, complete(prompts[i])))
                   for i in range(2)]
        for t in threads:
            t.start()
        while not any(g for _, g in plans):       # the streams are running
            time.sleep(0.01)
        got, r = embed(client, texts)
        for t in threads:
            t.join(120)
    finally:
        scheduler.schedule = schedule
    assert beside == alone, "generation beside embeddings must not change"
    assert any(e and g for e, g in plans), f"no step held both kinds: {plans}"
    assert len(got) == 64 and r.usage.prompt_tokens == sum(
        len(engine.tokenizer.encode(t)) for t in texts)
    for g, t in zip(got, texts):
        assert cosine(g, hf_embedding(reference, engine.tokenizer.encode(t), "last")) >= COS


def test_client_gone_frees_pages(engine, server, no_leak_no_compile):
    scheduler = engine.core.scheduler
    finish, reasons = scheduler._finish, []
    scheduler._finish = lambda req, reason: (reasons.append(reason), finish(req, reason))
    try:
        body = json.dumps({"input": [TEXTS[3]] * 12}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        deadline = time.time() + 60
        while engine.core.stats().kv.pages_used == 0 and time.time() < deadline:
            time.sleep(0.005)
        sock.close()
        while len(reasons) < 12 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        scheduler._finish = finish
    assert len(reasons) == 12 and "abort" in reasons, reasons
    time.sleep(0.1)       # the step that saw the last abort has returned


def test_generation_task_refused_under_embeddings_task(engine, server, client):
    # Not a separate server: the engine's task decides, so flip it for one request.
    engine.core.cfg = engine.core.cfg.replace(task="embeddings_generation")
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
        assert e.value.body["param"] == "model"
        assert len(embed(client, ["still served"])[0]) == 1
    finally:
        engine.core.cfg = engine.core.cfg.replace(task="text_generation")


# ---- a tiny random Qwen3 through the offline API ---------------------------------------------

@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from maxjax.llm import LLM
    from tiny_llama import write_tiny_llama
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("qwen3"))
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=32, num_hidden_layers=2,
                                         max_position_embeddings=512,
                                         tie_word_embeddings=False)).eval()
    with torch.no_grad():      # norms left at 1 would hide a misplaced final norm
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    tok_dir = write_tiny_llama(str(tmp_path_factory.mktemp("tok")))
    for f in os.listdir(tok_dir):
        if f.startswith(("tokenizer", "special_tokens")):
            os.replace(os.path.join(tok_dir, f), os.path.join(path, f))
    llm = LLM(path, max_batch_size=4, max_batch_input_tokens=16, max_length=64,
              num_kv_pages=24, kv_cache_page_size=8)
    return llm, model


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_tiny_qwen3_matches_transformers(qwen3, pooling):
    llm, hf = qwen3
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(3, 512, n))) for n in (1, 7, 16, 33, 64)]
    got = llm.embed(prompts, pooling)          # 5 rows over 4-row, 16-token steps: chunked
    for g, p in zip(got, prompts):
        assert cosine(g, hf_embedding(hf, p, pooling)) >= COS
    s = llm.stats()
    assert s.kv.pages_used == 0 and s.scheduler.running == 0 and s.xla_compiles_since_ready == 0
