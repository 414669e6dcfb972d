"""AOT artifacts (maxjax/aot/): warm-cache in one "machine" (subprocess with its own HOME, cwd
and JAX cache), generate and serve from a copy in another with the persistent cache off, with
no compilation at all; CUDA exports from this CPU host; every mutation of the manifest, the files
or the run's config is refused before anything is deserialized. The model is a tiny random Llama
written without torch."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from maxjax.aot import cache
from maxjax.aot import export as aot_export
from maxjax.aot import graphs as aot_graphs
from maxjax.aot import load as aot_load
from maxjax.aot import manifest as mf
from maxjax.aot.manifest import MANIFEST
from maxjax.engine.config import EngineConfig
from maxjax.errors import UserError
from maxjax.graphs.pallas_attention import PAGED_KERNEL
from tiny_llama import write_tiny_llama

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

# Three step graphs: decode-only (T == R) and one with prefill chunks (T > R)
ENGINE = dict(max_batch_size=2, max_batch_input_tokens=4, max_length=64, num_kv_pages=16,
              kv_cache_page_size=16)
SIZES = ["--max-batch-size", "2", "--max-batch-input-tokens", "4", "--max-length", "64",
         "--kv-cache-page-size", "16"]
FLAGS = [*SIZES, "--num-kv-pages", "16"]
GEN = ["generate", "--prompt", "w5 w7 w9", "--prompt", "w11 w3 w8 w20 w31 w4 w9 w100 w7 w2 w12",
       "--max-new-tokens", "10", "--ignore-eos", "--json"]


def machine_env(root, name: str, cache: bool) -> tuple[dict, str]:
    """Environment and cwd of a simulated machine: own HOME, cwd and JAX cache."""
    home = os.path.join(root, name, "home")
    cwd = os.path.join(root, name, "cwd")
    jcache = os.path.join(root, name, "jax-cache")
    for d in (home, cwd, jcache):
        os.makedirs(d, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "MAXJAX_"))}
    env.update(HOME=home, HF_HOME=os.path.join(home, "hf"), HF_HUB_OFFLINE="1",
               JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=jcache,
               JAX_ENABLE_COMPILATION_CACHE="true" if cache else "false",
               TOKENIZERS_PARALLELISM="false")
    return env, cwd


def maxjax(args, env, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "maxjax.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=900)


def compiles(stderr: str) -> tuple[int, int]:
    m = re.search(r"xla compiles: (\d+) total, (\d+) since ready", stderr)
    assert m, stderr[-2000:]
    return int(m.group(1)), int(m.group(2))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("aot")


@pytest.fixture(scope="module")
def model_dir(root):
    return write_tiny_llama(root / "tiny-llama")


@pytest.fixture(scope="module")
def warmed(root, model_dir):
    """warm-cache on machine A (default directory: the compile cache under $MAXJAX_CACHE_DIR),
    cpu + cuda."""
    env, cwd = machine_env(root, "machine-a", cache=True)
    env["MAXJAX_CACHE_DIR"] = os.path.join(root, "machine-a", "compile-cache")
    r = maxjax(["warm-cache", "--model-path", model_dir, *FLAGS, "--target", "cpu", "cuda"], env, cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    directory = re.search(r"^artifacts: (.+)$", r.stdout, re.M).group(1)
    assert os.path.dirname(directory) == env["MAXJAX_CACHE_DIR"]
    assert f"serve with: maxjax serve --precompiled-artifacts {directory}\n" in r.stdout
    return directory


@pytest.fixture(scope="module")
def cold(root, model_dir):
    """generate with FLAGS on machine C: no artifacts, an empty compile cache."""
    r = maxjax([*GEN, "--model-path", model_dir, *FLAGS], *machine_env(root, "machine-c", cache=False))
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def model(model_dir):
    from maxjax.models.loader import load_model
    return load_model(model_dir, "float32", progress=False)


def test_cross_machine_generate_is_identical_and_compiles_no_graph(root, model_dir, warmed, cold):
    copy = os.path.join(root, "machine-b", "copied-artifacts")
    shutil.copytree(warmed, copy)
    env_b, cwd_b = machine_env(root, "machine-b", cache=False)
    loaded = maxjax([*GEN, "--model-path", model_dir, "--precompiled-artifacts", copy], env_b, cwd_b)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout == cold.stdout and len(loaded.stdout.splitlines()) == 2
    # the executables deserialized while the weights loaded (the artifacts' prefetch)
    assert "(6 executables, 6 deserialized while the weights loaded, 0 compiled from exports)" \
        in loaded.stderr
    total, since_ready = compiles(loaded.stderr)
    cold_total, cold_since = compiles(cold.stderr)
    # cold: the 3 step graphs, their 2 samplers and the KV initializer; from artifacts: nothing,
    # from process start
    assert (cold_total, cold_since) == (6, 0)
    assert (total, since_ready) == (0, 0)
    assert os.listdir(os.path.join(root, "machine-b", "jax-cache")) == []


def test_warm_cache_fills_the_compile_cache(root, model_dir, warmed):
    """`generate` with the same flags on machine A loads warm-cache's entry: nothing compiles.
    Graphs planned for cpu + cuda run XLA's path (the CPU kernels are for the CPU alone), so
    generate says so; by default it would run the kernels, another cache entry."""
    env, cwd = machine_env(root, "machine-a", cache=False)
    env["MAXJAX_CACHE_DIR"] = os.path.dirname(warmed)
    r = maxjax([*GEN, "--model-path", model_dir, *FLAGS, "--no-use-experimental-kernels"], env,
               cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Loaded 6 graphs from {warmed} " in r.stderr
    assert compiles(r.stderr) == (0, 0)
    assert [e.path for e in cache.entries(os.path.dirname(warmed), "graphs")] == [warmed]


def test_serve_from_artifacts_compiles_nothing(root, model_dir, warmed):
    from prometheus_client.parser import text_string_to_metric_families
    from server_harness import http
    env, cwd = machine_env(root, "machine-d", cache=False)
    log = open(os.path.join(root, "machine-d", "serve.log"), "w+")
    # no other flag: the model, its encoding and the engine's sizes come from the manifest
    proc = subprocess.Popen([sys.executable, "-m", "maxjax.cli", "serve",
                             "--precompiled-artifacts", warmed, "--host", "127.0.0.1", "--port", "0"],
                            env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("Server ready on http://127.0.0.1:"), open(log.name).read()[-3000:]
        url = line.split()[-1]
        r = http("POST", url + "/v1/completions", {"prompt": "w5 w7 w9", "max_tokens": 4,
                                                   "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        metrics = {s.name: s.value for fam in text_string_to_metric_families(
            http("GET", url + "/metrics").text) for s in fam.samples}
        assert metrics["maxjax_xla_compiles_total"] == 0
        assert metrics["maxjax_engine_steps_total"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        log.close()


def test_manifest_and_cuda_exports(warmed):
    with open(os.path.join(warmed, MANIFEST)) as f:
        data = json.load(f)
    assert data["targets"] == ["cpu", "cuda"] and data["compiled_for"]["platform"] == "cpu"
    *steps, s1, s2, kv_init = data["graphs"]
    assert [g["bucket"] for g in steps] == data["engine"]["buckets"] == \
        [[1, 1, 1], [2, 2, 2], [4, 2, 2]]
    assert [s1["name"], s2["name"]] == ["sample_s1", "sample_s2"]
    assert data["engine"]["num_kv_pages"] == 16 and data["engine"]["max_pages_per_row"] == 4
    for g in data["graphs"]:
        with open(os.path.join(warmed, g["files"]["export"]["path"]), "rb") as f:
            exp = jax.export.deserialize(bytearray(f.read()))
        assert exp.platforms == ("cpu", "cuda")
        sig = g["signature"]
        assert mf.avals(exp.in_avals) == mf.flat_in(sig, tuple(g["args"]))
        assert mf.avals(exp.out_avals) == sig["out"]["sample"] + sig["out"]["kv"]
        assert aot_graphs.spec_leaves(g["output_structure"]) == g["sample_outputs"] == \
            len(sig["out"]["sample"])
        assert sig["out"]["kv"] == (steps[0]["signature"]["in"]["kv"]
                                    if g not in (s1, s2) else [])
    for g in steps:
        T, R, S = g["bucket"]
        sig = g["signature"]
        assert g["args"] == ["params", "kv", "step"]
        assert sig["in"]["step"][0] == [[T], "int32"]
        assert sig["out"]["sample"][0] == [[S, 512], "float32"]  # the sample slots' logits
        assert g["donate_argnums"] == [1]                           # the pool comes back donated
    for g, S in ((s1, 1), (s2, 2)):
        sig = g["signature"]
        assert g["args"] == ["logits", "sampling"] and g["donate_argnums"] == []
        assert sig["in"]["logits"] == [[[S, 512], "float32"]]
        assert sig["out"]["sample"][0] == [[S], "int32"]          # sampled token ids
        assert g["output_structure"]["namedtuple"] == "maxjax.graphs.sampling:SampleOutput"
    assert kv_init["name"] == "kv_init" and kv_init["bucket"] is None
    assert kv_init["signature"]["in"] == {} and kv_init["sample_outputs"] == 0
    assert kv_init["signature"]["out"]["kv"] == [[[2, 16, 2, 16, 16], "float32"]] * 2


def test_cuda_only_target_writes_exports_and_is_refused_here(tmp_path, model):
    cfg = EngineConfig(**ENGINE, quantization_encoding="float32")
    from maxjax.engine.plan import EnginePlan, plan_layout
    layout = plan_layout(cfg, model)
    layout = dataclasses.replace(layout, buckets=layout.buckets[:1])    # one graph: fast
    d = str(tmp_path / "cuda")
    data = aot_export.write_artifacts(d, model, EnginePlan(cfg, layout), ["cuda"],
                                      progress=False)
    assert data["compiled_for"] is None and data["targets"] == ["cuda"]
    assert [g["name"] for g in data["graphs"]] == ["step_t1_r1", "sample_s1", "kv_init"]
    for g in data["graphs"]:
        assert set(g["files"]) == {"export"}
        with open(os.path.join(d, g["files"]["export"]["path"]), "rb") as f:
            exp = jax.export.deserialize(bytearray(f.read()))
        assert exp.platforms == ("cuda",)
        assert mf.avals(exp.in_avals) == mf.flat_in(g["signature"], tuple(g["args"]))
    with pytest.raises(UserError, match=r"built for cuda, this machine is cpu.*--target cpu"):
        aot_load.load_planned([d], model, EngineConfig(**ENGINE))


# FLAGS but --num-kv-pages: `cold` is the CPU run to compare with
GPU_FLAGS = [*SIZES, "--quantization-encoding", "float32"]


def test_warm_cache_for_cuda_on_this_cpu_loads_for_the_cpu(root, model_dir, cold):
    """`warm-cache --target cuda:sm_90 cpu` here: graphs planned for CUDA (the Pallas kernel, its
    blocks) exported for both platforms; the CUDA half holds the Triton call. Loaded on this CPU
    (through the query-block algorithm on the kernel's blocks), generate equals a cold CPU run."""
    env, cwd = machine_env(root, "machine-g", cache=False)
    d = os.path.join(root, "machine-g", "cuda-artifacts")
    r = maxjax(["warm-cache", "--model-path", model_dir, *GPU_FLAGS, "--target", "cuda", "cpu",
                "--artifacts-dir", d], env, cwd)
    assert r.returncode == 2 and "--num-kv-pages is needed for graphs that run on cuda" in r.stderr
    r = maxjax(["warm-cache", "--model-path", model_dir, *GPU_FLAGS, "--num-kv-pages", "16",
                "--target", "cuda:sm_9x", "cpu", "--artifacts-dir", d], env, cwd)
    assert r.returncode == 2 and "an architecture is cuda:sm_NN" in r.stderr
    r = maxjax(["warm-cache", "--model-path", model_dir, *GPU_FLAGS, "--num-kv-pages", "16",
                "--target", "cuda:sm_90", "cpu", "--artifacts-dir", d], env, cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(d, MANIFEST)) as f:
        data = json.load(f)
    assert data["targets"] == ["cuda", "cpu"] and data["compiled_for"]["platform"] == "cpu"
    assert data["target_archs"] == {"cuda": "sm_90"}     # refused on another GPU (load.py)
    assert (data["engine"]["platform"], data["engine"]["attention"]) == ("cuda", "pallas_paged")
    steps = [g for g in data["graphs"] if g["bucket"]]
    for g in steps:
        with open(os.path.join(d, g["files"]["export"]["path"]), "rb") as f:
            exp = jax.export.deserialize(bytearray(f.read()))
        assert exp.platforms == ("cuda", "cpu")
        assert PAGED_KERNEL.custom_calls[0] in exp.mlir_module()   # the Triton call
    loaded = maxjax([*GEN, "--model-path", model_dir, "--quantization-encoding", "float32",
                     "--precompiled-artifacts", d], env, cwd)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    n = len(data['graphs'])
    assert f"({n} executables, {n} deserialized while the weights loaded, 0 compiled from " \
        "exports)" in loaded.stderr
    assert compiles(loaded.stderr) == (0, 0)
    assert [json.loads(x)["token_ids"] for x in loaded.stdout.splitlines()] == \
        [json.loads(x)["token_ids"] for x in cold.stdout.splitlines()]


# ---- mutations: each refused, naming what differs, before any deserialization -------------------
@pytest.fixture
def calls(monkeypatch):
    """Records every deserialization."""
    from maxjax.aot import graphs
    seen = []
    real_exe, real_exp = graphs.load_executable, jax.export.deserialize
    monkeypatch.setattr(graphs, "load_executable",
                        lambda *a, **k: seen.append("executable") or real_exe(*a, **k))
    monkeypatch.setattr(jax.export, "deserialize", lambda *a, **k: seen.append("export") or real_exp(*a, **k))
    return seen


def _copy(warmed, tmp_path) -> str:
    d = str(tmp_path / "art")
    shutil.copytree(warmed, d)
    return d


def _edit_manifest(d, edit):
    """An edit made with intent: the manifest is sealed again, so the field's own check refuses."""
    p = os.path.join(d, MANIFEST)
    with open(p) as f:
        data = json.load(f)
    edit(data)
    mf.write_manifest(d, data)


def _flip_manifest_byte(d):
    """Damage that keeps the JSON valid: one digit of the creation time."""
    p = os.path.join(d, MANIFEST)
    text = open(p).read()
    i = text.index('"created": "') + len('"created": "') + 3
    open(p, "w").write(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:])


def _flip_byte(d, kind):
    with open(os.path.join(d, MANIFEST)) as f:
        path = os.path.join(d, json.load(f)["graphs"][2]["files"][kind]["path"])
    blob = bytearray(open(path, "rb").read())
    blob[len(blob) // 2] ^= 0x01
    open(path, "wb").write(bytes(blob))


@pytest.mark.parametrize("override,pattern", [
    ({"max_batch_size": 4}, r"--max-batch-size 4 differs from the 2 .*--max-batch-size 4"),
    ({"kv_cache_page_size": 64}, r"--kv-cache-page-size 64 differs from the 16"),
    ({"num_kv_pages": 100}, r"--num-kv-pages 100 differs from the 16 .*--num-kv-pages 100"),
    ({"max_length": 128}, r"--max-length 128 differs from the 64"),
    ({"max_batch_input_tokens": 16}, r"--max-batch-input-tokens 16 differs from the 4"),
])
def test_explicit_engine_value_that_differs_is_refused(warmed, model, calls, override, pattern):
    with pytest.raises(UserError, match=pattern) as e:
        aot_load.load_planned([warmed], model, EngineConfig(**{**ENGINE, **override}))
    assert "maxjax warm-cache --model-path" in str(e.value) and "\n" not in str(e.value)
    assert calls == []


def test_dtype_differs(warmed, model_dir, calls):
    from maxjax.models.loader import load_model
    bf16 = load_model(model_dir, "bfloat16", progress=False)
    with pytest.raises(UserError, match=r"model dtype: artifacts float32, this run bfloat16"):
        aot_load.load_planned([warmed], bf16, EngineConfig())
    assert calls == []


def test_quantization_encoding_differs(warmed, model_dir, calls):
    from maxjax.models.loader import load_model
    int8 = load_model(model_dir, "int8", progress=False)
    with pytest.raises(UserError, match=r"model dtype: artifacts float32, this run int8 \(pass "
                                        r"--quantization-encoding float32"):
        aot_load.load_planned([warmed], int8, EngineConfig())
    assert calls == []


def test_kv_cache_format_differs(warmed, model, calls):
    with pytest.raises(UserError, match=r"--kv-cache-format bfloat16 differs from the float32 "):
        aot_load.load_planned([warmed], model, EngineConfig(kv_cache_format="bfloat16"))
    assert calls == []


def test_model_config_field_differs(warmed, tmp_path, calls):
    from maxjax.models.loader import load_model
    other = load_model(write_tiny_llama(tmp_path / "other", rms_norm_eps=1e-6), "float32",
                       progress=False)
    with pytest.raises(UserError, match=r"model config field rms_norm_eps: artifacts 1e-05, this model 1e-06"):
        aot_load.load_planned([warmed], other, EngineConfig())
    assert calls == []


@pytest.mark.parametrize("mutation,pattern", [
    (lambda d: _edit_manifest(d, lambda m: m["versions"].update(jax="0.0.1")),
     r"built with jax 0\.0\.1, this is jax " + re.escape(jax.__version__)),
    (lambda d: _edit_manifest(d, lambda m: m.update(format_version=99)), r"format_version 99"),
    (lambda d: _edit_manifest(d, lambda m: m["model"]["config"].update(num_layers=3)),
     r"model config field num_layers: artifacts 3, this model 2"),
    (lambda d: _flip_byte(d, "executable"), r"step_t4_r2: executable file .* fails its sha256"),
    (lambda d: _flip_byte(d, "export"), r"step_t4_r2: export file .* fails its sha256"),
    (lambda d: os.remove(os.path.join(d, "step_t2_r2.cpu-cuda.jaxexport")),
     r"step_t2_r2: export file step_t2_r2.cpu-cuda.jaxexport is missing"),
    (lambda d: _edit_manifest(d, lambda m: m.update(graphs=m["graphs"][:2])),
     r"graph step_t4_r2 is missing"),
    (lambda d: _edit_manifest(d, lambda m: m.update(graphs=m["graphs"][:5])),
     r"graph kv_init is missing"),
    (lambda d: _edit_manifest(d, lambda m: m["graphs"][5]["signature"]["out"]["kv"][0][0].__setitem__(1, 8)),
     r"graph kv_init: signature differs"),
    (lambda d: open(os.path.join(d, MANIFEST), "w").write("{not json"), r"manifest is not valid JSON"),
    (lambda d: os.remove(os.path.join(d, MANIFEST)), r"manifest.json: missing"),
    (_flip_manifest_byte, r"manifest fails its manifest_sha256 check"),
], ids=["jax-version", "format-version", "config-in-manifest", "exe-byte", "export-byte",
        "deleted-file", "missing-graph", "missing-kv-init", "kv-init-shape", "not-json",
        "no-manifest", "manifest-byte"])
def test_mutated_artifacts_are_refused_before_deserializing(warmed, tmp_path, model, calls,
                                                            mutation, pattern):
    d = _copy(warmed, tmp_path)
    mutation(d)
    with pytest.raises(UserError, match=pattern) as e:
        aot_load.load_planned([d], model, EngineConfig())
    assert "maxjax warm-cache" in str(e.value)
    assert calls == []


def test_serving_flags_come_from_the_manifest(warmed, model_dir):
    path, cfg = aot_load.adopt_flags([warmed], None, EngineConfig())
    assert path == os.path.abspath(model_dir)
    assert cfg.quantization_encoding == "float32" and cfg.devices is None
    with pytest.raises(UserError, match=r"^--quantization-encoding int8 differs from the float32 "
                                        r"the artifacts in .* were built with: drop the flag"):
        aot_load.adopt_flags([warmed], None, EngineConfig(quantization_encoding="int8"))
    # built on one device: --devices is checked against the manifest's mesh (engine mesh: ...)
    assert aot_load.adopt_flags([warmed], str(model_dir), EngineConfig(devices="cpu:2"))[0] == \
        str(model_dir)


def test_the_chat_template_file_comes_from_the_manifest(warmed, model, tmp_path):
    """Artifacts built with --chat-template serve with the command warm-cache prints (their
    tokenizer digest holds the template, so without it they were refused)."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert aot_export.serve_flags(model, EngineConfig(), str(template))["chat_template"] == \
        str(template)
    assert aot_load.adopt_chat_template([warmed], None) is None
    d = _copy(warmed, tmp_path)
    _edit_manifest(d, lambda m: m["serve"].update(chat_template=str(template)))
    assert aot_load.adopt_chat_template([d], None) == str(template)
    assert aot_load.adopt_chat_template([d], "other.jinja") == "other.jinja"
    template.unlink()
    with pytest.raises(UserError, match="built with --chat-template .* cannot be found"):
        aot_load.adopt_chat_template([d], None)


def test_replicas_and_platform_defaults_come_from_the_manifest(warmed, model, tmp_path):
    """Artifacts warm-cache built for replicas serve as replicas; the engine sizes pinned
    replace the platform's defaults a start fills in (build_core's for_platform), not a value
    the user chose, even one equal to that default."""
    d = _copy(warmed, tmp_path)
    _edit_manifest(d, lambda m: m["serve"].update(devices="cpu:2", data_parallel_degree=2))
    _, cfg = aot_load.adopt_flags([d], None, EngineConfig())
    assert (cfg.devices, cfg.data_parallel_degree) == ("cpu:2", 2)
    with pytest.raises(UserError, match="^--data-parallel-degree 3 differs from the 2"):
        aot_load.adopt_flags([d], None, EngineConfig(data_parallel_degree=3))
    from maxjax.engine.pins import adopt_pins
    filled = EngineConfig().for_platform("cpu")
    assert filled.max_batch_size == 32
    pins = aot_load.open_artifacts([warmed], model, filled).pins
    assert pins.values["max_batch_size"] == 2 and adopt_pins(filled, pins).max_batch_size == 2
    with pytest.raises(UserError, match="^--max-batch-size 32 differs from the 2 the artifacts"):
        adopt_pins(EngineConfig(max_batch_size=32).for_platform("cpu"), pins)   # chosen: kept


def test_cli_exits_2_with_one_line(warmed, model_dir, capsys):
    from maxjax import cli
    code = cli.main(["generate", "--model-path", model_dir, "--precompiled-artifacts", warmed,
                     "--num-kv-pages", "100", "--prompt", "w5", "--log-level", "ERROR", "--json"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("maxjax: error: --num-kv-pages 100 differs from the 16") and "\n" not in err
    assert "Traceback" not in err
    code = cli.main(["generate", "--model-path", model_dir, "--precompiled-artifacts", warmed,
                     "--chat", "--prompt", "w5", "--log-level", "ERROR", "--json"])
    err = capsys.readouterr().err.strip()     # the tiny model has no chat template: the flag
    assert code == 2 and err == "maxjax: error: --chat: this model has no chat template; pass " \
                                "--chat-template FILE", err


# ---- loading: pinned values, donation, export fallback -------------------------------------------
def _one_step_updates_the_pool_in_place(core) -> bool:
    """One step; True when the donated pool's buffers were updated in place, not copied."""
    from maxjax.engine.types import SamplingParams
    core.add_request("r", [5, 7, 9], SamplingParams(max_new_tokens=2))
    old = jax.tree.leaves(core.runner.kv)
    pointers = [a.unsafe_buffer_pointer() for a in old]
    core.step()
    new = jax.tree.leaves(core.runner.kv)
    return all(a.is_deleted() for a in old) and \
        [a.unsafe_buffer_pointer() for a in new] == pointers


def test_loaded_executables_adopt_pinned_values_and_donate_the_pool(warmed, model, calls):
    from maxjax.engine import compile_counter
    from maxjax.engine.core import EngineCore
    flags = EngineConfig()                                # nothing set: everything pinned
    plan, exes, kv_init = aot_load.load_planned([warmed], model, flags)
    cfg = plan.config
    assert (cfg.max_batch_size, cfg.num_kv_pages, cfg.max_length, cfg.kv_cache_page_size) == \
        (2, 16, 64, 16)
    assert flags.num_kv_pages is None                     # the user's flags stay as given
    assert {e.source for e in exes.values()} == {"executable"} and len(exes) == 3
    assert calls == ["executable"] * 6      # the step graphs, their samplers, the KV initializer
    by_slots = {}
    for b, exe in exes.items():       # the buckets with 2 sample slots run one sampler
        assert by_slots.setdefault(b.num_samples, exe.sample) is exe.sample
    assert len(by_slots) == 2
    before = compile_counter.count()
    core = EngineCore(model, plan, exes, kv_init)
    core.warmup()
    assert _one_step_updates_the_pool_in_place(core)
    assert compile_counter.count() == before


def test_other_device_compiles_the_export_or_refuses(warmed, tmp_path, model, calls):
    from maxjax.engine.core import EngineCore
    d = _copy(warmed, tmp_path)
    _edit_manifest(d, lambda m: m["compiled_for"].update(device_kind="some other cpu"))
    with pytest.raises(UserError, match="no executable compiled for this device"):
        aot_load.load_planned([d], model, EngineConfig(), require_compiled=True)
    plan, exes, kv_init = aot_load.load_planned([d], model, EngineConfig())
    assert {e.source for e in exes.values()} == {"export"} and "executable" not in calls
    core = EngineCore(model, plan, exes, kv_init)
    core.warmup()
    assert _one_step_updates_the_pool_in_place(core)      # jit(exp.call, donate_argnums) donates
    assert core.stats().xla_compiles_since_ready == 0


def test_executables_from_a_cpu_with_more_extensions_are_not_loaded(warmed, tmp_path, model):
    """XLA:CPU compiles for the host's vector extensions: an artifact from a CPU with one this
    CPU lacks gives its exports, not its executables (here refused, naming the extension)."""
    local = mf.local_device()
    assert local["platform"] != "cpu" or "avx2" in local["cpu_isa"]      # this machine's
    d = _copy(warmed, tmp_path)
    _edit_manifest(d, lambda m: m["compiled_for"].update(
        cpu_isa=sorted(m["compiled_for"]["cpu_isa"] + ["avx10_9"])))
    with pytest.raises(UserError, match=r"executables are for cpu cpu \(.*\), a CPU with "
                                        r"avx10_9, which this one lacks, and --require-compiled"):
        aot_load.load_planned([d], model, EngineConfig(), require_compiled=True)


def test_export_engine_round_trips(tmp_path, model):
    from maxjax.engine.core import EngineCore
    from maxjax.engine.plan import EnginePlan, plan_layout
    cfg = EngineConfig(**ENGINE, quantization_encoding="float32")
    layout = plan_layout(cfg, model)
    layout = dataclasses.replace(layout, buckets=layout.buckets[:2])
    core = EngineCore(model, EnginePlan(cfg, layout))
    d = str(tmp_path / "exported")
    aot_export.export_engine(d, core)
    with open(os.path.join(d, MANIFEST)) as f:
        data = json.load(f)
    assert [g["name"] for g in data["graphs"]] == ["step_t1_r1", "step_t2_r2", "sample_s1",
                                                   "sample_s2", "kv_init"]
    assert all(set(g["files"]) == {"export", "executable"} for g in data["graphs"])
    assert data["engine"]["buckets"] == [[1, 1, 1], [2, 2, 2]]


def test_target_arch_is_refused_on_another_gpu(monkeypatch):
    """Artifacts pinned to `--target cuda:sm_90` on a GPU of another architecture (or on none)."""
    from maxjax.aot import load as aot_load
    monkeypatch.setattr(jax.export, "default_export_platform", lambda: "cuda")
    monkeypatch.setattr(aot_load, "device_arch", lambda: "sm_80")
    with pytest.raises(UserError, match=r"^DIR: built for --target cuda:sm_90, this GPU is "
                                        r"sm_80; warm the cache again with --target cuda:sm_80"):
        aot_load.check_target_arch({"cuda": "sm_90"}, "DIR")
    aot_load.check_target_arch({"cuda": "sm_80"}, "DIR")
    aot_load.check_target_arch({}, "DIR")
    assert aot_export.normalize_targets(["cpu,cuda:sm_90a"]) == (["cpu", "cuda"],
                                                                  {"cuda": "sm_90a"})
