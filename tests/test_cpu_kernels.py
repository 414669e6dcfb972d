"""--use-experimental-kernels (graphs/cpu_kernels.py): the CPU int8 kernel against the NumPy
reference of graphs/quant.py's int8 arithmetic (tests/quant_reference.py: two activation digits,
integer sums) on every row-tile remainder, and the 4-bit one against float64 GGUF arithmetic,
each for every instruction set this CPU runs (MAXJAX_CPU_ISA: avx512, avx2); a tiny int8 model's
paged greedy run through it equals the NumPy reference model; the engine serves it, and
artifacts built with it serve with 0 compiles and are refused, naming the flag, by a run without
it. Skipped where no ISA's kernels can be built (no AVX2/FMA/F16C, no g++)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quant_reference as ref
from maxjax.engine.config import EngineConfig
from maxjax.errors import UserError
from maxjax.graphs import cpu_kernels, quant
from maxjax.models.loader import load_model
from maxjax.models.quantize import pack_q4
from kernel_checks import kernels_engine_round_trip
from paged_harness import paged_greedy
from reference import assert_logits_close
from tiny_llama import write_tiny_llama

RUNNABLE = [isa for isa in cpu_kernels.ISAS if cpu_kernels.unavailable(isa) is None]
pytestmark = pytest.mark.skipif(not RUNNABLE, reason=f"CPU kernels: {cpu_kernels.unavailable()}")
needs_process_isa = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                       reason=f"CPU kernels: {cpu_kernels.unavailable()}")
PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [300, 2, 2, 77]]
NEW_TOKENS = 6
LOGIT_REL_TOL = 2e-3     # float32 sums in another order than NumPy's


@pytest.fixture(params=RUNNABLE)
def kernel_isa(request, monkeypatch):
    """Each ISA this CPU runs, as the process's (MAXJAX_CPU_ISA) while the test traces."""
    monkeypatch.setenv(cpu_kernels.ISA_ENV, request.param)
    return request.param


def traced(f, *args, isa):
    """jax.jit(f), having checked that its graph calls `isa`'s kernels and no other ISA's (f: a
    fresh function, so that no trace cached under another ISA is reused)."""
    jitted = jax.jit(f)
    hlo = jitted.lower(*args).as_text()
    called = [t for t in cpu_kernels.TARGETS if t in hlo]
    assert called and all(t.endswith("_" + isa) for t in called), called
    return jitted


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 40])
def test_kernel_equals_numpy(rows, kernel_isa):
    rng = np.random.default_rng(rows)
    q = rng.integers(-127, 128, (96, 320)).astype(np.int8)
    scale = rng.uniform(1e-3, 2e-2, 320).astype(np.float32)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    x[0, :3] = [0.0, 1e-30, -7.0]        # a zero, a tiny and a dominant value in one row
    w = quant.QuantizedWeight(jnp.asarray(q), jnp.asarray(scale))
    packed = cpu_kernels.pack_weight(w)
    assert packed.q.shape == (5, 24, 64, 4) and packed.shape == (96, 320)
    linear = traced(lambda x, w: quant.linear(x, w), jnp.asarray(x), packed, isa=kernel_isa)
    got = np.asarray(linear(jnp.asarray(x), packed))
    want = ref.linear(x, ref.host(w))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    if rows > 1:        # a zero row: both digits have scale 1 and every product is 0
        zero = np.asarray(linear(jnp.zeros((rows, 96)), packed))
        assert not zero.any()
    live = rows // 2     # a bucket's padding rows after the live ones come out 0
    part = np.asarray(jax.jit(lambda x, w: quant.linear(x, w, live=live))(jnp.asarray(x), packed))
    np.testing.assert_array_equal(part[:live], got[:live])
    assert not part[live:].any()


@pytest.mark.parametrize("rows,offset", [(1, True), (2, False), (3, True), (40, True)])
def test_int4_kernel_equals_gguf_arithmetic(rows, offset, kernel_isa):
    """GGUF 4-bit blocks in their own arithmetic: x times scale * (nibble - 8) + offset, against
    float64 NumPy (the two activation digits leave ~1e-5 of the largest output)."""
    rng = np.random.default_rng(rows)
    i, o = 96, 320
    nib = rng.integers(0, 16, (i, o)).astype(np.uint8)
    scale = rng.uniform(1e-3, 2e-2, (i // 32, o)).astype(np.float32)
    off = rng.uniform(-0.1, 0.1, (i // 32, o)).astype(np.float32) if offset else None
    w = quant.QuantizedWeight(jnp.asarray(pack_q4(nib)), jnp.asarray(scale),
                              None if off is None else jnp.asarray(off), jnp.ones(o), bits=4)
    wf = (nib.reshape(i // 32, 32, o) - 8.0) * scale[:, None, :] + (0 if off is None else
                                                                   off[:, None, :])
    x = rng.standard_normal((rows, i)).astype(np.float32)
    packed = cpu_kernels.pack_weight(w)
    assert packed.q.shape == (5, 12, 64, 4) and packed.shape == (96, 320)
    assert cpu_kernels.kernels_of({"layers": [{"w": packed}]}) == [cpu_kernels.INT4_LINEAR]
    linear = traced(lambda x, w: quant.linear(x, w), jnp.asarray(x), packed, isa=kernel_isa)
    got = np.asarray(linear(jnp.asarray(x), packed))
    want = x.astype(np.float64) @ wf.reshape(i, o)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(write_tiny_llama(str(tmp_path_factory.mktemp("k") / "hf")), "int8",
                      progress=False)


@needs_process_isa
def test_tiny_model_greedy_equals_reference(tiny):
    packed = cpu_kernels.pack_params(tiny.params)
    assert cpu_kernels.kernels_of(packed) == [cpu_kernels.INT8_LINEAR]
    assert cpu_kernels.kernels_of(tiny.params) == []
    assert packed["layers"][0]["wqkv"].q.ndim == 4 and packed["lm_head"].q.ndim == 4
    assert packed["embed"] is tiny.params["embed"]        # the row lookup keeps its table
    logits, tokens = paged_greedy(tiny.arch, tiny.config, packed, PROMPTS, chunk=3,
                                  new_tokens=NEW_TOKENS, page_size=4)
    for prompt, got_logits, got in zip(PROMPTS, logits, tokens):
        want_logits, want = ref.greedy(tiny.config, tiny.params, prompt, NEW_TOKENS)
        assert got == want
        assert_logits_close(got_logits, want_logits, rel=LOGIT_REL_TOL)


@needs_process_isa
def test_engine_and_artifacts(tiny, tmp_path):
    from maxjax.engine.types import SamplingParams
    engine = dict(max_batch_size=2, max_batch_input_tokens=4, max_length=64, num_kv_pages=24,
                  kv_cache_page_size=8, compile_cache=False)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    want = [ref.greedy(tiny.config, tiny.params, p, NEW_TOKENS)[1] for p in PROMPTS]
    llm = kernels_engine_round_trip(tiny, engine, PROMPTS, greedy, want, tmp_path / "art")
    assert cpu_kernels.kernels_of(llm.core.model.params) == [cpu_kernels.INT8_LINEAR]


def test_refused_where_it_cannot_run(tiny):
    from maxjax.engine.build import experimental_kernels
    from maxjax.engine.plan import choose_kernels
    required = EngineConfig(use_experimental_kernels=True)
    with pytest.raises(UserError, match="--use-experimental-kernels: they are for the CPU"):
        choose_kernels(required, platforms=["cuda", "cpu"])
    assert choose_kernels(EngineConfig(), platforms=["cuda"]) is False
    f32 = load_model(tiny.source, "float32", progress=False)
    assert experimental_kernels(f32) is f32     # nothing to pack: float32 as is
