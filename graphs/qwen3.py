"""Qwen3ForCausalLM (dense Qwen3): Llama with per-head RMSNorm on q and k before rope."""
from maxjax.graphs.arch import Architecture, base_config, layer_windows


def config_from_hf(hf: dict):
    if hf.get("attention_bias"):
        # transformers puts a bias on o_proj too, which the shared decoder does not carry.
        raise ValueError("Qwen3 with attention_bias=true is not supported")
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types") or [
        "sliding_attention" if window and i >= hf.get("max_window_layers", n) else "full_attention"
        for i in range(n)]
    return base_config(hf, qk_norm=True, layer_windows=layer_windows(types, window))


ARCHITECTURE = Architecture("Qwen3ForCausalLM", config_from_hf, gguf_archs=("qwen3",),
                            description="Qwen3 dense (q/k norm)")
