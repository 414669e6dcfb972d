"""Qwen3.5, dense (Qwen3_5ForCausalLM / ...ForConditionalGeneration) and mixture of experts
(Qwen3_5MoeForCausalLM / ...ForConditionalGeneration): graphs/qwen3_next.py's hybrid with the
DeltaNet's projections stored apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; q|k|v
already in the conv's channel order) rather than grouped per key head. Dense: every MLP dense.
MoE: every MLP routed (softmax top-k, always renormalised) with the gated shared expert.

Hub checkpoints are the image-text wrappers: config.json nests the text model under
`text_config` (maxjax/models/hf.py read_config takes it) and the weights sit under
model.language_model. (the reader finds them). Its M-RoPE sections turn a text token's three
equal positions as 1-D rope does, so text is served; the vision tower is not loaded (images are
refused), nor are the MTP layers.
"""
from __future__ import annotations

import numpy as np

from maxjax.graphs.qwen3_next import (G, GGUF_LAYER_NAMES, GGUF_MOE, gguf_config,
                                      hybrid_architecture, hybrid_config, load_params)

NAMES = {"w_in": [G + "in_proj_qkv.weight", G + "in_proj_z.weight", G + "in_proj_b.weight",
                  G + "in_proj_a.weight"]}


def config_from_hf(hf: dict):
    """A missing field takes transformers' Qwen3_5TextConfig default."""
    return hybrid_config(hf, ())


def moe_config_from_hf(hf: dict):
    """A missing field takes transformers' Qwen3_5MoeTextConfig default."""
    experts = int(hf.get("num_experts", 256) or 0)
    routed = (experts > 0,) * int(hf["num_hidden_layers"])
    return hybrid_config({**hf, "num_experts": experts,
                          "num_experts_per_tok": hf.get("num_experts_per_tok", 8),
                          "norm_topk_prob": True}, routed if any(routed) else ())


def params_from_hf(cfg, get, dtype, progress=None, quantizer=None):
    return load_params(cfg, get, dtype, progress, quantizer, NAMES)


# --- GGUF (convert_hf_to_gguf's Qwen3_5TextModel / Qwen3_5MoeTextModel) ----------------------
# Where value heads outnumber key heads, llama.cpp stores every per-value-head axis tiled (value
# head j of key head g at j * G + g) where HF groups them (g * r + j): `_grouped` undoes it.

def _grouped(w, hf, width: int, axis: int = 0):
    G, H = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    if G == H:
        return w
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(H // G, G, width, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(w, 0, axis)


def _qkv(read, hf):
    qk = 2 * hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
    w = read("attn_qkv.weight")
    return np.concatenate([w[:qk], _grouped(w[qk:], hf, hf["linear_value_head_dim"])])


def _conv(read, hf):
    qk = 2 * hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
    w = read("ssm_conv1d.weight")
    return np.concatenate([w[:qk], _grouped(w[qk:], hf, hf["linear_value_head_dim"])])[:, None]


def _per_head(source: str, transform=lambda w: w):
    return (source,), lambda read, hf: transform(_grouped(read(source), hf, 1))


GGUF_TENSORS = GGUF_MOE | {
    "linear_attn.in_proj_qkv.weight": (("attn_qkv.weight",), _qkv),
    "linear_attn.in_proj_z.weight": (("attn_gate.weight",), lambda read, hf: _grouped(
        read("attn_gate.weight"), hf, hf["linear_value_head_dim"])),
    "linear_attn.in_proj_b.weight": _per_head("ssm_beta.weight"),
    "linear_attn.in_proj_a.weight": _per_head("ssm_alpha.weight"),
    "linear_attn.A_log": _per_head("ssm_a", lambda w: np.log(-w)),
    "linear_attn.dt_bias": _per_head("ssm_dt.bias"),
    "linear_attn.conv1d.weight": (("ssm_conv1d.weight",), _conv),
    "linear_attn.out_proj.weight": (("ssm_out.weight",), lambda read, hf: _grouped(
        read("ssm_out.weight"), hf, hf["linear_value_head_dim"], axis=1)),
}
_GGUF = dict(gguf_config=gguf_config, gguf_layer_names=GGUF_LAYER_NAMES,
             gguf_tensors=GGUF_TENSORS, gguf_norm_plus_one=True,
             gguf_tokenizer="Qwen2Tokenizer")

_DENSE = "Qwen3.5 dense (Gated DeltaNet + gated attention, a recurrent state a request)"
_MOE = ("Qwen3.5 MoE (Gated DeltaNet + gated attention, a recurrent state a request; routed "
        "MLPs with a gated shared expert)")
_TEXT = "; text only: the vision tower is not loaded"
ARCHITECTURES = [
    hybrid_architecture("Qwen3_5ForCausalLM", config_from_hf, params_from_hf, _DENSE,
                        gguf_archs=("qwen35",), **_GGUF),
    hybrid_architecture("Qwen3_5ForConditionalGeneration", config_from_hf, params_from_hf,
                        _DENSE + _TEXT),
    hybrid_architecture("Qwen3_5MoeForCausalLM", moe_config_from_hf, params_from_hf, _MOE,
                        gguf_archs=("qwen35moe",), **_GGUF),
    hybrid_architecture("Qwen3_5MoeForConditionalGeneration", moe_config_from_hf,
                        params_from_hf, _MOE + _TEXT),
]
