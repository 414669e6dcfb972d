"""OLMo 2 and Phi-3 beyond the HF parity of tests/test_arch_parity.py: the same tiny random
checkpoints written as GGUF files the way llama.cpp names their tensors (gguf-py's own HF -> GGUF
name map) and loaded through maxjax/models/gguf.py, and their int8 encoding's perplexity next to
float32."""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from maxjax.errors import UserError
from maxjax.graphs import quant
from maxjax.graphs.decoder import init_kv
from maxjax.graphs.step import RowSlice, build_step_inputs
from maxjax.models import gguf as G
from maxjax.models import registry
from maxjax.models.hf import SafetensorsReader, read_config
from maxjax.models.quantize import Quantizer
from paged_harness import paged_greedy
from reference import assert_logits_close, hf_greedy
from test_arch_parity import MODELS, VOCAB
from gguf_common import write_common_header

NEW_TOKENS = 8
GGUF_ARCH = {"olmo2": "olmo2", "phi3": "phi3", "phi4_mini": "phi3"}
# int8 per output channel on a random model: perplexity of the float model's own continuation
# within 1% of float32's (SmolLM2's bound, tests/test_quant_smollm2.py; observed well under).
INT8_PPL_TOLERANCE = 0.01


def tiny(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():   # norms at 1 would hide a misplaced norm (test_arch_parity.py)
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(0.2 * torch.randn_like(p))
    return model


def write_gguf(path, model, arch: str) -> str:
    """The model's tensors under llama.cpp's names, F32, with the metadata convert_hf_to_gguf
    writes for the architecture (Phi3: rope.dimension_count = the rotary dims, the window)."""
    import gguf
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    write_common_header(w, c)
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * c.rope_parameters["partial_rotary_factor"]))
        w.add_sliding_window(c.sliding_window or 0)
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, c.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        gname = names.get_name(name, try_suffixes=(".weight",))
        assert gname, name
        w.add_tensor(gname, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("name", ["olmo2", "phi3", "phi4_mini"])
def test_gguf_matches_transformers(name, tmp_path):
    model = tiny(name)
    path = write_gguf(tmp_path / f"{name}.gguf", model, GGUF_ARCH[name])
    hf, reader, _, _ = G.open_gguf(path)
    arch = registry.for_gguf_arch(GGUF_ARCH[name])
    cfg = arch.config_from_hf(hf)
    assert cfg.head_dim == 16 and cfg.rotary_dim == (12 if name == "phi4_mini" else None)
    params = arch.params_from_hf(cfg, reader, jnp.float32)
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(0, VOCAB, n))) for n in (7, 50)]
    logits, tokens = paged_greedy(arch, cfg, params, prompts, chunk=24, new_tokens=NEW_TOKENS)
    for prompt, ours, our_tokens in zip(prompts, logits, tokens):
        ref_logits, ref_tokens = hf_greedy(model, prompt, NEW_TOKENS)
        assert_logits_close(ours, ref_logits)     # the tolerance of test_arch_parity.py
        assert our_tokens == ref_tokens


def test_gguf_phi3_longrope_is_refused(tmp_path):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "long.gguf"), "phi3")
    for key, v in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 128),
                   ("attention.head_count", 4), ("vocab_size", 64)):
        w.add_uint32(f"phi3.{key}", v)
    w.add_tensor("rope_factors_long.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="Phi3 LongRoPE .* not supported"):
        G.open_gguf(str(tmp_path / "long.gguf"))


def _logprobs(arch, cfg, params, tokens, page=16):
    pages = list(range(1, -(-len(tokens) // page) + 1))
    kv = init_kv(cfg, len(pages) + 1, page, jnp.float32)

    @partial(jax.jit, donate_argnums=(1,))
    def prefill(params, kv, step):
        h, kv = arch.hidden_states(cfg, params, kv, step)
        return arch.lm_logits(cfg, params, h), kv
    step = build_step_inputs([RowSlice(tokens, 0, pages)], len(tokens), 1, len(pages), page)
    logits = np.asarray(prefill(params, kv, step)[0], np.float64)[:-1]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return logits[np.arange(len(tokens) - 1), tokens[1:]] - lse


@pytest.mark.parametrize("name", ["olmo2", "phi3"])
def test_int8_perplexity_next_to_float32(name, tmp_path):
    model = tiny(name)
    model.save_pretrained(tmp_path, safe_serialization=True)
    hf = read_config(str(tmp_path))
    arch = registry.get_architecture(hf["architectures"][0])
    cfg = arch.config_from_hf(hf)
    reader = SafetensorsReader(str(tmp_path))
    prompt = list(map(int, np.random.default_rng(2).integers(0, VOCAB, 32)))
    tokens = prompt + hf_greedy(model, prompt, 32)[1]     # the model's own continuation
    ppl = {}
    for encoding in ("float32", "int8"):
        quantizer = Quantizer("int8", reader) if encoding == "int8" else None
        params = arch.params_from_hf(cfg, reader, jnp.float32, quantizer=quantizer)
        if quantizer:
            assert all(isinstance(params["layers"][0][k], quant.QuantizedWeight)
                       for k in ("wqkv", "wo", "w_gate_up", "w_down"))
        ppl[encoding] = math.exp(-np.mean(_logprobs(arch, cfg, params, tokens)[len(prompt) - 1:]))
    print(f"\n{name}: int8 perplexity {ppl['int8']:.4f} vs float32 {ppl['float32']:.4f}")
    assert ppl["int8"] != ppl["float32"]
    assert abs(ppl["int8"] / ppl["float32"] - 1) <= INT8_PPL_TOLERANCE


def test_new_config_fields_leave_existing_fingerprints_alone():
    """ModelConfig.to_dict (the model fingerprint, maxjax/aot/manifest.py) names the OLMo 2 /
    Phi-3 fields only where a model sets them: stored artifacts of the other families still
    match."""
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    llama = registry.get_architecture("LlamaForCausalLM").config_from_hf(hf).to_dict()
    assert not {"pre_norms", "qk_norm_full", "rotary_dim"} & set(llama)
    olmo = registry.get_architecture("Olmo2ForCausalLM").config_from_hf(
        hf | {"architectures": ["Olmo2ForCausalLM"]}).to_dict()
    assert olmo["pre_norms"] is False and olmo["qk_norm_full"] is True


def test_maxjax_list_shows_both(capsys):
    import json

    from maxjax import cli
    assert cli.main(["list", "--json"]) == 0
    listed = {a["name"]: a for a in json.loads(capsys.readouterr().out)}
    assert {"Olmo2ForCausalLM", "Phi3ForCausalLM"} <= set(listed)
    assert "phi3" in json.dumps(listed["Phi3ForCausalLM"])
    assert "olmo2" in json.dumps(listed["Olmo2ForCausalLM"])
