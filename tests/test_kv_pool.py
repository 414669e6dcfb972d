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
    r.executor.kv = None
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


def _rss_mb() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


def test_the_cpu_kernels_make_a_zero_pool_without_writing_it():
    """With the CPU kernels' attention the pool's pages go back to the OS instead of being
    filled (graphs/kernels/paged_attention.cc ZeroPool): a 1.5 GiB pool costs no resident
    memory until steps write it; it reads zero, the two pools are distinct buffers, and a
    donating step updates them in place. A pool under 16 memory pages is cleared as it is."""
    import pytest
    from maxjax.graphs import cpu_kernels
    if cpu_kernels.unavailable():
        pytest.skip(f"CPU kernels: {cpu_kernels.unavailable()}")
    from maxjax.graphs.program import jit_kwargs, kv_init_spec
    cfg = ModelConfig("LlamaForCausalLM", 64, 32, 64, 2, 4, 2, 8)
    for pages, page in ((3, 4), (6144, 1024)):        # 6 KB; 2 x 768 MiB
        spec = kv_init_spec(cfg, pages, page, jnp.float32, attention="cpu_paged_kernel")
        make = jax.jit(spec.fn, **jit_kwargs(spec)).lower().compile()
        before = _rss_mb()
        _, (k, v) = make()
        jax.block_until_ready((k, v))
        if pages > 3:
            assert _rss_mb() - before < 64
        assert k.unsafe_buffer_pointer() != v.unsafe_buffer_pointer()
        assert [(a.shape, a.dtype) for a in (k, v)] == \
            [(s.shape, s.dtype) for s in kv_specs(cfg, pages, page, jnp.float32)]
        pointers = [a.unsafe_buffer_pointer() for a in (k, v)]
        step = jax.jit(lambda kv: tuple(a.at[1, -1, 0, 0].set(2.0) for a in kv),
                       donate_argnums=0)
        k, v = step((k, v))
        assert [a.unsafe_buffer_pointer() for a in (k, v)] == pointers
        for a in (k, v):
            assert float(jnp.sum(a)) == 2.0 * a.shape[-1] and float(jnp.max(jnp.abs(a))) == 2.0
        del k, v
