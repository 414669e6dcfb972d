"""Parity of each built-in architecture with transformers on a tiny random model: the paged
graph (chunked prefill, several sequences per step) against transformers' cached greedy decoding."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from maxjax.errors import UserError
from maxjax.models import registry
from maxjax.models.hf import SafetensorsReader, read_config
from paged_harness import paged_greedy
from reference import assert_logits_close, hf_greedy

VOCAB, WINDOW, NEW_TOKENS = 512, 16, 8
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=True))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32,
                                        tie_word_embeddings=False))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW))


def _llama3():
    from transformers import LlamaConfig, LlamaForCausalLM
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return LlamaForCausalLM(LlamaConfig(**COMMON, num_hidden_layers=2, rope_scaling=scaling))


def _llama_bias():
    """attention_bias puts a bias on o_proj too (it was dropped: other tokens, no error)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**COMMON, num_hidden_layers=2, attention_bias=True))


def _gemma3(**extra):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(**COMMON, **extra, num_hidden_layers=3, head_dim=32, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                           attn_logit_softcapping=20.0,
                           rope_parameters={"full_attention": {"rope_type": "default",
                                                               "rope_theta": 100000.0},
                                            "sliding_attention": {"rope_type": "default",
                                                                  "rope_theta": 1000.0}})
    return Gemma3ForCausalLM(cfg)


def _olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM
    return Olmo2ForCausalLM(Olmo2Config(**COMMON, num_hidden_layers=2, eos_token_id=2))


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(Phi3Config(**COMMON, num_hidden_layers=2, sliding_window=WINDOW,
                                      pad_token_id=0, eos_token_id=2))


def _phi4_mini():
    """Phi-4-mini's shape: rope on 3/4 of each head, tied embeddings (no LongRoPE: refused)."""
    from transformers import Phi3Config, Phi3ForCausalLM
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    return Phi3ForCausalLM(Phi3Config(**COMMON, num_hidden_layers=2, rope_parameters=rope,
                                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=2))


MODELS = {"qwen2": _qwen2, "qwen3": _qwen3, "mistral": _mistral, "llama3": _llama3,
          "llama_bias": _llama_bias, "gemma3": _gemma3,
          "gemma3_bias": lambda: _gemma3(attention_bias=True), "olmo2": _olmo2, "phi3": _phi3,
          "phi4_mini": _phi4_mini}


@pytest.mark.parametrize("name", list(MODELS))
def test_paged_graph_matches_transformers(name, tmp_path):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():
        # Initialization leaves norms at 1 (or 0 for Gemma's 1 + w) and biases at 0, which
        # would hide a misplaced norm or a dropped bias; randomize them.
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)

    hf = read_config(str(tmp_path))
    arch = registry.get_architecture(hf["architectures"][0])
    cfg = arch.config_from_hf(hf)
    params = arch.params_from_hf(cfg, SafetensorsReader(str(tmp_path)), jnp.float32)

    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, VOCAB, n))) for n in (5, 40, 90)]
    logits, tokens = paged_greedy(arch, cfg, params, prompts, chunk=24, new_tokens=NEW_TOKENS,
                                  page_size=16)
    for prompt, ours, our_tokens in zip(prompts, logits, tokens):
        ref_logits, ref_tokens = hf_greedy(model, prompt, NEW_TOKENS)
        # float32 on both sides: 1e-3 of the largest logit leaves room for reordered sums
        # (observed < 1e-6 for olmo2/phi3/phi4_mini) and is under what a missing feature gives
        # (phi4_mini with rope on every dim: 5e-3; phi3 without its window: 1.2)
        assert_logits_close(ours, ref_logits)
        assert our_tokens == ref_tokens


def test_configs_carry_the_architecture_specifics():
    def cfg_of(factory):
        m = factory()
        hf = m.config.to_dict() | {"architectures": [type(m).__name__]}
        return registry.get_architecture(hf["architectures"][0]).config_from_hf(hf)

    assert cfg_of(_qwen2).attention_bias and cfg_of(_qwen2).tie_word_embeddings
    assert cfg_of(_qwen3).qk_norm and cfg_of(_qwen3).head_dim == 32
    assert cfg_of(_mistral).layer_windows == (WINDOW, WINDOW)
    g = cfg_of(_gemma3)
    assert g.layer_windows == (WINDOW, 0, WINDOW)
    assert g.layer_local_rope == (True, False, True)
    assert (g.rope_theta, g.rope_local_theta) == (100000.0, 1000.0)
    assert g.attn_scale == pytest.approx(24 ** -0.5) and g.embed_scale == pytest.approx(8.0)
    assert g.hidden_act == "gelu_pytorch_tanh" and g.norm_plus_one and g.post_norms
    assert g.final_logit_softcap == 30.0
    o = cfg_of(_olmo2)
    assert o.qk_norm and o.qk_norm_full and o.post_norms and not o.pre_norms
    assert o.rms_norm_eps == pytest.approx(1e-5)
    assert cfg_of(_phi3).layer_windows == (WINDOW, WINDOW) and cfg_of(_phi3).rotary_dim is None
    assert cfg_of(_phi4_mini).rotary_dim == 12 and cfg_of(_phi4_mini).tie_word_embeddings


def test_gemma3_transformers4_config_layout():
    hf = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 32, "rope_theta": 1e6,
          "rope_local_base_freq": 1e4, "sliding_window": 512, "sliding_window_pattern": 6,
          "query_pre_attn_scalar": 32, "hidden_activation": "gelu_pytorch_tanh"}
    cfg = registry.get_architecture("Gemma3ForCausalLM").config_from_hf(hf)
    assert cfg.layer_windows == (512,) * 5 + (0, 512)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.tie_word_embeddings and cfg.final_logit_softcap is None


def test_qwen2_sliding_window_only_above_max_window_layers():
    hf = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
          "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}
    assert registry.get_architecture("Qwen2ForCausalLM").config_from_hf(hf).layer_windows == \
        (0, 0, 32, 32)
    hf["use_sliding_window"] = False
    assert registry.get_architecture("Qwen2ForCausalLM").config_from_hf(hf).layer_windows == \
        (0,) * 4


def test_unsupported_variants_are_rejected_by_name():
    base = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    with pytest.raises(ValueError, match="attention_bias"):
        registry.get_architecture("Qwen3ForCausalLM").config_from_hf(
            base | {"architectures": ["Qwen3ForCausalLM"], "attention_bias": True})
    with pytest.raises(ValueError, match="bidirectional"):
        registry.get_architecture("Gemma3ForCausalLM").config_from_hf(
            base | {"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="attention_bias"):
        registry.get_architecture("Olmo2ForCausalLM").config_from_hf(
            base | {"architectures": ["Olmo2ForCausalLM"], "attention_bias": True})
    longrope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    for rope in ({"rope_scaling": longrope}, {"rope_scaling": dict(longrope, type="su")},
                 {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}):
        with pytest.raises(ValueError, match="Phi3 rope scaling .* not supported"):
            registry.get_architecture("Phi3ForCausalLM").config_from_hf(
                base | {"architectures": ["Phi3ForCausalLM"]} | rope)
    mistral = registry.get_architecture("MistralForCausalLM").config_from_hf(
        base | {"architectures": ["MistralForCausalLM"], "sliding_window": None})
    assert mistral.layer_windows == (0, 0)
    from maxjax.models.quantize import check_encoding, supported_encodings
    gemma3 = registry.get_architecture("Gemma3ForCausalLM")
    with pytest.raises(UserError, match="overflows float16"):     # NaN logits, as transformers
        check_encoding("float16", None, gemma3)
    assert "float16" not in supported_encodings(None, gemma3)
    check_encoding("float16", None, registry.get_architecture("LlamaForCausalLM"))
    for name in ("LlamaForCausalLM", "GraniteForCausalLM"):    # transformers' MLP biases
        with pytest.raises(ValueError, match="mlp_bias"):
            registry.get_architecture(name).config_from_hf(
                base | {"architectures": [name], "mlp_bias": True})
    # transformers' Mistral has no projection biases, whatever its config says
    mistral = registry.get_architecture("MistralForCausalLM").config_from_hf(
        base | {"architectures": ["MistralForCausalLM"], "attention_bias": True})
    assert not mistral.attention_bias and not mistral.attention_out_bias
