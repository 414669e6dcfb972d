"""The KV pool's initializer (graphs/program.py `kv_init_spec`, run by ModelRunner): compiled once
when none is given, the one given (loaded from artifacts) with no compile at all; the pool it
makes is zero, shaped as declared, and updated in place by a donating step."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.engine import compile_counter
from maxjax.engine.runner import ModelRunner
from maxjax.graphs.config import ModelConfig
from maxjax.graphs.decoder import kv_specs

CFG = ModelConfig("LlamaForCausalLM", 64, 32, 64, 2, 4, 2, 8)
MODEL = SimpleNamespace(config=CFG, params={"embed": jax.device_put(np.zeros((64, 32), np.float32))})


def runner(num_pages, kv_init=None):
    return ModelRunner(MODEL, [], num_pages, 4, 2, 16, kv_init=kv_init)


def test_without_an_initializer_one_is_compiled():
    before = compile_counter.count()
    r = runner(3)
    assert compile_counter.count() == before + 1
    k, v = r.kv
    assert [(a.shape, a.dtype) for a in (k, v)] == \
        [(s.shape, s.dtype) for s in kv_specs(CFG, 3, 4, jnp.float32)]
    assert not np.any(np.asarray(k)) and not np.any(np.asarray(v))
    r.kv = None
    r.reset_kv()                                   # a lost pool is replaced by a zero one
    assert compile_counter.count() == before + 1
    assert not np.any(np.asarray(r.kv[0]))


def test_a_given_initializer_is_used_without_compiling():
    made = []

    def kv_init():
        made.append(1)
        return "pool"
    before = compile_counter.count()
    assert runner(5, kv_init=kv_init).kv == "pool" and made == [1]
    assert compile_counter.count() == before


def test_the_pool_is_updated_in_place():
    kv = runner(7).kv
    step = jax.jit(lambda kv: tuple(a.at[0, 1].set(1.0) for a in kv), donate_argnums=0)
    pointers = [a.unsafe_buffer_pointer() for a in kv]
    kv = step(kv)
    assert [a.unsafe_buffer_pointer() for a in kv] == pointers
