"""Qwen2ForCausalLM (Qwen2, Qwen2.5): Llama with q/k/v biases and an optional sliding window
on the upper layers."""
from maxjax.graphs.arch import Architecture, base_config, qwen_layer_windows


def config_from_hf(hf: dict):
    return base_config(hf, attention_bias=True, attention_out_bias=False,
                       layer_windows=qwen_layer_windows(hf))


ARCHITECTURE = Architecture("Qwen2ForCausalLM", config_from_hf, gguf_archs=("qwen2",),
                            gguf_tokenizer="Qwen2Tokenizer",
                            description="Qwen2, Qwen2.5 (q/k/v bias)")
