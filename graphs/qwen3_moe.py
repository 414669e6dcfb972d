"""Qwen3MoeForCausalLM: Qwen3 (q/k norm) with routed MLPs (graphs/moe.py), no shared expert.

transformers' Qwen3MoeDecoderLayer: layer i is routed iff i is not in `mlp_only_layers`,
num_experts > 0 and (i + 1) % decoder_sparse_step == 0; the others are dense MLPs of
`intermediate_size`. Experts are `moe_intermediate_size` wide; the top-k weights are
renormalised when `norm_topk_prob`.
"""
from functools import partial

from maxjax.graphs import decoder
from maxjax.graphs.arch import Architecture, base_config, qwen_layer_windows

M = "model.layers.{i}.mlp."
MOE_NAMES = {"router": [M + "gate.weight"],
             "experts_gate_up": [M + "experts.{j}.gate_proj.weight",
                                 M + "experts.{j}.up_proj.weight"],
             "experts_down": [M + "experts.{j}.down_proj.weight"]}


def config_from_hf(hf: dict):
    """A missing field takes transformers' Qwen3MoeConfig default."""
    if hf.get("attention_bias"):
        raise ValueError("Qwen3-MoE with attention_bias=true is not supported")
    n = hf["num_hidden_layers"]
    # transformers 5 writes num_local_experts; hub checkpoints say num_experts
    experts = int(hf.get("num_experts", hf.get("num_local_experts", 128)))
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    moe = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))
    return base_config(hf, qk_norm=True, layer_windows=qwen_layer_windows(hf),
                       moe_layers=moe if any(moe) else (), num_experts=experts,
                       experts_per_token=int(hf.get("num_experts_per_tok", 8)),
                       expert_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


ARCHITECTURE = Architecture("Qwen3MoeForCausalLM", config_from_hf,
                            params_from_hf=partial(decoder.params_from_hf, moe_names=MOE_NAMES),
                            description="Qwen3 mixture of experts (top-k routed MLPs)")
