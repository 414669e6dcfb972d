"""The KV pool's initializer (maxjax/engine/kv_pool.py): compiled once per pool shape, or the one
provided (from artifacts) with no compile at all; the pool it makes is updated in place."""
import jax
import jax.numpy as jnp
import numpy as np

from maxjax.engine import compile_counter, kv_pool
from maxjax.graphs.config import ModelConfig
from maxjax.graphs.decoder import kv_specs

CFG = ModelConfig("LlamaForCausalLM", 64, 32, 64, 2, 4, 2, 8)


def test_compiled_once_per_shape():
    before = compile_counter.count()
    k, v = kv_pool.zeros(CFG, 3, 4, jnp.float32)
    assert compile_counter.count() == before + 1
    assert [(a.shape, a.dtype) for a in (k, v)] == \
        [(s.shape, s.dtype) for s in kv_specs(CFG, 3, 4, jnp.float32)]
    assert not np.any(np.asarray(k)) and not np.any(np.asarray(v))
    kv_pool.zeros(CFG, 3, 4, jnp.float32)
    assert compile_counter.count() == before + 1
    kv_pool.zeros(CFG, 3, 4, jnp.bfloat16)
    assert compile_counter.count() == before + 2


def test_a_provided_initializer_is_used_without_compiling():
    made = []

    def initializer():
        made.append(1)
        return "pool"
    kv_pool.provide(CFG, 5, 4, jnp.float32, initializer)
    before = compile_counter.count()
    assert kv_pool.zeros(CFG, 5, 4, jnp.float32) == "pool" and made == [1]
    assert compile_counter.count() == before


def test_the_pool_is_updated_in_place():
    kv = kv_pool.zeros(CFG, 7, 4, jnp.float32)
    step = jax.jit(lambda kv: tuple(a.at[0, 1].set(1.0) for a in kv), donate_argnums=0)
    pointers = [a.unsafe_buffer_pointer() for a in kv]
    kv = step(kv)
    assert [a.unsafe_buffer_pointer() for a in kv] == pointers
