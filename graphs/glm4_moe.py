"""Glm4MoeForCausalLM (GLM-4.5 / 4.6): grouped-query attention with q/k/v biases (o_proj none),
optional per-head q/k norm and rope on the first partial_rotary_factor of each head, then
DeepSeek-V3's routed MLPs (graphs/moe.py `route_grouped`: sigmoid, group-limited top-k,
correction bias, routed scaling) with a shared expert after `first_k_dense_replace` dense
layers. MTP layers (num_nextn_predict_layers) are not loaded."""
from functools import partial

from maxjax.graphs import decoder, moe
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
    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    rp = hf.get("rope_parameters") or {}
    factor = float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
    rotary = int(head_dim * factor)
    routing = moe.grouped_routing_config(hf, experts=128, first_dense=1, expert_f=1408,
                                         scaling=1.0)
    return base_config(
        hf, head_dim=head_dim, attention_out_bias=False, qk_norm=bool(hf.get("use_qk_norm")),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rotary_dim=rotary if rotary < head_dim else None, **routing)


ARCHITECTURE = Architecture("Glm4MoeForCausalLM", config_from_hf,
                            params_from_hf=partial(decoder.params_from_hf, moe_names=MOE_NAMES),
                            description="GLM-4.5/4.6 (partial rotary, q/k/v bias; sigmoid "
                                        "group-limited routing with shared experts)")
