"""Gemma 2 and Granite 3 against transformers on tiny random checkpoints made here: the paged graph
(chunked prefill, three sequences per step, 32 greedy tokens) through the HF loader and through a
GGUF written the way llama.cpp's convert_hf_to_gguf writes the family; each block feature new to
the decoder shown to matter; int8 within a perplexity bound of float32."""
from __future__ import annotations

import dataclasses
import functools
import glob
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from safetensors.numpy import load_file

from maxjax import cli
from maxjax.graphs import attention, cpu_kernels
from maxjax.graphs.decoder import init_kv
from maxjax.graphs.pallas_attention import PAGED_KERNEL, paged_attention
from maxjax.graphs.step import RowSlice, build_step_inputs
from maxjax.models import gguf as G
from maxjax.models import registry
from maxjax.models.loader import load_model
from paged_harness import paged_greedy
from reference import assert_logits_close, hf_greedy
from test_gguf import llama_cpp_permute
from test_pallas_attention import LAYER, LAYERS, ragged_batch
from gguf_common import write_common_header

VOCAB, WINDOW, NEW_TOKENS = 512, 16, 32
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
# Logits within 1e-3 of the largest |logit| (reference.assert_logits_close): float32 on both
# sides, differing only in summation order (fused q|k|v, paged online softmax); observed errors
# measured 1.4e-6 (Gemma 2) and 2.9e-7 (Granite) relative, while dropping a feature new to the
# decoder moves them by 0.2-3 relative (test_each_new_feature_matters asks for > 1e-2).
LOGIT_REL_TOL = 1e-3
# int8 (per-row absmax weights, graphs/quant.py) next to float32 on the same checkpoint, over a
# prompt and transformers' greedy continuation of it: perplexity within 0.5% (measured +0.05%
# Gemma 2, -0.02% Granite), top-1 token agreeing on 95% of positions (measured 100%).
INT8_PPL_REL, INT8_TOP1 = 0.005, 0.95


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    # initializer_range 0.2 (not 0.02): attention scores of a few units, so the caps of 2 and 3
    # bend them (with 0.02 tanh(s / cap) ~ s / cap and softcapping would go untested).
    # query_pre_attn_scalar = head_dim as in Gemma 2 2B/9B: llama.cpp's GGUF does not carry it
    # (test_gemma2_config checks another value reaches the scale).
    cfg = Gemma2Config(**COMMON, num_hidden_layers=3, head_dim=32, sliding_window=WINDOW,
                       query_pre_attn_scalar=32, attn_logit_softcapping=2.0,
                       final_logit_softcapping=3.0, initializer_range=0.2)
    return Gemma2ForCausalLM(cfg)


def _granite():
    from transformers import GraniteConfig, GraniteForCausalLM
    cfg = GraniteConfig(**COMMON, num_hidden_layers=2, embedding_multiplier=12.0,
                        attention_multiplier=0.1, residual_multiplier=0.3, logits_scaling=4.0,
                        tie_word_embeddings=True, initializer_range=0.1)
    return GraniteForCausalLM(cfg)


MODELS = {"gemma2": _gemma2, "granite": _granite}
PROMPT_LENGTHS = (5, 40, 90)     # 40 and 90 exceed Gemma 2's window of 16


def _write_gguf(path, name: str, model, hf_dir: str) -> str:
    """The checkpoint as llama.cpp writes it (F32): Gemma norms stored as 1 + w, Granite's
    (a LlamaModel subclass) Q/K rows permuted, the family's scalars in metadata."""
    c = model.config
    arch = {"gemma2": "gemma2", "granite": "granite"}[name]
    w = GGUFWriter(str(path), arch)
    write_common_header(w, c)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if name == "gemma2":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(c.sliding_window)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        w.add_rope_dimension_count(head_dim)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)
    gemma = name == "gemma2"
    names = G.GGUFTensorReader.__new__(G.GGUFTensorReader)
    names.layer_names = G.layer_names(registry.for_gguf_arch(name))
    tensors = {}
    for f in glob.glob(f"{hf_dir}/*.safetensors"):
        tensors.update(load_file(f))
    for hf_name, t in sorted(tensors.items()):
        gname = names.gguf_name(hf_name)
        assert gname is not None, hf_name
        t = np.asarray(t, np.float32)
        if not gemma and ".attn_q." in gname:
            t = llama_cpp_permute(t, c.num_attention_heads)
        elif not gemma and ".attn_k." in gname:
            t = llama_cpp_permute(t, c.num_key_value_heads)
        if gemma and gname.endswith("norm.weight"):
            t = t + 1
        w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _save_tokenizer(path: str):
    """A word-level tokenizer of VOCAB ids (the loader loads one with every checkpoint)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


@pytest.fixture(scope="module", params=list(MODELS))
def family(request, tmp_path_factory):
    """(name, transformers model, HF dir, GGUF path, prompts, transformers' greedy results)."""
    name = request.param
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():
        # Initialization leaves norms at 0 (Gemma's 1 + w) or 1, which would hide a misplaced
        # or doubly-offset norm; randomize them.
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.2 * torch.randn_like(p))
    d = tmp_path_factory.mktemp(name)
    hf_dir = str(d / "hf")
    model.save_pretrained(hf_dir, safe_serialization=True)
    _save_tokenizer(hf_dir)
    gguf_path = _write_gguf(d / f"{name}.gguf", name, model, hf_dir)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, VOCAB, n))) for n in PROMPT_LENGTHS]
    ref = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    return name, model, hf_dir, gguf_path, prompts, ref


@pytest.mark.parametrize("loader", ["hf", "gguf"])
def test_paged_graph_matches_transformers(family, loader):
    name, _, hf_dir, gguf_path, prompts, ref = family
    m = load_model(hf_dir if loader == "hf" else gguf_path, "float32", progress=False)
    assert m.config.architecture == {"gemma2": "Gemma2ForCausalLM",
                                     "granite": "GraniteForCausalLM"}[name]
    logits, tokens = paged_greedy(m.arch, m.config, m.params, prompts, chunk=24,
                                  new_tokens=NEW_TOKENS, page_size=16)
    for ours, our_tokens, (ref_logits, ref_tokens) in zip(logits, tokens, ref):
        assert_logits_close(ours, ref_logits, rel=LOGIT_REL_TOL)
        assert our_tokens == ref_tokens


@functools.cache
def _prefill_graph(arch, cfg):
    """One jitted prefill per (architecture, config), shared by the tests (fewer compiles)."""
    @partial(jax.jit, donate_argnums=(1,))
    def prefill(params, kv, step):
        h, kv = arch.hidden_states(cfg, params, kv, step)
        return arch.lm_logits(cfg, params, h), kv
    return prefill


def _prefill_logits(m, cfg, tokens, page=16):
    """float32 logits at every position of `tokens`, one prefill step."""
    T = 1 << (len(tokens) - 1).bit_length()     # shapes of the bucket only: graphs are shared
    pages = list(range(1, -(-T // page) + 1))
    kv = init_kv(cfg, len(pages) + 1, page, m.compute_dtype)
    step = build_step_inputs([RowSlice(tokens, 0, pages)], T, 1, len(pages), page)
    logits, _ = _prefill_graph(m.arch, cfg)(m.params, kv, step)
    return np.asarray(logits, np.float64)[:len(tokens)]


# The decoder features these families added to ModelConfig, each set to "absent".
DROPPED = {"gemma2": {"attn_logit_softcap": None},
           "granite": {"residual_scale": None, "logits_scaling": None}}


def test_each_new_feature_matters(family):
    """Without each new ModelConfig field (as if the decoder ignored it), the logits leave the
    parity tolerance: the parity test would catch a decoder that dropped it."""
    name, model, hf_dir, _, prompts, _ = family
    m = load_model(hf_dir, "float32", progress=False)
    tokens = prompts[2]
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0].float().numpy()
    assert_logits_close(_prefill_logits(m, m.config, tokens), want, rel=LOGIT_REL_TOL)
    for field, absent in DROPPED[name].items():
        assert getattr(m.config, field) is not None
        cfg = dataclasses.replace(m.config, **{field: absent})
        with pytest.raises(AssertionError, match="max |dlogit|"):
            assert_logits_close(_prefill_logits(m, cfg, tokens), want, rel=10 * LOGIT_REL_TOL)


def _perplexity_and_top1(logits, tokens):
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nxt = np.asarray(tokens[1:])
    logp = logits[np.arange(len(nxt)), nxt] - lse[:-1]
    return math.exp(-logp.mean()), np.argmax(logits[:-1], -1)


@pytest.mark.parametrize("kernels", [False, True], ids=["xla", "cpu-kernels"])
def test_int8_perplexity_next_to_float32(family, kernels):
    """int8 through XLA's matmuls, and through the CPU kernels of --use-experimental-kernels
    (graphs/cpu_kernels.py, the int8 matrices packed)."""
    if kernels and cpu_kernels.unavailable() is not None:
        pytest.skip(f"CPU kernels: {cpu_kernels.unavailable()}")
    _, _, hf_dir, _, prompts, ref = family
    text = prompts[1] + ref[1][1]        # a prompt and transformers' greedy continuation
    scores = {}
    for encoding in ("float32", "int8"):
        m = load_model(hf_dir, encoding, progress=False)
        if encoding == "int8" and kernels:
            m = dataclasses.replace(m, params=cpu_kernels.pack_params(m.params))
            assert cpu_kernels.kernels_of(m.params)
        scores[encoding] = _perplexity_and_top1(_prefill_logits(m, m.config, text), text)
    (base, top_f32), (ours, top) = scores["float32"], scores["int8"]
    assert abs(ours / base - 1) <= INT8_PPL_REL, (ours, base)
    assert np.mean(top == top_f32) >= INT8_TOP1


def test_gpu_kernel_softcaps_like_the_query_blocks():
    """The Pallas kernel (graphs/pallas_attention.py, interpret mode here; no GPU needed) caps
    scores as the query-block attention the parity test checks does, sliding window included."""
    rng = np.random.default_rng(3)
    page, H, KV, T, R, P, window, hd, cap = 16, 4, 2, 32, 4, 4, 20, 16, 2.0
    rows, num_pages = ragged_batch(rng, page, T, R, P)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((LAYERS, num_pages, KV, page, hd)),
                                  jnp.float32) for _ in range(2))
    q = jnp.asarray(3 * rng.standard_normal((T, H, hd)), jnp.float32)   # scores of several units
    kstep = build_step_inputs(rows, T, R, P, page, backend=PAGED_KERNEL)
    qstep = jax.tree.map(jnp.asarray, build_step_inputs(rows, T, R, P, page))
    n = sum(len(r.token_ids) for r in rows)

    def kernel(softcap):
        return np.asarray(paged_attention(q, k_pool, v_pool, LAYER, jnp.asarray(kstep.page_table),
                                          jax.tree.map(jnp.asarray, kstep.attn), window,
                                          hd ** -0.5, softcap, interpret=True))[:n]

    def blocks(softcap):
        return np.asarray(jax.jit(lambda q, k, v, st: attention.attend(
            q, k, v, LAYER, st, window, hd ** -0.5, softcap))(q, k_pool, v_pool, qstep))[:n]
    capped = blocks(cap)
    np.testing.assert_allclose(kernel(cap), capped, atol=2e-5, rtol=0)
    assert np.max(np.abs(blocks(None) - capped)) > 0.05


def _hf(arch: str, **extra) -> dict:
    return {"architectures": [arch], "vocab_size": VOCAB, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2} | extra


def test_gemma2_config():
    arch = registry.get_architecture("Gemma2ForCausalLM")
    # a config.json without the Gemma 2 fields: Gemma2Config's defaults
    cfg = arch.config_from_hf(_hf("Gemma2ForCausalLM", head_dim=16))
    assert cfg.layer_windows == (4096, 0, 4096, 0) and not any(cfg.layer_local_rope)
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
    assert cfg.attn_scale == pytest.approx(256 ** -0.5) and cfg.embed_scale == pytest.approx(8.0)
    assert cfg.norm_plus_one and cfg.post_norms and not cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    cfg = arch.config_from_hf(_hf("Gemma2ForCausalLM", query_pre_attn_scalar=144,
                                  attn_logit_softcapping=None, final_logit_softcapping=None,
                                  sliding_window=8, layer_types=["full_attention"] * 3
                                  + ["sliding_attention"]))
    assert cfg.attn_scale == pytest.approx(144 ** -0.5) and cfg.layer_windows == (0, 0, 0, 8)
    assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
    with pytest.raises(ValueError, match="attention_bias"):
        arch.config_from_hf(_hf("Gemma2ForCausalLM", attention_bias=True))


def test_granite_config():
    arch = registry.get_architecture("GraniteForCausalLM")
    cfg = arch.config_from_hf(_hf("GraniteForCausalLM", embedding_multiplier=12.0,
                                  attention_multiplier=0.0078125, residual_multiplier=0.22,
                                  logits_scaling=8.0))
    assert (cfg.embed_scale, cfg.attn_scale, cfg.residual_scale, cfg.logits_scaling) == \
        (12.0, 0.0078125, 0.22, 8.0)
    for key in ("attention_bias", "mlp_bias"):
        with pytest.raises(ValueError, match=key):
            arch.config_from_hf(_hf("GraniteForCausalLM", **{key: True}))


def test_new_fields_stay_out_of_other_families_fingerprints():
    """ModelConfig.to_dict (the model fingerprint: compile-cache keys, artifacts) of a family
    that leaves the new fields at their defaults is what it was before they existed."""
    llama = registry.get_architecture("LlamaForCausalLM").config_from_hf(_hf("LlamaForCausalLM"))
    new = {"attn_logit_softcap", "residual_scale", "logits_scaling"}
    assert not new & set(llama.to_dict())
    granite = registry.get_architecture("GraniteForCausalLM").config_from_hf(
        _hf("GraniteForCausalLM", residual_multiplier=0.5, logits_scaling=2.0))
    assert granite.to_dict()["residual_scale"] == 0.5 and granite.to_dict()["logits_scaling"] == 2.0


def test_gguf_config_defaults_follow_llama_cpp(tmp_path):
    """Metadata llama.cpp may leave out: Gemma 2's caps (50, 30), Granite's attention scale
    (1/sqrt(head_dim)); Gemma 2 27B's (46 layers) query scale from hidden / heads."""
    for arch, layers in (("gemma2", 46), ("granite", 2)):
        w = GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
        for add, v in ((w.add_block_count, layers), (w.add_embedding_length, 64),
                       (w.add_feed_forward_length, 128), (w.add_head_count, 4),
                       (w.add_head_count_kv, 2), (w.add_key_length, 32), (w.add_vocab_size, 8)):
            add(v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    g = G.hf_config(G.GGUFFile(str(tmp_path / "gemma2.gguf")), "gemma2", "Gemma2ForCausalLM")
    assert (g["attn_logit_softcapping"], g["final_logit_softcapping"]) == (50.0, 30.0)
    assert g["query_pre_attn_scalar"] == 16 and g["layer_types"][:2] == ["sliding_attention",
                                                                          "full_attention"]
    r = G.hf_config(G.GGUFFile(str(tmp_path / "granite.gguf")), "granite", "GraniteForCausalLM")
    assert r["attention_multiplier"] == pytest.approx(32 ** -0.5)
    assert r["embedding_multiplier"] == r["residual_multiplier"] == r["logits_scaling"] == 1.0


def test_maxjax_list_shows_the_families(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "Gemma2ForCausalLM" in out and "[gguf: gemma2]" in out
    assert "GraniteForCausalLM" in out and "[gguf: granite]" in out
