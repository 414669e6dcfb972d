"""What llama.cpp's GGUF metadata says differently per architecture: the HF config fields
maxjax/models/gguf.py `hf_config` cannot read off the common keys (each family's rules from
llama.cpp's llama-model.cpp and convert_hf_to_gguf.py)."""
from __future__ import annotations

from maxjax.errors import UserError


def phi3_fields(hf: dict, get, gf) -> None:
    # convert_hf_to_gguf's Phi3MiniModel: rope.dimension_count is the rotary part of a head
    # (partial_rotary_factor), LongRoPE comes as rope_factors_long/short tensors.
    if "rope_factors_long.weight" in gf.tensors or "rope_factors_short.weight" in gf.tensors:
        raise UserError(f"{gf.path}: Phi3 LongRoPE (rope_factors_long/short) is not supported")
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    rotary = int(get("rope.dimension_count") or head_dim)
    hf["head_dim"] = head_dim
    hf["partial_rotary_factor"] = rotary / head_dim
    hf["sliding_window"] = int(get("attention.sliding_window", 0)) or None



def gemma2_fields(hf: dict, get) -> None:
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


def granite_fields(hf: dict, get) -> None:
    # convert_hf_to_gguf GraniteModel writes the four multipliers; llama.cpp's defaults when
    # absent: 1, and 1/sqrt(head_dim) for the attention scale.
    for key, field in (("embedding_scale", "embedding_multiplier"),
                       ("residual_scale", "residual_multiplier"),
                       ("logit_scale", "logits_scaling")):
        hf[field] = float(get(key, 1.0))
    hf["attention_multiplier"] = float(get("attention.scale", hf["head_dim"] ** -0.5))


def gemma3_fields(hf: dict, get) -> None:
    # llama.cpp hard-codes these for Gemma 3 (llama-model.cpp): 5 local : 1 global layers, local
    # rope base 10k, queries scaled by 1/sqrt(head_dim) except 27B (hidden / heads).
    n = hf["num_hidden_layers"]
    pattern = 6
    hf["sliding_window"] = int(get("attention.sliding_window", 512))
    hf["sliding_window_pattern"] = pattern
    hf["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    hf["rope_local_base_freq"] = 10000.0
    hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"] if n == 62 \
        else hf["head_dim"]
    hf["hidden_activation"] = "gelu_pytorch_tanh"
    hf["hidden_act"] = "gelu_pytorch_tanh"
    hf["final_logit_softcapping"] = None
    hf["attn_logit_softcapping"] = None
    full = {"rope_type": "default", "rope_theta": hf["rope_theta"]}
    if "rope_scaling" in hf:
        full = dict(hf["rope_scaling"], rope_theta=hf["rope_theta"])
    hf["rope_parameters"] = {"full_attention": full,
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


# --- tokenizer --------------------------------------------------------------------------------
