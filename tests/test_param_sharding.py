"""Parameter and KV pool specs with logical axes, and their tensor-parallel placement on a mesh.

The two-device checks run this file as a script in a subprocess: XLA's host device count is
fixed when jax is first imported, and the test process has imported it with one device.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "multimodal_config": {"image_token_id": 500}}   # what the image-text families read


def _configs():
    """A tiny config per built-in architecture; between them they switch on every optional
    parameter (lm_head, bqkv, q_norm/k_norm, post norms)."""
    from maxjax.models import registry
    archs = {a.name: a for a in registry.builtin_architectures()}   # not other tests' customs
    mrope = {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}   # head_dim 16
    return [(arch, arch.config_from_hf({**TINY, "architectures": [name],
                                        **(mrope if name.startswith("Qwen2_5_VL") else {})}))
            for name, arch in sorted(archs.items())]


def _leaves(tree):
    import jax
    from maxjax.graphs.sharding import ArraySpec
    return jax.tree.leaves_with_path(tree, is_leaf=lambda x: isinstance(x, ArraySpec))


def test_every_parameter_and_the_kv_pool_have_ruled_logical_axes():
    from maxjax.graphs import decoder
    from maxjax.graphs.sharding import TENSOR_PARALLEL
    configs = _configs()
    assert len(configs) >= 5
    for arch, cfg in configs:
        leaves = _leaves(arch.param_specs(cfg)) + _leaves(decoder.kv_pool_specs(cfg, 3, 16, 2))
        for path, spec in leaves:
            assert len(spec.axes) == len(spec.shape), (arch.name, path)
            assert set(spec.axes) <= set(TENSOR_PARALLEL), (arch.name, path, spec.axes)


def test_optional_parameters_are_covered():
    keys = set()
    for arch, cfg in _configs():
        specs = arch.param_specs(cfg)
        keys |= set(specs) | set(specs["layers"][0])
    assert {"lm_head", "bqkv", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"} <= keys


def test_shapes_and_abstract_params_come_from_the_specs():
    import jax.numpy as jnp
    from maxjax.graphs import decoder
    from maxjax.graphs.config import ModelConfig
    cfg = ModelConfig("X", vocab_size=100, hidden_size=8, intermediate_size=12, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=3, attention_bias=True, qk_norm=True,
                      post_norms=True)
    layer = {"attn_norm": (8,), "wqkv": (8, 24), "bqkv": (24,), "q_norm": (3,), "k_norm": (3,),
             "wo": (12, 8), "post_attn_norm": (8,), "mlp_norm": (8,), "w_gate_up": (8, 24),
             "w_down": (12, 8), "post_mlp_norm": (8,)}
    expected = {"embed": (100, 8), "final_norm": (8,), "layers": [layer, layer],
                "lm_head": (100, 8)}
    assert decoder.param_shapes(cfg) == expected
    abstract = decoder.abstract_params(cfg, jnp.bfloat16)
    assert abstract["layers"][1]["wqkv"].shape == (8, 24)
    assert abstract["lm_head"].dtype == jnp.bfloat16
    assert decoder.kv_pool_shape(cfg, 5, 16) == (2, 5, 2, 16, 3)
    k, v = decoder.kv_specs(cfg, 5, 16, jnp.float32)
    assert k.shape == v.shape == (2, 5, 2, 16, 3)


def test_architecture_param_shapes_follow_its_own_specs():
    import dataclasses
    from maxjax.graphs import decoder
    from maxjax.graphs.sharding import ArraySpec
    arch, cfg = next((a, c) for a, c in _configs() if a.name == "LlamaForCausalLM")
    assert arch.param_shapes(cfg) == decoder.param_shapes(cfg)
    own = {"w": ArraySpec((2, 3), ("embed", "mlp"))}
    custom = dataclasses.replace(arch, param_specs=lambda c: own)
    assert custom.param_shapes(cfg) == {"w": (2, 3)}


def test_partition_specs_follow_the_rules():
    from jax.sharding import PartitionSpec as P
    from maxjax.graphs.sharding import ArraySpec, TENSOR_PARALLEL, partition_spec
    assert partition_spec(ArraySpec((8, 4), ("vocab", "embed"))) == P("model", None)
    assert partition_spec(ArraySpec((4, 8), ("q_heads", "embed"))) == P("model", None)
    replicated = {**TENSOR_PARALLEL, "vocab": None}
    assert partition_spec(ArraySpec((8, 4), ("vocab", "embed")), replicated) == P(None, None)
    with pytest.raises(ValueError, match="no sharding rule for logical axes \\['no_such_axis'\\]"):
        partition_spec(ArraySpec((2,), ("no_such_axis",)))
    with pytest.raises(ValueError, match="has 2 dims"):
        ArraySpec((2, 3), ("embed",))


def test_tensor_parallel_placement_and_forward_on_two_devices():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                          " --xla_force_host_platform_device_count=2").strip())
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def _two_device_check():
    import jax
    import jax.numpy as jnp
    from maxjax.graphs import decoder, sharding
    from maxjax.graphs.llama import ARCHITECTURE as llama
    from maxjax.graphs.step import RowSlice, build_step_inputs

    assert jax.device_count() == 2
    cfg = llama.config_from_hf({**TINY, "architectures": ["LlamaForCausalLM"]})
    mesh = sharding.tensor_parallel_mesh(2)
    rng = np.random.default_rng(0)
    specs = llama.param_specs(cfg)
    params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape, np.float32) * 0.2),
                          sharding.abstract(specs, np.float32))
    pages, page_size = 3, 16
    kv_specs = decoder.kv_pool_specs(cfg, pages, page_size)
    kv = decoder.init_kv(cfg, pages, page_size, jnp.float32)
    placed_params = sharding.place(params, specs, mesh)
    placed_kv = sharding.place(kv, kv_specs, mesh)

    for tree, spec_tree in ((placed_params, specs), (placed_kv, kv_specs)):
        for (path, spec), arr in zip(_leaves(spec_tree), jax.tree.leaves(tree)):
            want = sharding.partition_spec(spec)
            assert arr.sharding.spec == want, (path, arr.sharding.spec, want)
            split = [d for d, ax in enumerate(want) if ax is not None]
            shard_shapes = {s.data.shape for s in arr.addressable_shards}
            devices = {s.device for s in arr.addressable_shards}
            assert len(devices) == 2, path
            expect = tuple(n // 2 if d in split else n for d, n in enumerate(arr.shape))
            assert shard_shapes == {expect}, (path, shard_shapes, expect)
    assert any(ax for _, s in _leaves(specs) for ax in sharding.partition_spec(s))

    rows = [RowSlice(list(range(3, 10)), 0, [1]), RowSlice(list(range(20, 25)), 0, [2])]
    step = build_step_inputs(rows, 16, 2, 1, page_size)
    fwd = jax.jit(lambda p, c, s: decoder.forward(cfg, p, c, s))
    logits, new_kv = fwd(params, kv, step)
    tp_logits, tp_kv = fwd(placed_params, placed_kv, step)
    np.testing.assert_allclose(np.asarray(tp_logits), np.asarray(logits), rtol=1e-4, atol=1e-4)
    for pool, tp_pool, spec in zip(new_kv, tp_kv, kv_specs):
        np.testing.assert_allclose(np.asarray(tp_pool), np.asarray(pool), rtol=1e-4, atol=1e-4)
        assert tp_pool.sharding.is_equivalent_to(
            jax.sharding.NamedSharding(mesh, sharding.partition_spec(spec)), tp_pool.ndim)


if __name__ == "__main__":
    _two_device_check()
