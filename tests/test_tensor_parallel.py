"""Tensor parallelism (`--devices cpu:N`) on the 4 host devices tests/conftest.py forces: greedy
tokens equal the single-device run's and logprobs agree within 1e-4 (tiny model) / 2e-3
(SmolLM2: a sharded matmul sums in another order); the parameters and the KV pool carry the
shardings their logical axes declare (kv heads that do not divide are replicated); sharded
artifacts serve without compiling and are refused on another mesh; bad --devices values are
one-line errors."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxjax.engine import compile_counter, devices
from maxjax.engine.types import SamplingParams
from maxjax.errors import UserError
from maxjax.graphs import sharding
from maxjax.llm import LLM
from maxjax.models.loader import load_model
from tiny_llama import write_tiny_llama

ENGINE = dict(max_batch_size=4, max_batch_input_tokens=16, max_length=64, num_kv_pages=24,
              kv_cache_page_size=8)
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True,
                        top_logprobs=3)
PROMPTS = [[5, 9, 33, 7, 100, 3, 17, 250, 8, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69], [40, 41, 42]]


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """A tiny random Llama with 4 kv heads."""
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny4"), num_kv_heads=4)
    return load_model(path, "float32", progress=False)


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
    specs = model.arch.param_specs(model.config)
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, sharding.ArraySpec))
    for spec, arr in zip(leaves, jax.tree.leaves(model.params)):
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
    assert llm.stats()["pages_used"] == 0


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


def test_sharded_artifacts_serve_without_compiling_and_name_the_mesh(tiny4, reference, tmp_path):
    from maxjax.aot import export
    from maxjax.engine.build import on_devices
    from maxjax.engine.config import EngineConfig
    from maxjax.engine.core import plan_layout
    cfg = EngineConfig(devices="cpu:2", **ENGINE)
    placed = on_devices(tiny4, cfg)
    export.write_artifacts(str(tmp_path / "tp2"), placed, cfg, plan_layout(cfg, placed), ["cpu"],
                           progress=False)
    before = compile_counter.count()
    llm = LLM(tiny4, devices="cpu:2", precompiled_artifacts=[str(tmp_path / "tp2")],
              require_compiled_artifacts=True, **ENGINE)
    assert_same_outputs(llm.generate(PROMPTS, GREEDY), reference, atol=1e-4)
    assert compile_counter.count() == before     # loading, warm-up and serving compiled nothing
    assert llm.core.layout.mesh.size == 2
    with pytest.raises(UserError, match=r"engine mesh: artifacts \{.*'model': 2.*this run None"):
        LLM(tiny4, precompiled_artifacts=[str(tmp_path / "tp2")], **ENGINE)


SMOL_ENGINE = dict(max_batch_size=2, max_batch_input_tokens=32, max_length=128, num_kv_pages=12,
                   kv_cache_page_size=16)


def test_smollm2_at_three_devices_equals_one_device():
    """SmolLM2's 3 kv heads (9 heads, vocabulary 49152) over 3 devices."""
    model = load_model(None, "float32", progress=False)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True,
                            top_logprobs=3)
    one = LLM(model, **SMOL_ENGINE)
    prompts = [one.encode("The capital of France is"), one.encode("def fibonacci(n):")]
    ref = one.generate(prompts, params)
    del one
    tp = LLM(model, devices="cpu:3", **SMOL_ENGINE)
    assert_same_outputs(tp.generate(prompts, params), ref, atol=2e-3)
    assert_declared_shardings(tp.core, 3)
    assert tp.core.step_compiles == 0
