"""`maxjax suggest` (maxjax/cli/suggest.py): the model inspected from its config alone, planned by
the engine's own functions; its plan is what the engine then allocates for the same flags."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from maxjax import cli
from maxjax.engine import memory
from tiny_llama import write_tiny_gguf, write_tiny_llama

TINY_FLAGS = ["--max-batch-size", "4", "--max-batch-input-tokens", "16",
              "--kv-cache-page-size", "8"]


def suggest(capsys, *argv) -> tuple[int, dict]:
    code = cli.main(["suggest", "--json", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, json.loads(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def test_smollm2_gguf_text_and_json(capsys):
    code = cli.main(["suggest"])
    text, _ = capsys.readouterr()
    assert code == 0
    lines = text.splitlines()
    assert lines[1] == "architecture   LlamaForCausalLM (built-in)"
    assert "parameters     134.5 M" in lines
    assert lines[-1] == "maxjax serve"        # the embedded default needs no flag
    code, r = suggest(capsys)
    assert code == 0 and r["format"] == "gguf" and r["model"] is None
    assert r["parameters"] == 134_515_008         # SmolLM2-135M, tied embeddings counted once
    enc = r["encodings"]
    assert enc["supported"] == ["float32", "bfloat16", "float16", "int8", "q4_1"]
    assert enc["serving"] == enc["default"] == ("q4_1" if r["plan"]["cpu_kernels"] else "int8")
    assert enc["checkpoint"] == "Q4_1 x 210, Q8_0 x 1"
    plan = r["plan"]
    assert plan["max_length"] <= 8192 and plan["buckets"][0] == "step_t1_r1"
    assert plan["num_kv_pages"] >= 2 and plan["kv_pool_bytes"] > 0
    assert not any("chat template" in n for n in r["notes"])     # its GGUF holds one


def test_a_gguf_without_a_chat_template_is_a_note(capsys, tmp_path):
    from gguf import GGMLQuantizationType as T
    _, r = suggest(capsys, "--model", write_tiny_gguf(tmp_path / "t.gguf", T.Q4_0))
    assert "no chat template: /v1/chat/completions is refused unless --chat-template" in \
        r["notes"], r["notes"]


def test_hf_dir_json_fields(capsys, tiny):
    code, r = suggest(capsys, "--model", tiny, *TINY_FLAGS)
    assert code == 0
    assert set(r) == {"model", "path", "format", "architecture", "parameters", "encodings",
                      "weights", "plan", "compile_cache", "precompiled_artifacts",
                      "sampling_defaults", "notes", "command", "seconds"}
    assert r["architecture"] == {"name": "LlamaForCausalLM", "registered": True,
                                 "source": "built-in"}
    # 2 layers of hidden 64, MLP 128, 4 heads / 2 kv heads of 16, vocabulary 512, tied
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert r["parameters"] == 512 * 64 + 64 + 2 * layer
    assert r["encodings"]["supported"] == ["float32", "bfloat16", "float16", "int8"]
    assert r["weights"] == {"bytes": 4 * r["parameters"], "encoding": "float32",
                            "per_device_bytes": 4 * r["parameters"]}
    plan = r["plan"]
    assert (plan["max_batch_size"], plan["max_batch_input_tokens"], plan["kv_cache_page_size"]) \
        == (4, 16, 8)
    assert plan["buckets"] == ["step_t1_r1", "step_t2_r2", "step_t4_r4", "step_t8_r4",
                               "step_t16_r4"]
    assert plan["max_length"] == 512 and plan["max_pages_per_row"] == 64
    assert r["command"] == f"maxjax serve --model-path {tiny} --max-batch-size 4 " \
        "--max-batch-input-tokens 16 --kv-cache-page-size 8"
    code, r = suggest(capsys, "--model", tiny, "--quantization-encoding", "bfloat16")
    assert r["weights"]["bytes"] == 2 * r["parameters"]
    assert r["command"].endswith("--quantization-encoding bfloat16")


def test_weights_as_shapes_match_the_loaded_ones(tmp_path, tiny):
    """abstract_model's ShapeDtypeStructs are the loaded params' shapes and dtypes, leaf by
    leaf: float, int8, a GGUF's 4-bit blocks (with and without offsets), packed for the CPU
    kernels."""
    from gguf import GGMLQuantizationType as T

    from maxjax.aot.manifest import weight_signature
    from maxjax.engine.build import experimental_kernels
    from maxjax.graphs import cpu_kernels
    from maxjax.models import source
    from maxjax.models.loader import abstract_model, load_model, open_checkpoint
    cases = [(tiny, "float32"), (tiny, "bfloat16"), (tiny, "int8")]
    for qt, enc in ((T.Q4_0, "q4_0"), (T.Q4_K, "q4_k")):
        gguf = write_tiny_gguf(tmp_path / f"{enc}.gguf", qt)
        cases += [(gguf, enc), (gguf, "int8")]
    for path, enc in cases:
        loaded = load_model(path, enc, progress=False)
        src = source.as_source(path)
        shapes = abstract_model(open_checkpoint(source.resolve(src), src), enc, loaded.name)
        assert weight_signature(shapes.params) == weight_signature(loaded.params), (path, enc)
        if cpu_kernels.unavailable() is None and enc != "float32":
            assert weight_signature(experimental_kernels(shapes).params) == \
                weight_signature(experimental_kernels(loaded).params), (path, enc)


def test_repo_id_in_the_hf_cache(tmp_path):
    """A repo id found in the local Hugging Face cache (offline), in a fresh process."""
    hub = tmp_path / "hub"
    snap = hub / "models--org--tiny" / "snapshots" / "0123abcd"
    write_tiny_llama(snap)
    (hub / "models--org--tiny" / "refs").mkdir()
    (hub / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1",
               MAXJAX_CACHE_DIR=str(tmp_path / "cache"))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "maxjax.cli", "suggest", "--model", "org/tiny",
                          "--json"], env=env, capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["path"] == str(snap) and r["model"] == "org/tiny"
    assert r["architecture"]["name"] == "LlamaForCausalLM"
    assert r["command"] == "maxjax serve --model-path org/tiny"
    assert r["compile_cache"] == {"enabled": True, "directory": str(tmp_path / "cache"),
                                  "entry": None, "found_by": None}
    assert any("not in the compile cache" in n for n in r["notes"])
    print(f"suggest on org/tiny: {wall:.1f} s wall, {r['seconds']:.2f} s inspecting")


def test_plan_is_what_the_engine_allocates(capsys, monkeypatch, tiny):
    """Same flags, same host memory (faked: the engine's MemAvailable is smaller by its
    weights, which are resident then): suggest's KV pages, max length and buckets are the
    engine's; the pool is sized by memory, not capped. Then the entry the engine stored in the
    compile cache is found, by this start's request and by its manifest."""
    from maxjax.engine.build import build_core
    from maxjax.engine.config import EngineConfig
    flags = ["--max-batch-size", "2", "--max-batch-input-tokens", "4", "--kv-cache-page-size", "8"]
    free = 1 << 20        # 1 MiB: 80 of the 129 pages the cap allows
    monkeypatch.setattr(memory, "device_free_bytes", lambda device=None: free)
    code, r = suggest(capsys, "--model", tiny, *flags)
    plan = r["plan"]
    assert code == 0 and "capped" not in plan["memory"]
    assert 2 < plan["num_kv_pages"] < 2 * plan["max_pages_per_row"] + 1
    monkeypatch.setattr(memory, "device_free_bytes",
                        lambda device=None: free - r["weights"]["bytes"])
    core = build_core(tiny, EngineConfig(max_batch_size=2, max_batch_input_tokens=4,
                                         kv_cache_page_size=8))
    lay = core.layout
    assert (lay.num_pages, lay.max_length, lay.page_size, lay.max_pages_per_row) == \
        (plan["num_kv_pages"], plan["max_length"], plan["kv_cache_page_size"],
         plan["max_pages_per_row"])
    assert [b.name for b in lay.buckets] == plan["buckets"]
    assert (lay.attention, lay.kv_dtype) == (plan["attention"], plan["kv_cache_format"])
    assert core.cfg.quantization_encoding == r["encodings"]["serving"]
    assert lay.memory_report == plan["memory"]
    monkeypatch.setattr(memory, "device_free_bytes", lambda device=None: free)
    _, again = suggest(capsys, "--model", tiny, *flags)
    cache = again["compile_cache"]
    assert cache["entry"] and cache["found_by"] == "this request's last start"
    assert not any("compile cache" in n for n in again["notes"])
    # another request (a LoRA flag without --enable-lora), the same graphs: by the manifest
    _, other = suggest(capsys, "--model", tiny, *flags, "--max-num-loras", "3")
    assert other["compile_cache"]["entry"] == cache["entry"]
    assert other["compile_cache"]["found_by"] == "model config, weights and engine layout"
    _, bigger = suggest(capsys, "--model", tiny, *flags[2:], "--max-batch-size", "4")
    assert bigger["compile_cache"]["entry"] is None


def test_precompiled_artifacts_checked_against_the_plan(capsys, tmp_path, tiny):
    code, r = suggest(capsys, "--model", tiny, "--precompiled-artifacts", str(tmp_path / "none"))
    assert code == 1 and r["command"] is None      # serve would refuse them
    art = r["precompiled_artifacts"]
    assert art[0]["exists"] is False and art[0]["matches"] is False
    assert "no such directory" in art[0]["why"]
    assert any("--precompiled-artifacts" in n for n in r["notes"])
    # no manifest pins no kernels: the warm-cache command offered builds what a default start
    # would run (the CPU kernels where they run), not XLA's int8 path
    from maxjax.aot import load as aot_load
    assert aot_load.pinned_kernels(str(tmp_path / "none")) is None
    assert r["compile_cache"]["enabled"] is False


@pytest.mark.parametrize("argv, words", [
    (["--structured-output-backend", "xgrammar"], "--structured-output-backend xgrammar"),
    (["--chat-template", "/nonexistent.jinja"], "/nonexistent.jinja"),
    (["--compile-cache-max-size", "10Q"], "--compile-cache-max-size '10Q'")])
def test_what_serve_refuses_gets_no_command(capsys, tiny, argv, words):
    code, r = suggest(capsys, "--model", tiny, *argv)
    assert code == 1 and r["command"] is None
    assert any(n.startswith("serve refuses this") and words in n for n in r["notes"]), r["notes"]


def test_server_flags_are_carried_into_the_command(capsys, tiny):
    """A `maxjax serve` command line works as it is: its server flags are checked as serve
    checks them and kept in the command."""
    code, r = suggest(capsys, "--model", tiny, "--port", "8100", "--host", "0.0.0.0")
    assert code == 0 and "--port 8100 --host 0.0.0.0" in r["command"]
    assert cli.main(["suggest", "--model", tiny, "--port", "70000"]) == 2
    assert "--port 70000: a port is 0-65535" in capsys.readouterr().err


def test_encoding_the_checkpoint_lacks_is_a_note(capsys, tiny):
    code, r = suggest(capsys, "--model", tiny, "--quantization-encoding", "q4_k")
    assert code == 0 and r["encodings"]["serving"] == r["encodings"]["default"]
    assert any(n.startswith("--quantization-encoding q4_k: this checkpoint does not serve as")
               for n in r["notes"])
    assert "--quantization-encoding" not in r["command"]


def test_default_encoding_differs_from_the_checkpoint_is_a_note(capsys, tmp_path):
    path = write_tiny_llama(tmp_path / "bf16")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "torch_dtype": "bfloat16"}, f)
    _, r = suggest(capsys, "--model", path)
    assert r["encodings"]["checkpoint"] == "bfloat16"
    assert any("the checkpoint's dtype is bfloat16, served as float32" in n for n in r["notes"])


def custom_package(root, name: str) -> str:
    pkg = root / f"pkg_{name.lower()}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from maxjax.graphs.arch import Architecture\n"
        "from maxjax.graphs.llama import config_from_hf\n"
        f"ARCHITECTURES = [Architecture({name!r}, config_from_hf)]\n")
    return str(pkg)


def test_custom_architecture_registered_and_colliding(capsys, tmp_path, tiny):
    path = write_tiny_llama(tmp_path / "custom")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "architectures": ["SuggestTinyForCausalLM"]}, f)
    pkg = custom_package(tmp_path, "SuggestTinyForCausalLM")
    code, r = suggest(capsys, "--model", path, "--custom-architectures", pkg)
    assert code == 0 and r["architecture"]["source"] == f"custom ({pkg})"
    assert f"--custom-architectures {pkg}" in r["command"]
    clash = custom_package(tmp_path, "LlamaForCausalLM")
    code, r = suggest(capsys, "--model", tiny, "--custom-architectures", clash)
    assert code == 0 and r["architecture"]["source"] == "built-in"
    assert any("clashes with a registered architecture" in n for n in r["notes"])
    assert "--custom-architectures" not in r["command"]


def test_unregistered_architecture_exits_1_with_a_note(capsys, tmp_path):
    path = write_tiny_llama(tmp_path / "foo")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "architectures": ["FooForCausalLM"]}, f)
    code, r = suggest(capsys, "--model", path)
    assert code == 1 and r["command"] is None
    assert r["architecture"] == {"name": "FooForCausalLM", "registered": False, "source": None}
    assert any("unsupported architecture 'FooForCausalLM'" in n for n in r["notes"])


def test_a_refused_flag_is_a_note_before_the_checkpoint_is_read(capsys, tiny):
    code = cli.main(["suggest", "--model", tiny, "--max-batch-size", "0"])
    out = capsys.readouterr().out
    assert code == 1 and "--max-batch-size" in out and "serve would refuse" in out, out
    assert "architecture" not in out, out       # not read, so not called unregistered
