"""Qwen2ForCausalLM (Qwen2, Qwen2.5): Llama with q/k/v biases and an optional sliding window
on the upper layers."""
from maxjax.graphs.arch import Architecture, base_config, layer_windows


def config_from_hf(hf: dict):
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    # transformers' default when the config.json predates `layer_types`.
    types = hf.get("layer_types") or [
        "sliding_attention" if window and i >= hf.get("max_window_layers", n) else "full_attention"
        for i in range(n)]
    return base_config(hf, attention_bias=True, layer_windows=layer_windows(types, window))


ARCHITECTURE = Architecture("Qwen2ForCausalLM", config_from_hf, gguf_archs=("qwen2",),
                            description="Qwen2, Qwen2.5 (q/k/v bias)")
