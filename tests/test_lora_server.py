"""LoRA over HTTP on a real engine (tiny random Llama, PEFT adapters as the reference): the request's
`model` picks the adapter, /v1/models lists adapters with their `parent`, and vLLM's load/unload
routes (behind --api-key) change the served set without compiling; bad adapters are a 400 naming
the field, an unloaded name a 404. Unloading waits for the requests using the adapter (new ones
get a 404 at once), or answers a 400 after --lora-unload-timeout while they run on."""
from __future__ import annotations

import threading
import time

import openai
import pytest

from maxjax.engine.async_engine import AsyncEngine
from maxjax.server.config import ServeConfig
from lora_adapters import hf_model, write_peft_adapter
from reference import hf_greedy
from server_harness import ServerThread, http
from tiny_llama import tiny_core, write_tiny_llama

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 7, 9, 11, 3, 8, 20, 31, 4, 9]
NEW = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_server")
    model_dir = write_tiny_llama(d / "model")
    (a, peft_a), (b, peft_b) = (write_peft_adapter(model_dir, d / "a", seed=1),
                                write_peft_adapter(model_dir, d / "b", seed=2, r=8, alpha=16))
    big, _ = write_peft_adapter(model_dir, d / "big", seed=3, r=16)
    nan = nan_adapter(a, d / "nan")
    refs = {"tiny": hf_greedy(hf_model(model_dir), PROMPT, NEW)[1],
            "a": hf_greedy(peft_a, PROMPT, NEW)[1], "b": hf_greedy(peft_b, PROMPT, NEW)[1]}
    core = tiny_core(d / "model", enable_lora=True, max_num_loras=1, max_lora_rank=8,
                     lora_paths=[f"a={a}"])
    engine = AsyncEngine(core, core.model.tokenizer, "tiny", None)
    engine.start()
    end = time.monotonic() + 60
    while not core.primed:
        assert time.monotonic() < end, "priming"
        time.sleep(0.01)
    server = ServerThread(engine, ServeConfig(api_key=KEY))
    yield server, core, refs, {"a": a, "b": b, "big": big, "nan": nan}
    server.close()
    engine.shutdown()


def nan_adapter(src: str, out) -> str:
    """A copy of adapter `src` with one NaN in a lora_A."""
    import shutil

    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, out)
    f = out / "adapter_model.safetensors"
    tensors = load_file(f)
    name = next(k for k in tensors if "lora_A" in k)
    tensors[name] = tensors[name].copy()
    tensors[name].flat[0] = float("nan")
    save_file(tensors, f)
    return str(out)


def complete(server, model):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                     logprobs=0)


def tokens(core, out) -> list[int]:
    vocab = core.model.tokenizer.get_vocab()
    return [vocab[t] for t in out.choices[0].logprobs.tokens]


def test_model_names_the_adapter_and_models_lists_parents(served):
    server, core, refs, _ = served
    for model in ("tiny", "a"):
        out = complete(server, model)
        assert tokens(core, out) == refs[model] and out.model == model, model   # vLLM's `model`
    data = http("GET", server.url + "/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("tiny", None), ("a", "tiny")]
    card = http("GET", server.url + "/v1/models/a", headers=AUTH).json()
    assert card["parent"] == "tiny" and card["root"].endswith("/a")
    with pytest.raises(openai.NotFoundError):
        complete(server, "nope")
    assert core.step_compiles == 0


def test_load_use_unload_then_404(served):
    server, core, refs, paths = served
    url = server.url + "/v1/"
    body = {"lora_name": "b", "lora_path": paths["b"]}
    assert http("POST", url + "load_lora_adapter", body).status_code == 401      # --api-key
    r = http("POST", url + "load_lora_adapter", body, headers=AUTH)
    assert r.status_code == 200, r.text
    # One device slot (--max-num-loras 1): a and b swap in turn; each gets its own tokens.
    for model in ("b", "a", "b"):
        assert tokens(core, complete(server, model)) == refs[model], model
    assert "b" in [m["id"] for m in http("GET", url + "models", headers=AUTH).json()["data"]]
    r = http("POST", url + "unload_lora_adapter", {"lora_name": "b"}, headers=AUTH)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        complete(server, "b")
    r = http("POST", url + "unload_lora_adapter", {"lora_name": "b"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    assert core.step_compiles == 0


@pytest.mark.parametrize("body, param, message", [
    ({"lora_name": "x", "lora_path": "BIG"}, "lora_path", "above --max-lora-rank 8"),
    ({"lora_name": "x", "lora_path": "/nonexistent"}, "lora_path", "no adapter_config.json"),
    ({"lora_path": "/nonexistent"}, "lora_name", "required"),
    ({"lora_name": "a", "lora_path": "A"}, "lora_name", "already loaded"),
    ({"lora_name": "tiny", "lora_path": "A"}, "lora_name", "names the base model"),
    # a NaN in one slot's stacks would reach every request (graphs/lora.py sums over slots)
    ({"lora_name": "x", "lora_path": "NAN"}, "lora_path", "NaN or infinite"),
])
def test_bad_adapters_are_a_400_naming_the_field(served, body, param, message):
    server, core, refs, paths = served
    body = {k: {"BIG": paths["big"], "A": paths["a"], "NAN": paths["nan"]}.get(v, v)
            for k, v in body.items()}
    r = http("POST", server.url + "/v1/load_lora_adapter", body, headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"]
    assert tokens(core, complete(server, "tiny")) == refs["tiny"]


def _slow_steps(core, monkeypatch, seconds=0.05):
    """Each engine step takes `seconds` longer, so a request is still running while we look."""
    step = core.step
    monkeypatch.setattr(core, "step", lambda: time.sleep(seconds) or step())


def _long_request(server, model, result: dict):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
            "logprobs": 0, "ignore_eos": True}
    r = http("POST", server.url + "/v1/completions", body, headers=AUTH)
    result.update(status=r.status_code, json=r.json())


def _start_long_request(server, core, model) -> tuple[threading.Thread, dict]:
    result: dict = {}
    t = threading.Thread(target=_long_request, args=(server, model, result))
    t.start()
    end = time.monotonic() + 30
    while not core.scheduler.num_running:
        assert time.monotonic() < end and t.is_alive(), result
        time.sleep(0.005)
    return t, result


def test_unload_waits_for_the_requests_using_it(served, monkeypatch):
    server, core, refs, paths = served
    url = server.url + "/v1/"
    r = http("POST", url + "load_lora_adapter", {"lora_name": "c", "lora_path": paths["a"]},
             headers=AUTH)
    assert r.status_code == 200, r.text
    _slow_steps(core, monkeypatch)
    long, got = _start_long_request(server, core, "c")
    unloaded: dict = {}

    def unload():
        r = http("POST", url + "unload_lora_adapter", {"lora_name": "c"}, headers=AUTH)
        unloaded.update(status=r.status_code, text=r.text,
                        left=[e.name for e in list(core.lora.entries.values())])
    waiter = threading.Thread(target=unload)
    waiter.start()
    while "c" in [m["id"] for m in http("GET", url + "models", headers=AUTH).json()["data"]]:
        time.sleep(0.005)
    with pytest.raises(openai.NotFoundError):        # at once, while the long one still runs
        complete(server, "c")
    assert long.is_alive() and waiter.is_alive()
    long.join(60)
    waiter.join(60)
    assert got["status"] == 200 and unloaded["status"] == 200, (got, unloaded)
    assert got["json"]["usage"]["completion_tokens"] == 40
    toks = [int(t[1:]) for t in got["json"]["choices"][0]["logprobs"]["tokens"]]
    assert toks[:NEW] == refs["a"]                   # the adapter served it to the end
    assert "c" not in unloaded["left"]               # gone when the unload answered
    assert core.step_compiles == 0


def test_unload_that_outlasts_its_timeout_is_a_clear_error(served, monkeypatch):
    server, core, refs, paths = served
    url = server.url + "/v1/"
    r = http("POST", url + "load_lora_adapter", {"lora_name": "d", "lora_path": paths["a"]},
             headers=AUTH)
    assert r.status_code == 200, r.text
    _slow_steps(core, monkeypatch)
    monkeypatch.setattr(core, "cfg", core.cfg.replace(lora_unload_timeout=0.2))
    long, got = _start_long_request(server, core, "d")
    r = http("POST", url + "unload_lora_adapter", {"lora_name": "d"}, headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_name"
    assert "'d': 1 unfinished requests still use it after 0.2 s (--lora-unload-timeout); it is " \
           "no longer served and goes when they end" in err["message"]
    assert long.is_alive()
    long.join(60)
    assert got["status"] == 200 and got["json"]["usage"]["completion_tokens"] == 40
    assert all(e.name != "d" for e in core.lora.entries.values())
    assert "d" not in [m["id"] for m in http("GET", url + "models", headers=AUTH).json()["data"]]
