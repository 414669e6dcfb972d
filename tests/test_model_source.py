"""Where the model comes from and what it is called (maxjax/models/source.py, loader.py): the
served name is --model as given; a fake Hugging Face cache made here (HF_HUB_OFFLINE: nothing is
ever downloaded) serves repo ids, revisions, weight revisions, subfolders, GGUF repos; every
source flag (and its --draft-* twin) either does what it says or is a one-line refusal."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from maxjax.errors import UserError
from maxjax.models.loader import load_model, read_checkpoint
from maxjax.models.source import ModelSource
from tiny_llama import write_tiny_gguf, write_tiny_llama

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
ENGINE = dict(max_batch_size=4, max_batch_input_tokens=16, max_length=64, num_kv_pages=24,
              kv_cache_page_size=8)


def one_line(match, fn, *args, **kwargs) -> str:
    with pytest.raises(UserError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF hub cache, offline; returns its directory."""
    from huggingface_hub import constants
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def snapshot(cache, repo: str, commit: str, refs=("main",)):
    """The snapshot directory of `repo` at `commit` (refs pointing at it), to fill."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snap


def scale_weights(directory, factor: float) -> None:
    """The checkpoint's embedding times `factor`: other weights, same shapes."""
    from safetensors.numpy import load_file, save_file
    path = os.path.join(directory, "model.safetensors")
    t = load_file(path)
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"] * factor
    save_file(t, path)


def embedding(model) -> np.ndarray:
    import jax
    leaves = {jax.tree_util.keystr(p): a for p, a in
              jax.tree_util.tree_flatten_with_path(model.params)[0]}
    return np.asarray(next(a for k, a in leaves.items() if "embed" in k))


@pytest.fixture
def tiny_repo(hf_cache):
    """org/tiny: main -> COMMIT_A; tag v2 -> COMMIT_B, whose config has a longer context and
    whose embedding is doubled."""
    a = write_tiny_llama(snapshot(hf_cache, "org/tiny", COMMIT_A))
    b = write_tiny_llama(snapshot(hf_cache, "org/tiny", COMMIT_B, refs=("v2",)))
    cfg = json.load(open(os.path.join(b, "config.json")))
    json.dump(dict(cfg, max_position_embeddings=1024), open(os.path.join(b, "config.json"), "w"))
    scale_weights(b, 2.0)
    return a, b


# ---- the served name -------------------------------------------------------------------------

def _engine(model_opts, serve_cfg):
    from maxjax.cli.serve import build_engine
    from maxjax.engine.config import EngineConfig
    return build_engine(model_opts, EngineConfig(**ENGINE), serve_cfg, progress=False)


def test_serve_repo_id_answers_to_it(tiny_repo):
    from server_harness import ServerThread, http

    from maxjax.cli.args import ModelOptions
    from maxjax.server.config import ServeConfig
    cfg = ServeConfig()
    engine = _engine(ModelOptions(model_path="org/tiny"), cfg)
    server = ServerThread(engine, cfg)
    try:
        models = http("GET", server.url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["org/tiny"]
        body = {"prompt": "w3 w4", "max_tokens": 2}
        r = http("POST", server.url + "/v1/completions", {**body, "model": "org/tiny"})
        assert r.status_code == 200 and r.json()["model"] == "org/tiny"
        # the old name (the snapshot directory's) stays accepted; another is a 404
        assert http("POST", server.url + "/v1/completions",
                    {**body, "model": COMMIT_A}).status_code == 200
        assert http("POST", server.url + "/v1/completions",
                    {**body, "model": "org/other"}).status_code == 404
        assert http("GET", server.url + "/stats").json()["model"] == "org/tiny"   # the web UI's
        assert engine.info()["model"] == "org/tiny"
    finally:
        server.close()
        engine.shutdown()


def test_served_name_of_paths_and_override(tmp_path):
    from maxjax.cli.serve import served_names
    from maxjax.models.loader import EMBEDDED_NAME
    given = str(tmp_path / "my-model")
    model = load_model(write_tiny_llama(given), "float32", progress=False)
    assert served_names(model, None) == (given, ("my-model",))
    assert served_names(model, "alias") == ("alias", ())
    embedded = dataclasses.replace(model, name=EMBEDDED_NAME, served_name=EMBEDDED_NAME)
    assert served_names(embedded, None) == (EMBEDDED_NAME, ())


def test_override_drops_the_aliases():
    from mock_engine import MockEngine
    from server_harness import ServerThread, http

    from maxjax.server.config import ServeConfig
    engine = MockEngine(model_name="org/name")
    engine.model_aliases = ("name",)
    for cfg, ok, refused in ((ServeConfig(), ["org/name", "name"], ["x"]),
                             (ServeConfig(served_model_name="x"), ["x"], ["org/name", "name"])):
        server = ServerThread(engine, cfg)
        try:
            for model in ok + refused:
                r = http("POST", server.url + "/v1/completions",
                         {"model": model, "prompt": "hi", "max_tokens": 1})
                assert (r.status_code == 200) == (model in ok), (model, r.status_code)
        finally:
            server.close()


# ---- the Hugging Face cache ------------------------------------------------------------------

def test_repo_id_from_the_cache(tiny_repo):
    model = load_model("org/tiny", "float32", progress=False)
    assert model.source == tiny_repo[0] and model.served_name == "org/tiny"
    assert model.name == COMMIT_A
    assert model.config.max_position_embeddings == 512


def test_huggingface_model_revision(tiny_repo):
    model = load_model(ModelSource("org/tiny", huggingface_model_revision="v2"), "float32",
                       progress=False)
    assert model.source == tiny_repo[1] and model.config.max_position_embeddings == 1024
    base = load_model("org/tiny", "float32", progress=False)
    np.testing.assert_allclose(embedding(model), 2 * embedding(base), rtol=1e-6)
    one_line("'org/tiny' at revision 'v9' cannot be found in the local Hugging Face cache",
             load_model, ModelSource("org/tiny", huggingface_model_revision="v9"), "float32")


def test_huggingface_weight_revision(tiny_repo):
    model = load_model(ModelSource("org/tiny", huggingface_weight_revision=COMMIT_B), "float32",
                       progress=False)
    base = load_model("org/tiny", "float32", progress=False)
    assert model.config.max_position_embeddings == 512        # config from main
    np.testing.assert_allclose(embedding(model), 2 * embedding(base), rtol=1e-6)


def test_force_download_bypasses_the_cache(tiny_repo):
    msg = one_line("--force-download", load_model, ModelSource("org/tiny", force_download=True),
                   "float32")
    assert "cannot be downloaded again" in msg
    msg = one_line("--draft-force-download", load_model,
                   ModelSource("org/tiny", force_download=True, prefix="draft_"), "float32")


def test_missing_repo_and_hub_only_flags_on_a_path(hf_cache, tmp_path):
    one_line("model 'org/missing' cannot be found in the local Hugging Face cache", load_model,
             "org/missing", "float32")
    one_line("model path .* cannot be found", load_model, str(tmp_path / "nope"), "float32")
    one_line("--huggingface-model-revision: applies to a Hugging Face repo id", load_model,
             ModelSource(write_tiny_llama(tmp_path / "m"), huggingface_model_revision="v2"),
             "float32")


def test_an_unreachable_hub_fails_at_once_and_once(hf_cache, monkeypatch):
    """No retries with backoff (~25 s a call in huggingface_hub) for a hub that refuses the
    connection, and a start's later resolutions of the same repo do not ask again."""
    import time

    from huggingface_hub import HfApi, constants

    from maxjax.models import source
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")    # nothing listens
    monkeypatch.setattr(source, "_FAILED", {})
    asked = []
    monkeypatch.setattr(HfApi, "list_repo_files", lambda *a, **k: asked.append(a))
    t0 = time.monotonic()
    for _ in range(3):
        one_line(r"model 'org/away' cannot be found .* the hub cannot be reached "
                 r"\(ConnectionError: 127.0.0.1:9: Connection refused\)", load_model,
                 "org/away", "float32")
    assert time.monotonic() - t0 < 10 and asked == [] and len(source._FAILED) == 1


def test_unknown_architecture_is_not_found_in_registry(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    one_line("not found in registry", load_model, str(tmp_path), "float32")


def test_subfolder(hf_cache):
    snap = snapshot(hf_cache, "org/sub", COMMIT_A)
    write_tiny_llama(snap / "text")
    for f in os.listdir(snap / "text"):         # the tokenizer at the repo's root
        if f.startswith(("tokenizer", "special")):
            shutil.move(str(snap / "text" / f), str(snap / f))
    one_line("no config.json", load_model, "org/sub", "float32")
    model = load_model(ModelSource("org/sub", subfolder="text"), "float32", progress=False)
    assert model.source == str(snap / "text") and model.tokenizer.encode("w5") == [5]
    one_line("--subfolder 'vae': cannot be found", load_model,
             ModelSource("org/sub", subfolder="vae"), "float32")
    one_line("--subfolder '../x': must be a relative path", load_model,
             ModelSource("org/sub", subfolder="../x"), "float32")


def test_weight_path(tmp_path):
    base_dir = write_tiny_llama(tmp_path / "base")
    other = write_tiny_llama(tmp_path / "other")
    scale_weights(other, 3.0)
    base = load_model(base_dir, "float32", progress=False)
    for weights in (other, os.path.join(other, "model.safetensors")):
        model = load_model(ModelSource(base_dir, weight_path=weights), "float32", progress=False)
        np.testing.assert_allclose(embedding(model), 3 * embedding(base), rtol=1e-6)
    one_line("--weight-path https://x/y.safetensors: a URL is not fetched at run time",
             load_model, ModelSource(base_dir, weight_path="https://x/y.safetensors"), "float32")
    one_line("--weight-path 'nope' cannot be found", load_model,
             ModelSource(base_dir, weight_path="nope"), "float32")


def test_trust_remote_code(tmp_path, monkeypatch):
    path = write_tiny_llama(tmp_path / "custom")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    one_line("custom code .*pass --trust-remote-code", load_model, path, "float32")
    one_line("--draft-trust-remote-code", load_model, ModelSource(path, prefix="draft_"),
             "float32")
    import transformers
    seen = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return real(*args, **kwargs)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    load_model(ModelSource(path, trust_remote_code=True), "float32", progress=False)
    assert seen == [True]


def test_chat_template_jinja(hf_cache):
    snap = write_tiny_llama(snapshot(hf_cache, "org/jinja", COMMIT_A))
    tok_cfg = os.path.join(snap, "tokenizer_config.json")
    assert "chat_template" not in json.load(open(tok_cfg))
    (snapshot(hf_cache, "org/jinja", COMMIT_A) / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.content }}>{% endfor %}")
    model = load_model("org/jinja", "float32", progress=False)
    assert model.chat_template == "{% for m in messages %}<{{ m.content }}>{% endfor %}"


def test_chat_template_jinja_when_the_tokenizer_has_none(tmp_path, monkeypatch):
    """maxjax's own fallback, whatever the transformers version reads by itself."""
    path = write_tiny_llama(tmp_path / "m")
    (tmp_path / "m" / "chat_template.jinja").write_text("T")
    from maxjax.models import loader
    real = loader.load_hf_tokenizer

    def no_template(*args):
        tok = real(*args)
        tok.chat_template = None
        return tok
    monkeypatch.setattr(loader, "load_hf_tokenizer", no_template)
    assert load_model(path, "float32", progress=False).chat_template == "T"


def test_download_patterns_fetch_templates_and_tokenizer_model():
    from maxjax.models.source import HF_PATTERNS
    assert {"*.jinja", "*.model", "*.safetensors", "*.json"} <= set(HF_PATTERNS)


def test_gguf_repo(hf_cache):
    from gguf import GGMLQuantizationType as T
    snap = snapshot(hf_cache, "org/tiny-GGUF", COMMIT_A)
    write_tiny_gguf(snap / "tiny.Q8_0.gguf", T.Q8_0)
    assert read_checkpoint("org/tiny-GGUF").path == str(snap / "tiny.Q8_0.gguf")   # the only one
    model = load_model("org/tiny-GGUF", "int8", progress=False)
    assert model.source == str(snap / "tiny.Q8_0.gguf")
    write_tiny_gguf(snap / "tiny.Q4_0.gguf", T.Q4_0)
    msg = one_line("holds 2 GGUF files: choose one with --quantization-encoding", read_checkpoint,
                   "org/tiny-GGUF")
    assert "tiny.Q4_0.gguf" in msg and "tiny.Q8_0.gguf" in msg
    model = load_model("org/tiny-GGUF", "q4_0", progress=False)
    assert model.source == str(snap / "tiny.Q4_0.gguf") and model.dtype == "q4_0"


# ---- rope type and sliding window ------------------------------------------------------------

def test_rope_type(tmp_path):
    from gguf import GGMLQuantizationType as T
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", T.Q8_0)
    assert load_model(ModelSource(gguf, rope_type="normal"), "int8", progress=False).config
    one_line("--rope-type neox: this GGUF's rope layout is 'normal'", read_checkpoint,
             ModelSource(gguf, rope_type="neox"))
    one_line("--rope-type normal: only applies to GGUF", load_model,
             ModelSource(write_tiny_llama(tmp_path / "hf"), rope_type="normal"), "float32")
    one_line("--draft-rope-type", read_checkpoint,
             ModelSource(gguf, rope_type="yarn", prefix="draft_"))
    one_line("--rope-type 'linear': supported", read_checkpoint,
             ModelSource(gguf, rope_type="linear"))


def _tiny_mistral(path, window):
    import torch
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    write_tiny_llama(path)                      # the tokenizer; config and weights replaced
    model = MistralForCausalLM(MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512,
        sliding_window=window)).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def test_sliding_window_matches_transformers(tmp_path):
    import torch
    from paged_harness import paged_greedy
    from reference import assert_logits_close, hf_greedy
    from transformers import MistralForCausalLM
    path = str(tmp_path / "mistral")
    full = _tiny_mistral(path, None)
    windowed = MistralForCausalLM(type(full.config)(**{**full.config.to_dict(),
                                                       "sliding_window": 8})).eval()
    windowed.load_state_dict(full.state_dict())
    model = load_model(ModelSource(path, sliding_window=8), "float32", progress=False)
    assert set(model.config.layer_windows) == {8}
    plain = load_model(path, "float32", progress=False)
    assert set(plain.config.layer_windows) == {0}
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 512, 30)]
    ours, _ = paged_greedy(model.arch, model.config, model.params, [prompt], chunk=16,
                           new_tokens=3, page_size=8)
    theirs, _ = paged_greedy(plain.arch, plain.config, plain.params, [prompt], chunk=16,
                             new_tokens=3, page_size=8)
    with torch.no_grad():
        ref, _ = hf_greedy(windowed, prompt, 3)
    assert_logits_close(ours[0], ref)
    assert float(np.max(np.abs(np.asarray(ours[0]) - np.asarray(theirs[0])))) > 1e-3


def test_sliding_window_refusals(tmp_path):
    path = write_tiny_llama(tmp_path / "llama")
    one_line("--sliding-window 8: LlamaForCausalLM as configured has no sliding-window layers",
             load_model, ModelSource(path, sliding_window=8), "float32")
    one_line("--draft-sliding-window 0: must be >= 1", load_model,
             ModelSource(path, sliding_window=0, prefix="draft_"), "float32")


# ---- flags, and the draft's twins --------------------------------------------------------------

SOURCE_FLAGS = ["--huggingface-model-revision", "v2", "--huggingface-weight-revision", "w",
                "--force-download", "--subfolder", "sub", "--weight-path", "/w",
                "--trust-remote-code", "--rope-type", "neox", "--sliding-window", "7"]
EXPECTED = ModelSource("org/x", "v2", "w", True, "sub", "/w", True, "neox", 7)


def test_flags_build_the_model_source():
    import argparse

    from maxjax.cli.args import ModelOptions, add_dataclass_args, build
    from maxjax.engine.config import EngineConfig
    p = argparse.ArgumentParser()
    add_dataclass_args(p, ModelOptions)
    add_dataclass_args(p, EngineConfig)
    ns = p.parse_args(["--model", "org/x", *SOURCE_FLAGS,
                       *[a.replace("--", "--draft-", 1) if a.startswith("--") else a
                         for a in ["--model-path", "org/x", *SOURCE_FLAGS]],
                       "--draft-max-length", "99"])
    assert build(ModelOptions, ns).source() == EXPECTED
    cfg = build(EngineConfig, ns)
    assert cfg.draft_source() == EXPECTED.__class__(**{**EXPECTED.__dict__, "prefix": "draft_"})
    assert cfg.draft_max_length == 99


def _draft_cfg(path, **draft):
    from maxjax.engine.config import EngineConfig
    return EngineConfig(speculative_method="draft", draft_model_path=path, **draft)


def test_draft_loads_through_its_source(tmp_path):
    from maxjax.engine.draft import load_draft
    target_dir = write_tiny_llama(tmp_path / "target")
    target = load_model(target_dir, "float32", progress=False)
    other = write_tiny_llama(tmp_path / "other")
    scale_weights(other, 3.0)
    draft = load_draft(_draft_cfg(target_dir, draft_weight_path=other), target, 64)
    np.testing.assert_allclose(embedding(draft), 3 * embedding(target), rtol=1e-6)
    one_line("--draft-weight-path 'nope' cannot be found", load_draft,
             _draft_cfg(target_dir, draft_weight_path="nope"), target, 64)
    one_line("--draft-subfolder 'x'", load_draft, _draft_cfg(target_dir, draft_subfolder="x"),
             target, 64)
    one_line("--draft-rope-type normal: only applies to GGUF", load_draft,
             _draft_cfg(target_dir, draft_rope_type="normal"), target, 64)
    one_line("--draft-sliding-window 4: LlamaForCausalLM", load_draft,
             _draft_cfg(target_dir, draft_sliding_window=4), target, 64)
    one_line("--draft-huggingface-model-revision: applies to a Hugging Face repo id", load_draft,
             _draft_cfg(target_dir, draft_huggingface_model_revision="v2"), target, 64)


def test_draft_max_length(tmp_path):
    from maxjax.engine.draft import load_draft
    target_dir = write_tiny_llama(tmp_path / "target")
    target = load_model(target_dir, "float32", progress=False)
    one_line(r"--draft-max-length 32: must be >= the target's max length \(64\)", load_draft,
             _draft_cfg(target_dir, draft_max_length=32), target, 64)
    assert load_draft(_draft_cfg(target_dir, draft_max_length=64), target, 64).config


def test_draft_revisions_from_the_cache(tiny_repo, tmp_path):
    from maxjax.engine.draft import load_draft
    target = load_model("org/tiny", "float32", progress=False)
    draft = load_draft(_draft_cfg("org/tiny", draft_huggingface_model_revision="v2"), target, 64)
    assert draft.config.max_position_embeddings == 1024
    draft = load_draft(_draft_cfg("org/tiny", draft_huggingface_weight_revision="v2"), target, 64)
    np.testing.assert_allclose(embedding(draft), 2 * embedding(target), rtol=1e-6)
    one_line("--draft-force-download", load_draft,
             _draft_cfg("org/tiny", draft_force_download=True), target, 64)


@pytest.mark.parametrize("options, flag", [
    (dict(draft_subfolder="x"), "--draft-subfolder"),
    (dict(draft_trust_remote_code=True), "--draft-trust-remote-code"),
    (dict(draft_max_length=64), "--draft-max-length"),
    (dict(speculative_method="ngram", draft_sliding_window=4), "--draft-sliding-window")])
def test_draft_flags_need_a_draft_model(options, flag):
    from maxjax.engine.config import EngineConfig
    from maxjax.engine.spec_flags import draft_tokens
    one_line(f"{flag} goes with --draft-model-path", draft_tokens, EngineConfig(**options))
