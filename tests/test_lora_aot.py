"""LoRA graphs in artifacts and the compile cache (tiny random Llama, a PEFT adapter as the
reference): `warm-cache --enable-lora` stores the step graphs with the adapter slot stacks as
inputs; `serve --precompiled-artifacts DIR --enable-lora --lora-paths ...` and an engine built from
the compile cache then compile nothing and give peft's tokens; the slot count and max rank are in
the engine fingerprint, and a run whose LoRA flags differ from the artifacts is refused naming
the flag, before anything is deserialized."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

import maxjax
from maxjax.aot import cache
from maxjax.aot import load as aot_load
from maxjax.aot import manifest as mf
from maxjax.aot.manifest import MANIFEST
from maxjax.engine import compile_counter
from maxjax.engine.config import EngineConfig
from maxjax.engine.plan import plan_engine
from maxjax.errors import UserError
from maxjax.models.loader import load_model
from lora_adapters import hf_model, write_peft_adapter
from reference import hf_greedy
from server_harness import http
from test_aot import machine_env, maxjax as run_cli
from tiny_llama import write_tiny_llama

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

ENGINE = dict(max_batch_size=2, max_batch_input_tokens=4, max_length=64, num_kv_pages=16,
              kv_cache_page_size=16)
LORA = dict(enable_lora=True, max_num_loras=2, max_lora_rank=8)
FLAGS = ["--max-batch-size", "2", "--max-batch-input-tokens", "4", "--max-length", "64",
         "--num-kv-pages", "16", "--kv-cache-page-size", "16",
         "--enable-lora", "--max-num-loras", "2", "--max-lora-rank", "8"]
PROMPT = [5, 7, 9, 11, 3, 8, 20, 31, 4, 9]
NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_aot")
    model_dir = write_tiny_llama(root / "tiny-llama")
    adapter, peft_model = write_peft_adapter(model_dir, root / "a", seed=1, r=4)
    refs = {None: hf_greedy(hf_model(model_dir), PROMPT, NEW)[1],
            "a": hf_greedy(peft_model, PROMPT, NEW)[1]}
    env, cwd = machine_env(root, "machine-a", cache=False)
    env["MAXJAX_CACHE_DIR"] = str(root / "compile-cache")
    r = run_cli(["warm-cache", "--model-path", model_dir, *FLAGS], env, cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    entry = re.search(r"^artifacts: (.+)$", r.stdout, re.M).group(1)
    assert f"serve with: maxjax serve --precompiled-artifacts {entry}\n" in r.stdout
    model = load_model(model_dir, "float32", progress=False)
    return dict(root=root, model_dir=model_dir, adapter=adapter, refs=refs, entry=entry,
                cache=env["MAXJAX_CACHE_DIR"], model=model)


def test_manifest_holds_the_lora_stacks(setup):
    with open(os.path.join(setup["entry"], MANIFEST)) as f:
        data = json.load(f)
    assert (data["engine"]["lora_slots"], data["engine"]["max_lora_rank"]) == (3, 8)
    step = data["graphs"][0]["signature"]["in"]["params"]
    # per layer: wqkv a [64, 2, 3*8], b [2, 8, 64], [2, 8, 32] x 2 (slot 0 is not stored); the
    # slots are inputs, not constants
    assert [[64, 2, 24], "float32"] in step and [[2, 8, 64], "float32"] in step
    assert [[2, 8, 32], "float32"] in step


def test_serve_from_lora_artifacts_compiles_nothing(setup):
    from prometheus_client.parser import text_string_to_metric_families
    root = setup["root"]
    env, cwd = machine_env(root, "machine-b", cache=False)
    env["MAXJAX_NO_COMPILE_CACHE"] = "1"
    log = open(os.path.join(root, "machine-b", "serve.log"), "w+")
    proc = subprocess.Popen(
        # the model, --enable-lora and its slots come from the manifest
        [sys.executable, "-m", "maxjax.cli", "serve", "--precompiled-artifacts", setup["entry"],
         "--lora-paths", f"a={setup['adapter']}", "--host", "127.0.0.1", "--port", "0"],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("Server ready on http://127.0.0.1:"), open(log.name).read()[-3000:]
        url = line.split()[-1]
        for name in (None, "a"):
            body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "logprobs": 0,
                    "ignore_eos": True, **({"model": name} if name else {})}
            r = http("POST", url + "/v1/completions", body)
            assert r.status_code == 200, r.text
            got = [int(t[1:]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
            assert got == setup["refs"][name], name
        metrics = {s.name: s.value for fam in text_string_to_metric_families(
            http("GET", url + "/metrics").text) for s in fam.samples}
        assert metrics["maxjax_xla_compiles_total"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        log.close()
    assert "(6 executables, 6 deserialized while the weights loaded, 0 compiled from exports)" \
        in open(log.name).read()


def test_lora_engine_loads_from_the_compile_cache(setup, monkeypatch):
    monkeypatch.setenv("MAXJAX_CACHE_DIR", setup["cache"])
    before = compile_counter.count()
    llm = maxjax.LLM(setup["model"], **ENGINE, **LORA, lora_paths=[f"a={setup['adapter']}"])
    assert compile_counter.count() == before
    assert {e.source for e in llm.core.runner.executables.values()} == {"executable"}
    params = maxjax.SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT], params, lora=["a", None])
    assert [o.token_ids for o in outs] == [setup["refs"]["a"], setup["refs"][None]]
    assert llm.core.step_compiles == 0


def test_lora_shape_is_in_the_cache_key(setup):
    model = setup["model"]

    def key(**options):
        cfg = EngineConfig(**ENGINE, **options, quantization_encoding="float32")
        return cache.entry_path(model, plan_engine(cfg, model), setup["cache"])
    assert key(**LORA) == setup["entry"]
    others = {key(), key(**{**LORA, "max_num_loras": 3}), key(**{**LORA, "max_lora_rank": 4})}
    assert len(others) == 3 and setup["entry"] not in others
    # the adapters themselves are not: loading one changes nothing in a graph
    assert key(**LORA, lora_paths=[f"a={setup['adapter']}"]) == setup["entry"]


def _without_lora(d):
    p = os.path.join(d, MANIFEST)
    with open(p) as f:
        data = json.load(f)
    data["engine"].update(lora_slots=0, max_lora_rank=0)
    mf.write_manifest(d, data)      # sealed again: the edit is refused by the engine check


@pytest.mark.parametrize("options, edit, pattern", [
    ({**LORA, "max_num_loras": 3}, None,
     r"--max-num-loras 3 differs from the 2 the artifacts .*--max-num-loras 3 --max-lora-rank 8"),
    ({**LORA, "max_lora_rank": 4}, None, r"--max-lora-rank 4 differs from the 8"),
    ({}, None, r"--enable-lora is off but the artifacts .* were built with --enable-lora "
               r"--max-num-loras 2 --max-lora-rank 8: pass it"),
    (LORA, _without_lora, r"--enable-lora is on but the artifacts .* were built without "
                          r"--enable-lora: drop it"),
], ids=["max-num-loras", "max-lora-rank", "lora-off", "artifacts-without-lora"])
def test_lora_flags_that_differ_are_refused(setup, tmp_path, monkeypatch, options, edit, pattern):
    from maxjax.aot import graphs
    seen = []
    monkeypatch.setattr(graphs, "load_executable", lambda *a, **k: seen.append(a))
    d = str(tmp_path / "art")
    shutil.copytree(setup["entry"], d)
    if edit:
        edit(d)
    with pytest.raises(UserError, match=pattern) as e:
        aot_load.load_planned([d], setup["model"], EngineConfig(**options))
    assert "maxjax warm-cache" in str(e.value) and "\n" not in str(e.value)
    assert seen == []


def test_default_lora_flags_take_the_pinned_values(setup):
    flags = EngineConfig(enable_lora=True)          # --max-num-loras / --max-lora-rank unset
    plan, exes, _ = aot_load.load_planned([setup["entry"]], setup["model"], flags)
    cfg, layout = plan.config, plan.layout
    assert (cfg.max_num_loras, cfg.max_lora_rank) == (2, 8)
    assert (layout.lora_slots, layout.max_lora_rank) == (3, 8) and len(exes) == 3
