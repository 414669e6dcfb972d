"""The sampling defaults a request that leaves sampling fields out gets
(maxjax/models/sampling_defaults.py, --generation-config): read from an HF checkpoint's
generation_config.json, a GGUF's general.sampling.* over llama.cpp's server defaults, the
embedded SmolLM2's card; applied where a request becomes SamplingParams (the server's routes,
with --temperature / --top-k over them), shown by /v1/models and `maxjax suggest`; a request's
own values always win. tests/test_sampling_defaults_served.py runs them on real engines."""
from __future__ import annotations

import json
import os

import pytest
from mock_engine import MockEngine
from server_harness import ServerThread, http
from tiny_llama import write_tiny_gguf, write_tiny_llama

from maxjax import cli
from maxjax.engine.types import SamplingParams
from maxjax.errors import UserError
from maxjax.models import sampling_defaults as sd
from maxjax.models.loader import embedded_model_path
from maxjax.server.config import ServeConfig

GENERATION = {"temperature": 0.6, "top_p": 0.8, "top_k": 20, "min_p": 0.1,
              "repetition_penalty": 1.1, "do_sample": True, "max_new_tokens": 7,
              "bos_token_id": 1, "eos_token_id": 2}
RAW = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def hf_dir(path, generation: dict | None = GENERATION) -> str:
    """A tiny random HF checkpoint, with `generation` as its generation_config.json."""
    path = write_tiny_llama(path)
    if generation is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation, f)
    return path


def gguf_header(path, **keys) -> str:
    """A GGUF of metadata alone (no tensor): what the defaults read."""
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), "llama")
    for name, v in keys.items():
        getattr(w, f"add_sampling_{name}")(v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_hf_generation_config_fields_it_sets(tmp_path):
    path = hf_dir(tmp_path / "m")
    got = sd.read(path)
    assert got.values == {k: GENERATION[k] for k in sd.FIELDS}     # do_sample, max_new_tokens: not
    assert got.source == os.path.join(path, "generation_config.json")
    some = sd.read(hf_dir(tmp_path / "some", {"temperature": 0.7, "top_k": None}))
    assert some.in_force() == {**RAW, "temperature": 0.7, "source": some.source}
    assert sd.read(hf_dir(tmp_path / "none", {"eos_token_id": 2})).values == {}
    assert sd.read(hf_dir(tmp_path / "absent", None)).values == {}


def test_gguf_metadata_over_llama_cpp_defaults(tmp_path):
    assert sd.read(gguf_header(tmp_path / "plain.gguf")).values == sd.LLAMA_CPP
    got = sd.read(gguf_header(tmp_path / "keys.gguf", temp=0.6, top_k=20, penalty_repeat=1.05))
    # float32 metadata reads back at 7 digits, not 0.6000000238418579
    assert got.values == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
                          "repetition_penalty": 1.05}
    assert got.source.startswith("the GGUF's general.sampling.* over llama.cpp's")


def test_the_embedded_model_takes_its_card_over_llama_cpp():
    got = sd.read(embedded_model_path())
    assert got.values == {"temperature": 0.2, "top_p": 0.9, "min_p": 0.05}
    assert "SmolLM2-135M-Instruct's model card" in got.source
    # a request's own temperature 1, top_p 1 and min_p 0 leave nothing of them: the raw
    # distribution (no top_k default is left over)
    assert got.params(temperature=1.0, top_p=1.0, min_p=0.0) == SamplingParams(
        temperature=1.0, top_p=1.0, min_p=0.0)


def test_the_flag_picks_the_source(tmp_path):
    path = hf_dir(tmp_path / "m")
    assert sd.read(path, "vllm").values == {}
    assert sd.read(embedded_model_path(), "vllm").in_force()["temperature"] == 1.0
    other = hf_dir(tmp_path / "other", {"temperature": 0.3})
    assert sd.read(embedded_model_path(), other).values == {"temperature": 0.3}
    with pytest.raises(UserError, match="--generation-config nowhere: give auto, vllm or a "
                                        "directory"):
        sd.read(path, "nowhere")
    # --no-enable-penalties: a default repetition_penalty would refuse every request
    assert "repetition_penalty" not in sd.read(path, penalties=False).values


@pytest.mark.parametrize("key,value", [("temperature", "hot"), ("temperature", -1),
                                       ("top_p", 0), ("top_p", 1.5), ("top_k", 2.5),
                                       ("min_p", 2), ("repetition_penalty", 0),
                                       ("temperature", True)])
def test_a_value_it_cannot_sample_with_names_the_file_and_key(tmp_path, key, value):
    path = hf_dir(tmp_path / "m", {key: value})
    with pytest.raises(UserError, match=f"generation_config.json: {key} "):
        sd.read(path)


def test_a_top_k_of_minus_one_is_off(tmp_path):
    assert sd.read(hf_dir(tmp_path / "m", {"top_k": -1})).values == {"top_k": 0}


MODEL = sd.SamplingDefaults({"temperature": 0.6, "top_p": 0.8, "top_k": 20, "min_p": 0.1,
                             "repetition_penalty": 1.1}, "a generation_config.json")
MSGS = [{"role": "user", "content": "Hi!"}]


@pytest.fixture()
def served():
    engine = MockEngine()
    engine.sampling_defaults = MODEL
    s = ServerThread(engine)
    yield s
    s.close()


def sent(s: ServerThread, path: str, body: dict):
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    r = http("POST", s.url + path, {"model": "mock-model", limit: 2, **body})
    assert r.status_code == 200, r.text
    p = s.engine.requests[-1][2]
    return {f: getattr(p, f) for f in sd.FIELDS}


def test_a_request_without_sampling_fields_gets_the_model_defaults(served):
    want = {f: MODEL.values[f] for f in sd.FIELDS}
    assert sent(served, "/v1/chat/completions", {"messages": MSGS}) == want
    assert sent(served, "/v1/completions", {"prompt": "Hi"}) == want
    assert sent(served, "/v1/responses", {"input": "Hi"}) == want
    assert sent(served, "/v1/messages", {"messages": MSGS}) == want


def test_a_request_s_own_values_win(served):
    raw = {"temperature": 1, "top_p": 1, "min_p": 0, "top_k": -1, "repetition_penalty": 1}
    assert sent(served, "/v1/chat/completions", {"messages": MSGS, **raw}) == RAW
    assert sent(served, "/v1/completions", {"prompt": "Hi", **raw}) == RAW
    got = sent(served, "/v1/chat/completions", {"messages": MSGS, "temperature": 0})
    assert got == {**MODEL.values, "temperature": 0.0}
    got = sent(served, "/v1/messages", {"messages": MSGS, "temperature": 1, "top_p": 1})
    assert got == {**MODEL.values, "temperature": 1.0, "top_p": 1.0}


def test_v1_models_shows_the_defaults_in_force(served):
    card = http("GET", served.url + "/v1/models").json()["data"][0]
    assert card["sampling_defaults"] == {**{f: MODEL.values[f] for f in sd.FIELDS},
                                         "source": "a generation_config.json"}
    assert http("GET", served.url + "/v1/models/mock-model").json()["sampling_defaults"] == \
        card["sampling_defaults"]


def test_server_flags_go_over_the_model_defaults():
    engine = MockEngine()
    engine.sampling_defaults = MODEL
    s = ServerThread(engine, ServeConfig(temperature=0.25, top_k=-1))
    try:
        assert sent(s, "/v1/completions", {"prompt": "x"}) == \
            {**MODEL.values, "temperature": 0.25, "top_k": 0}
        card = http("GET", s.url + "/v1/models").json()["data"][0]["sampling_defaults"]
        assert card["source"] == "--temperature, --top-k over a generation_config.json"
        assert (card["temperature"], card["top_k"], card["top_p"]) == (0.25, 0, 0.8)
    finally:
        s.close()


def test_an_engine_without_defaults_serves_openai_s(tmp_path):
    s = ServerThread(MockEngine())
    try:
        assert sent(s, "/v1/completions", {"prompt": "x"}) == RAW
        card = http("GET", s.url + "/v1/models").json()["data"][0]["sampling_defaults"]
        assert card == {**RAW, "source": "OpenAI's defaults"}
    finally:
        s.close()


def suggest_json(capsys, *argv) -> dict:
    assert cli.main(["suggest", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)["sampling_defaults"]


def test_suggest_shows_them(capsys, tmp_path):
    path = hf_dir(tmp_path / "m")
    got = suggest_json(capsys, "--model", path, "--max-batch-size", "4",
                       "--max-batch-input-tokens", "16")
    assert got == {**{f: GENERATION[f] for f in sd.FIELDS},
                   "source": os.path.join(path, "generation_config.json")}
    got = suggest_json(capsys, "--model", path, "--max-batch-size", "4",
                       "--max-batch-input-tokens", "16", "--generation-config", "vllm",
                       "--temperature", "0.5")
    assert got == {**RAW, "temperature": 0.5,
                   "source": "--temperature over OpenAI's defaults (--generation-config vllm)"}
    from gguf import GGMLQuantizationType as T
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", T.Q8_0)
    got = suggest_json(capsys, "--model", gguf, "--max-batch-size", "4",
                       "--max-batch-input-tokens", "16")
    assert got == {**RAW, **sd.LLAMA_CPP, "source": "llama.cpp's server defaults"}
    assert cli.main(["suggest"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sampling ")]
    assert line == ["sampling       temperature 0.2 top_p 0.9 top_k 0 min_p 0.05 "
                    "repetition_penalty 1 (SmolLM2-135M-Instruct's model card, llama.cpp's "
                    "min_p)"]
