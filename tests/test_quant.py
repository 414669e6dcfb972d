"""Quantized weights (maxjax/models/quantize.py, graphs/quant.py) on tiny random models: the GGUF
4-bit blocks decode to what the gguf package dequantizes, `linear` equals a NumPy reference of the
same arithmetic, and each encoding's paged greedy run equals the NumPy reference model
(tests/quant_reference.py); encodings a checkpoint cannot serve are refused, naming the flag."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

import quant_reference as ref
from maxjax.errors import UserError
from maxjax.graphs import quant
from maxjax.models import quantize as Q
from maxjax.models.loader import load_model
from paged_harness import paged_greedy
from reference import assert_logits_close
from tiny_llama import q4k_blocks, write_tiny_gguf, write_tiny_llama

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

RNG = np.random.default_rng(0)
PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [300, 2, 2, 77]]
NEW_TOKENS = 6
# logits of the graph vs the NumPy reference: the same integers; float sums in another order
LOGIT_REL_TOL = 2e-3


# --- block formats and linear -----------------------------------------------------------------

@pytest.mark.parametrize("qt", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_q4_blocks_decode_to_gguf_dequantize(qt):
    rows, cols = 8, 512
    raw = q4k_blocks(RNG, rows, cols) if qt == T.Q4_K else \
        quantize(RNG.standard_normal((rows, cols)).astype(np.float32), qt)
    nib, scale, offset = Q.decode_q4(qt.name, (rows, cols), raw.reshape(-1))
    assert nib.max() <= 15 and (offset is None) == (qt == T.Q4_0)
    want = dequantize(raw, qt).reshape(rows, cols)
    got = Q.dequantize_q4(nib, scale, offset)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    # the loader's requantization scale comes from each block's extreme nibbles: exact
    np.testing.assert_array_equal(Q.q4_row_amax(nib, scale, offset), np.abs(got).max(axis=1))


def test_pack_q4_unpacks_in_the_graph():
    nib = RNG.integers(0, 16, (96, 40), dtype=np.uint8)
    unpacked = quant.unpack_int4(jnp.asarray(Q.pack_q4(nib)))
    np.testing.assert_array_equal(np.asarray(unpacked).reshape(96, 40), nib.astype(np.int8) - 8)


def q4_weight(d_in, d_out, qt=T.Q4_1):
    raw = quantize(RNG.standard_normal((d_out, d_in)).astype(np.float32), qt)
    parts = Q.decode_q4(qt.name, (d_out, d_in), raw.reshape(-1))
    return Q.Quantizer("q4_1", None, lambda name: parts).matrix(["w"])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_linear_equals_numpy_reference(bits, rows):
    d_in, d_out = 128, 48
    if bits == 8:
        w = Q.Quantizer("int8", lambda n: RNG.standard_normal((d_out, d_in))).matrix(["w"])
    else:
        w = q4_weight(d_in, d_out)
    assert w.bits == bits and w.shape == (d_in, d_out)
    x = RNG.standard_normal((rows, d_in)).astype(np.float32)
    got = np.asarray(jax.jit(quant.linear)(jnp.asarray(x), w))
    want = ref.linear(x, ref.host(w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # and the quantization itself is close to the float product
    dense = x @ np.asarray(ref.weight_int8(ref.host(w))[0] * ref.weight_int8(ref.host(w))[1])
    assert np.max(np.abs(got - dense)) < 0.02 * np.abs(dense).max()


def test_int8_rows_error_is_half_a_step():
    w = RNG.standard_normal((16, 64)).astype(np.float32)
    q, scale = Q.int8_rows(w)
    assert np.max(np.abs(q * scale[:, None] - w) / scale[:, None]) <= 0.5 + 1e-5


# --- whole tiny models ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    return {"int8": write_tiny_llama(str(d / "hf")),
            "q4_0": write_tiny_gguf(d / "q40.gguf", T.Q4_0),
            "q4_1": write_tiny_gguf(d / "q41.gguf", T.Q4_1, seed=1),
            "q4_k": write_tiny_gguf(d / "q4k.gguf", T.Q4_K, seed=2)}


@pytest.mark.parametrize("encoding", ["int8", "q4_0", "q4_1", "q4_k"])
def test_greedy_equals_numpy_reference(sources, encoding):
    model = load_model(sources[encoding], encoding, progress=False)
    layer = model.params["layers"][0]
    assert all(isinstance(layer[k], quant.QuantizedWeight) for k in ("wqkv", "wo", "w_down"))
    assert layer["wqkv"].bits == (8 if encoding == "int8" else 4)
    logits, tokens = paged_greedy(model.arch, model.config, model.params, PROMPTS, chunk=3,
                                  new_tokens=NEW_TOKENS, page_size=4)
    for prompt, got_logits, got in zip(PROMPTS, logits, tokens):
        want_logits, want = ref.greedy(model.config, model.params, prompt, NEW_TOKENS)
        assert got == want
        assert_logits_close(got_logits, want_logits, rel=LOGIT_REL_TOL)


@pytest.mark.parametrize("encoding", ["q4_0", "q4_1", "q4_k"])
def test_kernel_packing_from_the_blocks_equals_decode_then_pack(sources, encoding):
    # Where the CPU kernels run, Q4_0 / Q4_1 matrices are packed from the GGUF blocks as read
    # (Q4_K's nibbles pair otherwise: decoded first); the kernels get the same arrays either way.
    from maxjax.graphs import cpu_kernels
    decoded = load_model(sources[encoding], encoding, progress=False)
    direct = load_model(sources[encoding], encoding, progress=False, kernels=True)
    assert cpu_kernels.is_packed(direct.params["layers"][0]["wqkv"]) is (encoding != "q4_k")
    want, got = cpu_kernels.pack_params(decoded.params), cpu_kernels.pack_params(direct.params)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_gguf_float32_still_dequantizes(sources):
    model = load_model(sources["q4_1"], "float32", progress=False)
    assert model.dtype == "float32"
    assert model.params["layers"][0]["wqkv"].dtype == jnp.float32


@pytest.mark.parametrize("source,encoding,needle", [
    ("q4_1", "q4_k", "--quantization-encoding q4_k: the checkpoint holds no Q4_K"),
    ("int8", "q4_0", "--quantization-encoding q4_0: the checkpoint holds no Q4_0"),
    ("int8", "int4", "unsupported --quantization-encoding 'int4'"),
])
def test_unavailable_encoding_is_refused(sources, source, encoding, needle):
    with pytest.raises(UserError, match=needle):
        load_model(sources[source], encoding, progress=False)


def test_default_encoding_of_a_gguf(sources):
    """The planner's choice (maxjax/engine/encoding.py), loaded by the start's own `load`."""
    from maxjax.engine.build import load
    from maxjax.engine.config import EngineConfig
    from maxjax.engine.plan import prepare

    def loaded(kernels: bool):
        return load(sources["q4_k"], prepare(EngineConfig(), kernels=kernels, quiet=True))
    assert Q.gguf_encoding(["Q8_0", "Q4_1", "Q4_1", "F32"]) == "int8"
    assert Q.native_4bit(["Q8_0", "Q4_1", "Q4_1", "Q4_K"]) == "q4_1"
    assert Q.gguf_encoding(["F32", "F16"]) == "float32"
    assert loaded(False).dtype == "int8"
    # with --use-experimental-kernels a GGUF serves in its own 4-bit blocks
    assert Q.gguf_encoding(["Q8_0", "Q4_1", "Q4_1", "F32"], kernels=True) == "q4_1"
    assert Q.gguf_encoding(["Q8_0", "F32"], kernels=True) == "int8"
    assert Q.gguf_encoding(["F32", "F16"], kernels=True) == "float32"
    assert loaded(True).dtype == "q4_k"


def test_engine_serves_int8_with_bfloat16_kv_and_compiles_nothing(sources):
    from maxjax.engine.types import SamplingParams
    from maxjax.llm import LLM
    model = load_model(sources["int8"], "int8", progress=False)
    llm = LLM(model, max_batch_size=2, max_batch_input_tokens=16, max_length=64, num_kv_pages=24,
              kv_cache_page_size=8, kv_cache_format="bfloat16")
    assert llm.core.runner.kv[0].dtype == jnp.bfloat16
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0,
                                                 ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [NEW_TOKENS] * len(PROMPTS)
    assert llm.core.step_compiles == 0
