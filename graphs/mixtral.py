"""MixtralForCausalLM: Mistral (optional sliding window) with every MLP routed over
`num_local_experts` experts of `intermediate_size` (graphs/moe.py), top-k always renormalised
(transformers' MixtralTopKRouter). Checkpoint experts: w1 gate, w3 up, w2 down.
"""
from functools import partial

from maxjax.graphs import decoder
from maxjax.graphs.arch import Architecture, base_config

M = "model.layers.{i}.block_sparse_moe."
MOE_NAMES = {"router": [M + "gate.weight"],
             "experts_gate_up": [M + "experts.{j}.w1.weight", M + "experts.{j}.w3.weight"],
             "experts_down": [M + "experts.{j}.w2.weight"]}


def config_from_hf(hf: dict):
    """A missing field takes transformers' MixtralConfig default."""
    n = hf["num_hidden_layers"]
    window = int(hf.get("sliding_window") or 0)
    return base_config(hf, layer_windows=(window,) * n, moe_layers=(True,) * n,
                       num_experts=int(hf.get("num_local_experts", 8)),
                       experts_per_token=int(hf.get("num_experts_per_tok", 2)),
                       expert_intermediate_size=int(hf["intermediate_size"]),
                       norm_topk_prob=True, attention_bias=False, attention_out_bias=False)


ARCHITECTURE = Architecture("MixtralForCausalLM", config_from_hf,
                            params_from_hf=partial(decoder.params_from_hf, moe_names=MOE_NAMES),
                            description="Mixtral mixture of experts (top-2 of 8 routed MLPs)")
