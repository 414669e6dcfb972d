"""--use-experimental-kernels (graphs/cpu_kernels.py): the CPU int8 kernel against NumPy on every
row-tile remainder; a tiny int8 model's paged greedy run through it equals the NumPy reference
model of weight-only int8 (tests/quant_reference.py on the weights' float values: float32
activations, no activation digits); the engine serves it, and artifacts built with it serve with 0
compiles and are refused, naming the flag, by a run without it. Skipped where the kernel cannot
be built (no AVX-512F/BW, no g++)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quant_reference as ref
from maxjax.errors import UserError
from maxjax.graphs import cpu_kernels, quant
from maxjax.models.loader import load_model
from paged_harness import paged_greedy
from reference import assert_logits_close
from tiny_llama import write_tiny_llama

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable() is not None,
                                reason=f"CPU int8 kernel: {cpu_kernels.unavailable()}")
PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [300, 2, 2, 77]]
NEW_TOKENS = 6
LOGIT_REL_TOL = 2e-3     # float32 sums in another order than NumPy's


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 40])
def test_kernel_equals_numpy(rows):
    rng = np.random.default_rng(rows)
    q = rng.integers(-127, 128, (96, 320)).astype(np.int8)
    scale = rng.uniform(1e-3, 2e-2, 320).astype(np.float32)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    w = cpu_kernels.pack_weight(quant.QuantizedWeight(jnp.asarray(q), jnp.asarray(scale)))
    assert w.q.shape == (5, 96, 64) and w.shape == (96, 320)
    got = np.asarray(jax.jit(quant.linear)(jnp.asarray(x), w))
    want = (x.astype(np.float64) @ q.astype(np.float64)) * scale
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(write_tiny_llama(str(tmp_path_factory.mktemp("k") / "hf")), "int8",
                      progress=False)


def weight_values(params):
    """Every bits-8 QuantizedWeight as the float32 values it stands for: q * scale per output
    column, per row for the [V, D] tables."""
    def value(w, rows=False):
        if not isinstance(w, quant.QuantizedWeight):
            return w
        q, s = np.asarray(w.q, np.float32), np.asarray(w.scale)
        return q * (s[:, None] if rows else s)
    out = {**params, "layers": [{k: value(v) for k, v in layer.items()}
                                for layer in params["layers"]]}
    for k in ("embed", "lm_head"):
        if k in params:
            out[k] = value(params[k], rows=True)
    return out


def test_tiny_model_greedy_equals_weight_only_reference(tiny):
    packed = cpu_kernels.pack_params(tiny.params)
    assert cpu_kernels.kernels_of(packed) == [cpu_kernels.INT8_LINEAR]
    assert cpu_kernels.kernels_of(tiny.params) == []
    assert packed["layers"][0]["wqkv"].q.ndim == 3 and packed["lm_head"].q.ndim == 3
    assert packed["embed"] is tiny.params["embed"]        # the row lookup keeps its table
    logits, tokens = paged_greedy(tiny.arch, tiny.config, packed, PROMPTS, chunk=3,
                                  new_tokens=NEW_TOKENS, page_size=4)
    values = weight_values(tiny.params)
    for prompt, got_logits, got in zip(PROMPTS, logits, tokens):
        want_logits, want = ref.greedy(tiny.config, values, prompt, NEW_TOKENS)
        assert got == want
        assert_logits_close(got_logits, want_logits, rel=LOGIT_REL_TOL)


def test_engine_and_artifacts(tiny, tmp_path):
    from maxjax.aot.export import export_engine
    from maxjax.engine.types import SamplingParams
    from maxjax.llm import LLM
    engine = dict(max_batch_size=2, max_batch_input_tokens=16, max_length=64, num_kv_pages=24,
                  kv_cache_page_size=8, compile_cache=False)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    llm = LLM(tiny, use_experimental_kernels=True, **engine)
    assert cpu_kernels.kernels_of(llm.core.model.params) == [cpu_kernels.INT8_LINEAR]
    outs = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    values = weight_values(tiny.params)
    assert outs == [ref.greedy(tiny.config, values, p, NEW_TOKENS)[1] for p in PROMPTS]
    assert llm.core.step_compiles == 0
    export_engine(str(tmp_path / "art"), llm.core)
    again = LLM(tiny, use_experimental_kernels=True, precompiled_artifacts=[str(tmp_path / "art")],
                **engine)
    assert [o.token_ids for o in again.generate(PROMPTS, greedy)] == outs
    assert again.core.step_compiles == 0
    with pytest.raises(UserError, match="--use-experimental-kernels"):
        LLM(tiny, precompiled_artifacts=[str(tmp_path / "art")], **engine)


def test_refused_where_it_cannot_run(tiny):
    from maxjax.engine.build import experimental_kernels
    with pytest.raises(UserError, match="--use-experimental-kernels: its kernel is for the CPU"):
        experimental_kernels(tiny, None, ["cuda", "cpu"])
    f32 = load_model(tiny.source, "float32", progress=False)
    assert experimental_kernels(f32, None, ["cpu"]) is f32     # nothing to run: float32 as is
