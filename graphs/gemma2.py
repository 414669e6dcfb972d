"""Gemma2ForCausalLM (Gemma 2): alternating sliding-window and full layers, attention logit
softcapping, final logit softcapping.

From transformers' modeling_gemma2: norms before and after attention and MLP, scaling by (1 + w),
embeddings times sqrt(hidden) (cast to the weight dtype first), query_pre_attn_scalar**-0.5
attention scale, attention scores through cap * tanh(s / cap) before the mask, gelu-tanh MLP, one
rope theta for every layer, no q/k norm. Missing config fields take Gemma2Config's defaults.
"""
from maxjax.graphs.arch import GEMMA_GGUF_NAMES, Architecture, base_config, layer_windows


def _cap(value):
    return float(value) if value else None


def config_from_hf(hf: dict):
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma2 with use_bidirectional_attention is not supported")
    if hf.get("attention_bias"):
        # transformers puts a bias on o_proj too, which the shared decoder does not carry.
        raise ValueError("Gemma2 with attention_bias=true is not supported")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return base_config(
        hf,
        layer_windows=layer_windows(types, hf.get("sliding_window", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        norm_plus_one=True, post_norms=True,
        embed_scale=float(hf["hidden_size"]) ** 0.5,
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_logit_softcap=_cap(hf.get("attn_logit_softcapping", 50.0)),
        final_logit_softcap=_cap(hf.get("final_logit_softcapping", 30.0)),
    )


def gguf_config(hf: dict, get, tensors) -> None:
    # llama.cpp (llama-model.cpp): even layers sliding, odd full; queries scaled by
    # 1/sqrt(head_dim) except 27B (46 layers: hidden / heads), as Gemma 2's query_pre_attn_scalar.
    n = hf["num_hidden_layers"]
    hf["sliding_window"] = int(get("attention.sliding_window", 4096))
    hf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"] if n == 46 \
        else hf["head_dim"]
    hf["hidden_activation"] = hf["hidden_act"] = "gelu_pytorch_tanh"
    hf["attn_logit_softcapping"] = float(get("attn_logit_softcapping", 50.0))   # llama.cpp's
    hf["final_logit_softcapping"] = float(get("final_logit_softcapping", 30.0))  # defaults


ARCHITECTURE = Architecture("Gemma2ForCausalLM", config_from_hf, gguf_archs=("gemma2",),
                            gguf_config=gguf_config, gguf_layer_names=GEMMA_GGUF_NAMES,
                            gguf_norm_plus_one=True, gguf_tokenizer="GemmaTokenizer",
                            float16_overflows=True,
                            description="Gemma 2 (alternating sliding window, logit softcapping)")
