"""Gemma3ForCausalLM (Gemma 3 text, e.g. 270M/1B): interleaved local/global attention.

Differences from Llama, all read from transformers' modeling_gemma3: local (sliding) layers with
their own rope theta, q/k RMSNorm, norms before and after attention and MLP, norms scaling by
(1 + w), embeddings times sqrt(hidden) (cast to the weight dtype first), query_pre_attn_scalar**-0.5
attention scale, gelu-tanh MLP, optional final logit softcapping. `attn_logit_softcapping` is
ignored because transformers' Gemma3Attention ignores it (Gemma 3 checkpoints set it null).
Reads both config layouts: transformers 4 (rope_theta, rope_local_base_freq,
sliding_window_pattern) and 5 (rope_parameters per layer type, layer_types).
"""
from maxjax.graphs.arch import GEMMA_GGUF_NAMES, Architecture, base_config, layer_windows

_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0   # transformers' Gemma3TextConfig defaults


def config_from_hf(hf: dict):
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma3 with use_bidirectional_attention (EmbeddingGemma) "
                         "is not supported")
    n = hf["num_hidden_layers"]
    pattern = int(hf.get("sliding_window_pattern", 6))
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    rp = hf.get("rope_parameters") or {}
    full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma3 local rope type {local['rope_type']!r} is not supported")
    final_softcap = hf.get("final_logit_softcapping")
    return base_config(
        hf,
        rope_theta=float(full.get("rope_theta", hf.get("rope_theta", _GLOBAL_THETA))),
        rope_local_theta=float(local.get("rope_theta",
                                         hf.get("rope_local_base_freq", _LOCAL_THETA))),
        layer_windows=layer_windows(types, hf.get("sliding_window", 4096)),
        layer_local_rope=tuple(t == "sliding_attention" for t in types),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        qk_norm=True, norm_plus_one=True, post_norms=True,
        embed_scale=float(hf["hidden_size"]) ** 0.5,
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=float(final_softcap) if final_softcap else None,
    )


def gguf_config(hf: dict, get, tensors) -> None:
    # llama.cpp hard-codes these for Gemma 3 (llama-model.cpp): 5 local : 1 global layers, local
    # rope base 10k, queries scaled by 1/sqrt(head_dim) except 27B (hidden / heads).
    n = hf["num_hidden_layers"]
    pattern = 6
    hf["model_type"] = "gemma3_text"
    hf["sliding_window"] = int(get("attention.sliding_window", 512))
    hf["sliding_window_pattern"] = pattern
    hf["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                         for i in range(n)]
    hf["rope_local_base_freq"] = _LOCAL_THETA
    hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"] if n == 62 \
        else hf["head_dim"]
    hf["hidden_activation"] = "gelu_pytorch_tanh"
    hf["hidden_act"] = "gelu_pytorch_tanh"
    hf["final_logit_softcapping"] = None
    hf["attn_logit_softcapping"] = None
    full = {"rope_type": "default", "rope_theta": hf["rope_theta"]}
    if "rope_scaling" in hf:
        full = dict(hf["rope_scaling"], rope_theta=hf["rope_theta"])
    local = {"rope_type": "default", "rope_theta": _LOCAL_THETA}
    hf["rope_parameters"] = {"full_attention": full, "sliding_attention": local}


ARCHITECTURE = Architecture("Gemma3ForCausalLM", config_from_hf, gguf_archs=("gemma3",),
                            gguf_config=gguf_config, gguf_layer_names=GEMMA_GGUF_NAMES,
                            gguf_norm_plus_one=True, gguf_tokenizer="GemmaTokenizer",
                            float16_overflows=True,
                            description="Gemma 3 text (local/global attention, softcapping)")
