"""MistralForCausalLM: Llama with an optional sliding window on every layer.

transformers' mask: the key at position k is visible to the query at q iff 0 <= q - k < window
(masking_utils.sliding_window_overlay); graphs/attention.py applies the same rule.
No GGUF arch: llama.cpp writes Mistral checkpoints as "llama" (without the window).
"""
from maxjax.graphs.arch import Architecture, base_config


def config_from_hf(hf: dict):
    window = int(hf.get("sliding_window") or 0)
    # transformers' Mistral has no projection biases, whatever attention_bias says
    return base_config(hf, layer_windows=(window,) * hf["num_hidden_layers"],
                       attention_bias=False, attention_out_bias=False)


ARCHITECTURE = Architecture("MistralForCausalLM", config_from_hf,
                            description="Mistral 7B and relatives (sliding window)")
