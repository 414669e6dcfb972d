"""Glm4MoeForCausalLM (GLM-4.5 / 4.6): grouped-query attention with q/k/v biases (o_proj none),
optional per-head q/k norm and rope on the first partial_rotary_factor of each head, then
DeepSeek-V3's routed MLPs (graphs/moe.py `route_grouped`: sigmoid, group-limited top-k,
correction bias, routed scaling) with a shared expert after `first_k_dense_replace` dense
layers. MTP layers (num_nextn_predict_layers) are not loaded."""
from functools import partial

from maxjax.graphs import decoder
from maxjax.graphs.arch import Architecture, base_config

M = "model.layers.{i}.mlp."
MOE_NAMES = {"router": [M + "gate.weight"],
             "router_correction": [M + "gate.e_score_correction_bias"],
             "experts_gate_up": [M + "experts.{j}.gate_proj.weight",
                                 M + "experts.{j}.up_proj.weight"],
             "experts_down": [M + "experts.{j}.down_proj.weight"],
             "shared_gate_up": [M + "shared_experts.gate_proj.weight",
                                M + "shared_experts.up_proj.weight"],
             "shared_down": [M + "shared_experts.down_proj.weight"]}


def config_from_hf(hf: dict):
    """A missing field takes transformers' Glm4MoeConfig default."""
    quant_method = (hf.get("quantization_config") or {}).get("quant_method")
    if quant_method:
        raise ValueError(f"config.json quantization_config quant_method {quant_method}: "
                         "quantized GLM-4.5 weights are not supported (a bf16 checkpoint serves)")
    n = int(hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    rp = hf.get("rope_parameters") or {}
    factor = float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
    rotary = int(head_dim * factor)
    experts = int(hf.get("n_routed_experts", 128) or 0)
    first_dense = int(hf.get("first_k_dense_replace", 1) or 0)
    routed = tuple(experts > 0 and i >= first_dense for i in range(n))
    expert_f = int(hf.get("moe_intermediate_size", 1408))
    groups = int(hf.get("n_group") or 1)
    if experts and (experts % groups or experts // groups < 2):
        raise ValueError(f"n_group {groups}: {experts} experts split into groups of 2 or more")
    return base_config(
        hf, head_dim=head_dim, attention_out_bias=False, qk_norm=bool(hf.get("use_qk_norm")),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rotary_dim=rotary if rotary < head_dim else None,
        moe_layers=routed if any(routed) else (), num_experts=experts,
        experts_per_token=int(hf.get("num_experts_per_tok", 8)),
        expert_intermediate_size=expert_f, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        router_scoring="sigmoid", n_group=groups, topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        shared_expert_intermediate_size=expert_f * int(hf.get("n_shared_experts", 1) or 0))


ARCHITECTURE = Architecture("Glm4MoeForCausalLM", config_from_hf,
                            params_from_hf=partial(decoder.params_from_hf, moe_names=MOE_NAMES),
                            description="GLM-4.5/4.6 (partial rotary, q/k/v bias; sigmoid "
                                        "group-limited routing with shared experts)")
