"""maxjax/models/gguf.py on small GGUF files written here with gguf.GGUFWriter: dequantization of
each supported type, llama's Q/K un-permutation, Gemma's norm offset, config from metadata, and the
errors a bad file gives."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from maxjax.errors import UserError
from maxjax.models import gguf as G
from maxjax.models import registry

RNG = np.random.default_rng(0)
TOKENS = ["<unk>", "<s>", "</s>", "ab"] + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567")

# tiny llama: vocab 64, hidden 64, 2 layers, 4 heads of 16, 2 KV heads
V, H, I, L, NH, NKV, HD = 64, 64, 128, 2, 4, 2, 16


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py LlamaModel.permute (the transform our reader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qt, n_blocks):
    """Random block bytes whose fp16 scale fields hold sane finite values."""
    block, size = GGML_QUANT_SIZES[qt]
    raw = RNG.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    half_at = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qt]
    for at in half_at:
        raw[:, at:at + 2] = RNG.uniform(-0.05, 0.05, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


# --- dequantization ---------------------------------------------------------------------------

def test_q8_0_known_values():
    block = np.zeros(34, np.uint8)
    block[:2] = np.array([0.5], np.float16).view(np.uint8)
    block[2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    np.testing.assert_array_equal(G.dequantize(T.Q8_0, (32,), block), np.arange(-16, 16) * 0.5)


def test_q4_0_and_q4_1_known_values():
    q = np.arange(32) % 16                         # element j: low nibble of byte j, then high
    packed = (q[:16] | (q[16:] << 4)).astype(np.uint8)
    q40 = np.concatenate([np.array([2.0], np.float16).view(np.uint8), packed])
    np.testing.assert_array_equal(G.dequantize(T.Q4_0, (32,), q40), (q - 8) * 2.0)
    q41 = np.concatenate([np.array([0.25, -1.0], np.float16).view(np.uint8), packed])
    np.testing.assert_array_equal(G.dequantize(T.Q4_1, (32,), q41), q * 0.25 - 1.0)


@pytest.mark.parametrize("qt,tol", [(T.Q8_0, 0.01), (T.Q4_0, 0.15), (T.Q4_1, 0.1), (T.Q5_0, 0.07)])
def test_roundtrip_through_gguf_quantize(qt, tol):
    x = RNG.standard_normal((48, 256)).astype(np.float32)
    raw = quantize(x, qt)
    ours = G.dequantize(qt, x.shape, raw.reshape(-1))
    assert ours.shape == x.shape and ours.dtype == np.float32
    assert np.max(np.abs(ours - x)) < tol * np.max(np.abs(x))
    from gguf.quants import dequantize as gguf_dequantize
    np.testing.assert_array_equal(ours, gguf_dequantize(raw, qt))


@pytest.mark.parametrize("qt", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q4_1])
def test_matches_transformers_torch_dequant(qt):
    """transformers' own (torch) dequantizer is an independent implementation of the formats."""
    torch = pytest.importorskip("torch")
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    n_blocks = 70000 if qt == T.Q4_K else 40     # Q4_K spans more than one of our chunks
    if qt in (T.Q4_K, T.Q5_K, T.Q6_K):
        raw = random_blocks(qt, n_blocks)
        shape = (n_blocks, 256)
    else:
        x = RNG.standard_normal((n_blocks, 32)).astype(np.float32)
        raw = quantize(x, qt).reshape(-1)
        shape = x.shape
    ours = G.dequantize(qt, shape, raw)
    ref = hf_dequantize(torch.from_numpy(raw.copy()), int(qt)).numpy().reshape(shape)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)


def test_float_types():
    x = RNG.standard_normal((3, 5)).astype(np.float32)
    np.testing.assert_array_equal(G.dequantize(T.F32, (3, 5), x.view(np.uint8).reshape(-1)), x)
    h = x.astype(np.float16)
    np.testing.assert_array_equal(G.dequantize(T.F16, (3, 5), h.view(np.uint8).reshape(-1)),
                                  h.astype(np.float32))
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)
    want = (bf.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(G.dequantize(T.BF16, (3, 5), bf.view(np.uint8).reshape(-1)), want)


def test_unsupported_type_is_a_user_error():
    with pytest.raises(UserError, match=r"Q2_K.*supported: F32"):
        G.dequantize(T.Q2_K, (256,), np.zeros(84, np.uint8))


def test_unpermute_inverts_llama_cpp_permute():
    w = RNG.standard_normal((NH * HD, H)).astype(np.float32)
    np.testing.assert_array_equal(G.unpermute_qk(llama_cpp_permute(w, NH), NH), w)
    b = RNG.standard_normal(NKV * HD).astype(np.float32)
    np.testing.assert_array_equal(G.unpermute_qk(llama_cpp_permute(b, NKV), NKV), b)


# --- whole files ------------------------------------------------------------------------------

def hf_weights(tied=True):
    w = {"model.embed_tokens.weight": RNG.standard_normal((V, H)),
         "model.norm.weight": 1 + 0.1 * RNG.standard_normal(H)}
    if not tied:
        w["lm_head.weight"] = RNG.standard_normal((V, H))
    for i in range(L):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + 0.1 * RNG.standard_normal(H),
                  p + "post_attention_layernorm.weight": 1 + 0.1 * RNG.standard_normal(H),
                  p + "self_attn.q_proj.weight": RNG.standard_normal((NH * HD, H)),
                  p + "self_attn.k_proj.weight": RNG.standard_normal((NKV * HD, H)),
                  p + "self_attn.v_proj.weight": RNG.standard_normal((NKV * HD, H)),
                  p + "self_attn.o_proj.weight": RNG.standard_normal((H, NH * HD)),
                  p + "mlp.gate_proj.weight": RNG.standard_normal((I, H)),
                  p + "mlp.up_proj.weight": RNG.standard_normal((I, H)),
                  p + "mlp.down_proj.weight": RNG.standard_normal((H, I))})
    return {k: (0.05 * v if v.ndim == 2 else v).astype(np.float32) for k, v in w.items()}


def write_gguf(path, arch, hf, qtype=T.F32, extra_kv=None, tokenizer=False, gemma=False,
               override_type=None):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    if arch == "llama":
        w.add_rope_dimension_count(HD)
    else:
        w.add_key_length(HD)
        w.add_value_length(HD)
    w.add_vocab_size(V)
    for k, v in (extra_kv or {}).items():
        w.add_uint32(k, v)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(TOKENS)
        w.add_token_merges(["a b"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template("{{ messages }}")
    reader = G.GGUFTensorReader.__new__(G.GGUFTensorReader)
    reader.layer_names = G.layer_names(registry.for_gguf_arch("gemma3" if gemma else "llama"))
    for name, t in hf.items():
        gname = reader.gguf_name(name)
        if arch == "llama" and ".attn_q." in gname:
            t = llama_cpp_permute(t, NH)
        elif arch == "llama" and ".attn_k." in gname:
            t = llama_cpp_permute(t, NKV)
        if gemma and gname.endswith("norm.weight"):
            t = t + 1
        qt = override_type if (override_type and t.ndim == 2) else (qtype if t.ndim == 2 else T.F32)
        if qt == T.F32:
            w.add_tensor(gname, t)
        elif qt == T.F16:
            w.add_tensor(gname, t.astype(np.float16))
        elif qt in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
            w.add_tensor(gname, quantize(t, qt), raw_dtype=qt)
        else:   # bytes of the right size; only the type matters to the caller
            block, size = GGML_QUANT_SIZES[qt]
            w.add_tensor(gname, np.zeros((t.shape[0], t.shape[1] // block * size), np.uint8),
                         raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    hf = hf_weights()
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", "llama", hf, T.F32,
                      tokenizer=True)
    return path, hf


def test_llama_config_from_metadata(llama_file):
    hf, reader, tokenizer, template = G.open_gguf(llama_file[0])
    want = {"architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": H,
            "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": NH,
            "num_key_value_heads": NKV, "head_dim": HD, "rope_theta": 50000.0,
            "max_position_embeddings": 256, "tie_word_embeddings": True, "bos_token_id": 1,
            "eos_token_id": 2}
    assert {k: hf[k] for k in want} == want
    assert hf["rms_norm_eps"] == pytest.approx(1e-5)
    assert template == "{{ messages }}"
    assert tokenizer.convert_ids_to_tokens(5) == "b" and tokenizer.eos_token == "</s>"
    assert tokenizer("abc").input_ids == [3, 6]
    cfg = registry.get_architecture("LlamaForCausalLM").config_from_hf(hf)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.eos_token_ids) == (L, NKV, HD, (2,))


def test_llama_tensors_in_hf_layout(llama_file):
    path, hf = llama_file
    _, reader, _, _ = G.open_gguf(path)
    assert sorted(reader.names()) == sorted(hf)
    for name, want in hf.items():
        np.testing.assert_array_equal(reader(name), want, err_msg=name)
    with pytest.raises(UserError, match="no tensor for 'lm_head.weight'"):
        reader("lm_head.weight")


@pytest.mark.parametrize("qt", [T.F16, T.Q8_0, T.Q4_1])
def test_quantized_file_dequantizes_close(tmp_path, qt):
    hf = hf_weights(tied=False)
    path = write_gguf(tmp_path / "q.gguf", "llama", hf, qt)
    got, reader, tokenizer, template = G.open_gguf(path)
    assert got["tie_word_embeddings"] is False and tokenizer is None and template is None
    for name, want in hf.items():
        tol = {T.F16: 1e-3, T.Q8_0: 0.01, T.Q4_1: 0.1}[qt] * np.max(np.abs(want))
        assert np.max(np.abs(reader(name) - want)) <= tol, name


def test_load_model_on_tiny_gguf(llama_file):
    from maxjax.models.loader import load_model
    m = load_model(llama_file[0], "float32", progress=False)
    assert m.config.num_layers == L and m.name == "tiny-llama"
    np.testing.assert_array_equal(np.asarray(m.params["embed"]), llama_file[1]["model.embed_tokens.weight"])


def test_gemma3_norms_and_config(tmp_path):
    """No Q/K permutation for gemma3; llama.cpp's +1 on every *norm.weight is undone (as
    transformers' Gemma2TensorProcessor does); sliding-window layout from metadata."""
    hf = hf_weights()
    for i in range(L):
        p = f"model.layers.{i}."
        hf[p + "pre_feedforward_layernorm.weight"] = hf.pop(p + "post_attention_layernorm.weight")
        for extra in ("post_attention_layernorm", "post_feedforward_layernorm"):
            hf[p + extra + ".weight"] = (0.1 * RNG.standard_normal(H)).astype(np.float32)
        hf[p + "self_attn.q_norm.weight"] = (0.1 * RNG.standard_normal(HD)).astype(np.float32)
        hf[p + "self_attn.k_norm.weight"] = (0.1 * RNG.standard_normal(HD)).astype(np.float32)
    path = write_gguf(tmp_path / "g.gguf", "gemma3", hf, T.F32, gemma=True,
                      extra_kv={"gemma3.attention.sliding_window": 128})
    gf = G.GGUFFile(path)
    cfg = G.hf_config(gf, "gemma3", "Gemma3ForCausalLM")
    assert cfg["sliding_window"] == 128 and cfg["head_dim"] == HD
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention"]
    assert cfg["rope_local_base_freq"] == 10000.0 and cfg["rope_theta"] == 50000.0
    assert cfg["query_pre_attn_scalar"] == HD and cfg["model_type"] == "gemma3_text"
    reader = G.GGUFTensorReader(gf, "gemma3", cfg)
    assert sorted(reader.names()) == sorted(hf)
    for name, want in hf.items():
        np.testing.assert_allclose(reader(name), want, atol=1e-6, err_msg=name)


def test_metadata_matches_gguf_reader(llama_file):
    """Our header parser against gguf's own GGUFReader."""
    from gguf import GGUFReader
    ref = GGUFReader(llama_file[0])
    ours = G.GGUFFile(llama_file[0])
    assert set(ours.metadata) == set(ref.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, value in ours.metadata.items():
        want = ref.fields[key].contents()
        got = value.tolist() if isinstance(value, np.ndarray) else value
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    for t in ref.tensors:
        qt, shape, raw = ours.raw(t.name)
        assert qt == t.tensor_type and shape == tuple(reversed(t.shape.tolist()))
        np.testing.assert_array_equal(raw, t.data.reshape(-1).view(np.uint8))


# --- bad files --------------------------------------------------------------------------------

def test_truncated_file(llama_file, tmp_path):
    data = open(llama_file[0], "rb").read()
    for cut, what in ((len(data) - 100, "truncated GGUF file"), (300, "truncated or corrupt"),
                      (10, "truncated GGUF file")):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(UserError, match=what) as e:
            G.open_gguf(str(path))
        assert "\n" not in str(e.value)


def test_not_a_gguf(tmp_path):
    for name, data in (("garbage.gguf", bytes(RNG.integers(0, 256, 4096, dtype=np.uint8))),
                       ("text.gguf", b"hello, I am not a model\n" * 10), ("empty.gguf", b"")):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(UserError, match="not a GGUF file"):
            G.open_gguf(str(path))


def test_unsupported_quant_type(tmp_path):
    path = write_gguf(tmp_path / "q2k.gguf", "llama", hf_weights(), override_type=T.Q2_K)
    with pytest.raises(UserError, match=r"uses GGUF type Q2_K, which is not supported \(supported: F32"):
        G.open_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {})
    with pytest.raises(UserError, match="unsupported GGUF architecture 'gpt2'"):
        G.open_gguf(path)
