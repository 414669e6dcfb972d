"""A tiny random Llama written without torch: as an HF directory (config, safetensors, tokenizer)
or as a GGUF of quantized blocks."""
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
    else:
        write_word_tokenizer(path, V)
    return str(path)


def write_word_tokenizer(path, vocab_size: int) -> None:
    """A word-level tokenizer over ids 0..vocab_size-1 (<unk> <s> </s> w3 w4 ...) into `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


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


def q4k_blocks(rng, rows: int, cols: int):
    """Random Q4_K bytes [rows, cols / 256 * 144] with small finite f16 super-block scales."""
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[T.Q4_K]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    raw[:, 0:2] = rng.uniform(2e-4, 6e-4, (len(raw), 1)).astype(np.float16).view(np.uint8)
    raw[:, 2:4] = rng.uniform(5e-4, 1e-3, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path, qt, num_kv_heads=2, head_dim=64, seed=0) -> str:
    """A random 2-layer llama GGUF (vocabulary 320, hidden 256, MLP 512, 4 heads: every
    projection input a whole number of Q4_K's 256-wide super-blocks at head_dim 64) whose
    matrices are of GGUF type `qt` (norms F32, the embedding Q8_0)."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from gguf.quants import quantize
    V, H, I, L, NH, NKV, HD = 320, 256, 512, 2, 4, num_kv_heads, head_dim
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    for add, v in ((w.add_block_count, L), (w.add_context_length, 256), (w.add_embedding_length, H),
                   (w.add_feed_forward_length, I), (w.add_head_count, NH),
                   (w.add_head_count_kv, NKV), (w.add_layer_norm_rms_eps, 1e-5),
                   (w.add_rope_freq_base, 10000.0), (w.add_rope_dimension_count, HD),
                   (w.add_vocab_size, V)):
        add(v)

    def matrix(name, rows, cols, qtype=qt):
        if qtype == T.Q4_K:
            w.add_tensor(name, q4k_blocks(rng, rows, cols), raw_dtype=qtype)
        else:
            x = (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)
    matrix("token_embd.weight", V, H, T.Q8_0)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    for i in range(L):
        p = f"blk.{i}."
        for name, (rows, cols) in {"attn_q": (NH * HD, H), "attn_k": (NKV * HD, H),
                                   "attn_v": (NKV * HD, H), "attn_output": (H, NH * HD),
                                   "ffn_gate": (I, H), "ffn_up": (I, H), "ffn_down": (H, I)}.items():
            matrix(p + name + ".weight", rows, cols)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + name + ".weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def write_answering_llama(path, tokenizer, answer: str, window: int = 65536) -> str:
    """write_tiny_llama's model (with `tokenizer`'s vocabulary and a `window`-token
    max_position_embeddings) made to answer any prompt with `answer` then EOS, whatever the
    sampling: every layer's o_proj and down_proj are zero, so the logits depend on the last token
    alone (lm_head(norm(embed(token)))). The embedding puts each of the answer's tokens on a dim
    of its own and every other token on dim 0; lm_head maps dim 0 to the answer's first token,
    each answer token's dim to the next one and the last one's to EOS, with a logit margin of 40."""
    from safetensors.numpy import load_file, save_file
    write_tiny_llama(path, tokenizer=tokenizer, vocab_size=len(tokenizer))
    ids = tokenizer.encode(answer, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    assert len(set(ids)) == len(ids) and eos not in ids, ids
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name][:] = 0
    embed = np.zeros_like(weights["model.embed_tokens.weight"])
    embed[:, 0] = 1
    embed[ids, 0] = 0
    embed[ids, np.arange(1, len(ids) + 1)] = 1
    head = np.zeros_like(embed)      # the final norm scales a one-hot row to 8: logits of 40
    head[[*ids, eos], np.arange(len(ids) + 1)] = 5
    weights.update({"model.embed_tokens.weight": embed, "lm_head.weight": head})
    save_file(weights, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(tie_word_embeddings=False, max_position_embeddings=window,
               bos_token_id=tokenizer.bos_token_id, eos_token_id=eos)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)
