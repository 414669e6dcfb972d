"""A tiny random Llama written as an HF directory without torch (config, safetensors, tokenizer)."""
from __future__ import annotations

import json
import os

import numpy as np


def write_tiny_llama(path, rms_norm_eps=1e-5, tokenizer=None, vocab_size=512,
                     num_kv_heads=2) -> str:
    """A 2-layer random Llama (4 heads) as an HF directory (config.json, safetensors, word-level
    tokenizer; or `tokenizer`, a transformers tokenizer of `vocab_size` ids, e.g. another
    model's)."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    os.makedirs(path, exist_ok=True)
    V, H, I, L, NH, KV, D = vocab_size, 64, 128, 2, 4, num_kv_heads, 16
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V,
           "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
           "num_attention_heads": NH, "num_key_value_heads": KV, "max_position_embeddings": 512,
           "rms_norm_eps": rms_norm_eps, "rope_theta": 10000.0, "tie_word_embeddings": True,
           "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "float32"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    rng = np.random.default_rng(0)
    w = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)
    t = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": np.ones(H, np.float32)}
    for i in range(L):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(NH * D, H), p + "self_attn.k_proj.weight": w(KV * D, H),
                  p + "self_attn.v_proj.weight": w(KV * D, H), p + "self_attn.o_proj.weight": w(H, NH * D),
                  p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H),
                  p + "mlp.down_proj.weight": w(H, I),
                  p + "input_layernorm.weight": np.ones(H, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(H, np.float32)})
    save_file(t, os.path.join(path, "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
        return str(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return str(path)


def tiny_core(directory, **engine_options):
    """A warmed-up EngineCore on a tiny random Llama written into `directory` (4 rows, 16 tokens
    a step, 24 pages of 8 tokens, max length 64 unless overridden), built as every entry point
    builds one: engines of the same options share graphs through the compile cache."""
    from maxjax.engine.build import build_core
    from maxjax.engine.config import EngineConfig
    from maxjax.models.loader import load_model
    model = load_model(write_tiny_llama(directory), "float32", progress=False)
    options = dict(max_batch_size=4, max_batch_input_tokens=16, max_length=64, num_kv_pages=24,
                   kv_cache_page_size=8)
    return build_core(model, EngineConfig(**{**options, **engine_options}))
