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

from maxjax.graphs.qwen3_next import G, hybrid_architecture, hybrid_config, load_params

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


_DENSE = "Qwen3.5 dense (Gated DeltaNet + gated attention, a recurrent state a request)"
_MOE = ("Qwen3.5 MoE (Gated DeltaNet + gated attention, a recurrent state a request; routed "
        "MLPs with a gated shared expert)")
_TEXT = "; text only: the vision tower is not loaded"
ARCHITECTURES = [
    hybrid_architecture("Qwen3_5ForCausalLM", config_from_hf, params_from_hf, _DENSE),
    hybrid_architecture("Qwen3_5ForConditionalGeneration", config_from_hf, params_from_hf,
                        _DENSE + _TEXT),
    hybrid_architecture("Qwen3_5MoeForCausalLM", moe_config_from_hf, params_from_hf, _MOE),
    hybrid_architecture("Qwen3_5MoeForConditionalGeneration", moe_config_from_hf,
                        params_from_hf, _MOE + _TEXT),
]
