"""Qwen3ForCausalLM (dense Qwen3): Llama with per-head RMSNorm on q and k before rope."""
from maxjax.graphs.arch import Architecture, base_config, qwen_layer_windows


def config_from_hf(hf: dict):
    if hf.get("attention_bias"):
        # transformers puts a bias on o_proj too, which the shared decoder does not carry.
        raise ValueError("Qwen3 with attention_bias=true is not supported")
    return base_config(hf, qk_norm=True, layer_windows=qwen_layer_windows(hf))


ARCHITECTURE = Architecture("Qwen3ForCausalLM", config_from_hf, gguf_archs=("qwen3",),
                            gguf_tokenizer="Qwen2Tokenizer",
                            description="Qwen3 dense (q/k norm)")
