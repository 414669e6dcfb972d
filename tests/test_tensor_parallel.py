"""Tensor parallelism (`--devices cpu:N`) on the 4 host devices tests/conftest.py forces: greedy
tokens equal the single-device run's and logprobs agree within 1e-4 (tiny model) / 2e-3
(SmolLM2: a sharded matmul sums in another order); the parameters and the KV pool carry the
shardings their logical axes declare (kv heads that do not divide are replicated). Quantized
weights (int8 on the tiny model and SmolLM2, Q4_1 blocks) too, each against the single-device
run of its own encoding, logprobs within 1e-3 / 5e-3 (QUANT_ATOL below); a
4-bit split off block boundaries is refused; sharded artifacts serve without compiling and are
refused on another mesh; bad --devices values are one-line errors."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGML
from jax.sharding import PartitionSpec as P

from maxjax.engine import compile_counter, devices
from maxjax.engine.types import SamplingParams
from maxjax.errors import UserError
from maxjax.graphs import quant, sharding
from maxjax.llm import LLM
from maxjax.models.loader import load_model
from tiny_llama import write_tiny_gguf, write_tiny_llama

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

# XLA's path on one device too: the CPU kernels run on one device only, so by default the
# single-device reference would take them and another arithmetic
ENGINE = dict(max_batch_size=2, max_batch_input_tokens=4, max_length=64, num_kv_pages=24,
              kv_cache_page_size=8, use_experimental_kernels=False)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True,
                        top_logprobs=3)
# Quantized engines take one step graph (one token a step: prompts prefill token by token),
# which keeps their compiles cheap. Logprobs within 1e-3 on the tiny models (measured <= 2.3e-4),
# 5e-3 on SmolLM2 (measured 2.2e-3): a sharded sum that differs in its last bit can move an
# activation's int8 rounding by one step.
QUANT_ENGINE = dict(ENGINE, max_batch_size=1, max_batch_input_tokens=1)
QUANT_ATOL = 1e-3
PROMPTS = [[5, 9, 33, 7, 100, 3, 17, 250, 8, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69], [40, 41, 42]]


@pytest.fixture(scope="module")
def tiny4_dir(tmp_path_factory):
    """A tiny random Llama with 4 kv heads."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny4"), num_kv_heads=4)


@pytest.fixture(scope="module")
def tiny4(tiny4_dir):
    return load_model(tiny4_dir, "float32", progress=False)


@pytest.fixture(scope="module")
def reference(tiny4):
    return LLM(tiny4, **ENGINE).generate(PROMPTS, GREEDY)


def assert_same_outputs(got, ref, atol):
    for g, r in zip(got, ref):
        assert g.token_ids == r.token_ids
        np.testing.assert_allclose([t.logprob for t in g.logprobs],
                                   [t.logprob for t in r.logprobs], atol=atol)
        for gt, rt in zip(g.logprobs, r.logprobs):
            np.testing.assert_allclose([v for _, v in gt.top],
                                       [v for _, v in rt.top], atol=atol)


def assert_declared_shardings(core, n: int):
    model, mesh = core.model, core.layout.mesh
    assert mesh.size == n and dict(mesh.shape) == {"model": n}
    rules = sharding.tensor_parallel_rules(model.config, n)
    specs = quant.param_specs(model.arch.param_specs(model.config), model.params)
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, sharding.ArraySpec))
    for spec, arr in zip(leaves, jax.tree.leaves(model.params), strict=True):
        assert arr.sharding.spec == sharding.partition_spec(spec, rules), spec
        assert len(arr.sharding.device_set) == n
    assert any(arr.sharding.spec != P(*[None] * arr.ndim) for arr in jax.tree.leaves(model.params))
    for pool in core.runner.kv:
        assert pool.sharding.spec == P(None, None, "model", None, None)
        assert {s.data.shape[2] for s in pool.addressable_shards} == {pool.shape[2] // n}
        assert len(pool.sharding.device_set) == n


@pytest.mark.parametrize("n", [2, 4])
def test_tensor_parallel_equals_one_device(tiny4, reference, n):
    llm = LLM(tiny4, devices=f"cpu:{n}", **ENGINE)
    assert_same_outputs(llm.generate(PROMPTS, GREEDY), reference, atol=1e-4)
    assert_declared_shardings(llm.core, n)
    assert llm.core.step_compiles == 0
    assert llm.stats().kv.pages_used == 0


@pytest.fixture(scope="module")
def quantized(tiny4_dir, tmp_path_factory):
    """encoding -> (model, its single-device outputs): the tiny model with 4 kv heads as int8,
    and a tiny GGUF with 4 kv heads as q4_1 (its own Q4_1 blocks)."""
    gguf = write_tiny_gguf(tmp_path_factory.mktemp("q4") / "tiny4.gguf", GGML.Q4_1,
                           num_kv_heads=4)
    models = {"int8": load_model(tiny4_dir, "int8", progress=False),
              "q4_1": load_model(gguf, "q4_1", progress=False)}
    return {e: (m, LLM(m, **QUANT_ENGINE).generate(PROMPTS, GREEDY)) for e, m in models.items()}


def assert_quantized_splits(core, n: int):
    """q and its scales split with the output axis (column-parallel q|k|v) or the input axis
    (row-parallel down: 4-bit in whole 32-input blocks), the int8 embedding table by vocabulary."""
    params = core.model.params
    layer, embed = params["layers"][0], params["embed"]
    wqkv, w_down = layer["wqkv"], layer["w_down"]
    assert wqkv.q.sharding.spec == P(None, "model")
    assert w_down.q.sharding.spec == P("model", None)
    assert (embed.q.sharding.spec, embed.scale.sharding.spec) == (P("model", None), P("model"))
    if wqkv.bits == 8:
        assert wqkv.scale.sharding.spec == P("model")
        assert w_down.scale.sharding.spec == P(None)
    else:
        assert wqkv.scale.sharding.spec == wqkv.offset.sharding.spec == P(None, "model")
        assert wqkv.requant.sharding.spec == P("model")
        assert w_down.scale.sharding.spec == P("model", None)
        rows = [a.addressable_shards[0].data.shape[0] for a in (w_down.q, w_down.scale)]
        assert rows == [w_down.q.shape[0] // n, w_down.q.shape[0] // n // 16]   # whole blocks


@pytest.mark.parametrize("n", [2, 4])
def test_q4_1_tensor_parallel_equals_one_device(quantized, n):
    """(int8 at TP=2: test_sharded_artifacts_serve_without_compiling_and_name_the_mesh.)"""
    model, ref = quantized["q4_1"]
    llm = LLM(model, devices=f"cpu:{n}", **QUANT_ENGINE)
    assert_same_outputs(llm.generate(PROMPTS, GREEDY), ref, atol=QUANT_ATOL)
    assert_declared_shardings(llm.core, n)
    assert_quantized_splits(llm.core, n)
    assert llm.core.step_compiles == 0
    assert llm.stats().kv.pages_used == 0


def test_4bit_split_off_block_boundaries_is_refused(tmp_path):
    """4 heads of 16: wo's 64 inputs are 2 blocks of 32, which 4 devices cannot split."""
    model = load_model(write_tiny_gguf(tmp_path / "hd16.gguf", GGML.Q4_1, num_kv_heads=4,
                                       head_dim=16), "q4_1", progress=False)
    assert devices.place_model(model, sharding.tensor_parallel_mesh(2)).config.qkv_shards == 2
    with pytest.raises(UserError, match=r"over 4 devices: \['layers'\]\[0\]\['wo'\]\.scale of "
                                        r"the q4_1 weights has 2 along its q_heads axis.*32-input"):
        devices.place_model(model, sharding.tensor_parallel_mesh(4))


def test_kv_heads_that_do_not_divide_are_replicated(tmp_path):
    """2 kv heads over 4 devices: the KV pool stays whole on every device, the rest splits; the
    outputs still equal the single-device run's."""
    model = load_model(write_tiny_llama(tmp_path, num_kv_heads=2), "float32", progress=False)
    rules = sharding.tensor_parallel_rules(model.config, 4)
    assert rules["kv_heads"] is None and rules["mlp"] == "model"
    ref = LLM(model, **ENGINE).generate(PROMPTS, GREEDY)
    llm = LLM(model, devices="cpu:4", **ENGINE)
    assert_same_outputs(llm.generate(PROMPTS, GREEDY), ref, atol=1e-4)
    for pool in llm.core.runner.kv:
        assert pool.sharding.is_fully_replicated and len(pool.sharding.device_set) == 4
    assert llm.core.model.params["layers"][0]["w_down"].sharding.spec == P("model", None)


def test_devices_syntax():
    assert devices.parse("cpu") == devices.DeviceSpec("cpu", "cpu", 1)
    assert devices.parse("cpu:3").count == 3
    assert devices.parse("gpu:all") == devices.DeviceSpec("gpu:all", "cuda", None)
    assert devices.parse("gpu:0,1").ids == (0, 1)
    for bad in ("npu", "cpu:x", "cpu:0", "gpu:1,1", "cpu:1,2"):
        with pytest.raises(UserError, match="--devices"):
            devices.parse(bad)
    with pytest.raises(UserError, match="--devices cpu:8: this process has 4 cpu devices"):
        devices.device_groups("cpu:8")
    with pytest.raises(UserError, match="--data-parallel-degree 3 does not divide the 4"):
        devices.device_groups("cpu:4", 3)
    assert [len(g) for g in devices.device_groups("cpu:4", 2)] == [2, 2]
    assert devices.replica_meshes(None) == [None] and devices.replica_meshes("cpu") == [None]


def test_the_python_api_starts_jax_with_the_devices_it_names():
    """LLM(devices="cpu:2") in a fresh process without XLA_FLAGS (the CLI did it; the API said
    to set XLA_FLAGS)."""
    code = ("import jax, maxjax, maxjax.llm as m\n"
            "m.build_core = lambda *a, **k: print(len(jax.devices()))\n"
            "try:\n    maxjax.LLM(devices='cpu:2')\nexcept AttributeError:\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip() == "2", out.stderr[-2000:]


@pytest.mark.parametrize("encoding", ["float32", "int8"])
def test_sharded_artifacts_serve_without_compiling_and_name_the_mesh(tiny4, reference, quantized,
                                                                     encoding, tmp_path):
    """float32, and int8: quantized weights sharded through export and serialized executables."""
    from maxjax.aot import export
    from maxjax.engine.build import on_devices
    from maxjax.engine.config import EngineConfig
    from maxjax.engine.plan import EnginePlan, plan_layout
    if encoding == "float32":
        model, ref, engine, atol = tiny4, reference, ENGINE, 1e-4
    else:
        (model, ref), engine, atol = quantized[encoding], QUANT_ENGINE, QUANT_ATOL
    cfg = EngineConfig(devices="cpu:2", quantization_encoding=model.dtype, **engine)
    placed = on_devices(model, cfg)
    export.write_artifacts(str(tmp_path / "tp2"), placed, EnginePlan(cfg, plan_layout(cfg, placed)), ["cpu"],
                           progress=False)
    before = compile_counter.count()
    llm = LLM(model, devices="cpu:2", precompiled_artifacts=[str(tmp_path / "tp2")],
              require_compiled_artifacts=True, **engine)
    assert_same_outputs(llm.generate(PROMPTS, GREEDY), ref, atol=atol)
    assert compile_counter.count() == before     # loading, warm-up and serving compiled nothing
    assert_declared_shardings(llm.core, 2)
    if encoding != "float32":
        assert_quantized_splits(llm.core, 2)
    with pytest.raises(UserError, match=r"engine mesh: artifacts \{.*'model': 2.*this run None"):
        LLM(model, precompiled_artifacts=[str(tmp_path / "tp2")], **engine)


# two rows, prompts prefilled two tokens a step: batched and chunked steps in two graphs
SMOL_ENGINE = dict(max_batch_size=2, max_batch_input_tokens=2, max_length=128, num_kv_pages=12,
                   kv_cache_page_size=16, use_experimental_kernels=False)


@pytest.mark.parametrize("encoding", ["float32", "int8"])
def test_smollm2_at_three_devices_equals_one_device(encoding):
    """SmolLM2's 3 kv heads (9 heads, vocabulary 49152) over 3 devices; int8 (the embedded
    GGUF's default encoding) in one step graph of one token, which keeps its compiles cheap."""
    model = load_model(None, encoding, progress=False)
    # float32: the 3-way psum of the row-parallel linears reorders sums, which moves an
    # activation by about an ulp (2^-23 relative); measured 1.9e-5 at most on the logprobs.
    # int8 quantizes each activation row in two int8 digits (graphs/quant.py), the low digit's
    # step max|x| / (127 * 254) ~ 2^-15 max|x|: where that ulp moves an element across a
    # rounding boundary it changes by a whole step, 2^8 times what it changes by in float32.
    # So the int8 bound is 256 x a float32 one: measured 4.3e-3 and 5.25e-3 (a CI run); the
    # tolerance 256 * 8e-5, 4x float32's measured worst. The greedy tokens must still be equal.
    engine, atol = (SMOL_ENGINE, 2e-3) if encoding == "float32" else (
        dict(SMOL_ENGINE, max_batch_size=1, max_batch_input_tokens=1), 256 * 8e-5)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True,
                            top_logprobs=3)
    one = LLM(model, **engine)
    prompts = [one.encode("The capital of France is"), one.encode("def fibonacci(n):")]
    ref = one.generate(prompts, params)
    del one
    tp = LLM(model, devices="cpu:3", **engine)
    assert_same_outputs(tp.generate(prompts, params), ref, atol=atol)
    assert_declared_shardings(tp.core, 3)
    if encoding == "int8":
        assert_quantized_splits(tp.core, 3)
    assert tp.core.step_compiles == 0
