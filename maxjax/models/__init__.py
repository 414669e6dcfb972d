"""Model loading: checkpoints (GGUF, HF safetensors) -> config, parameters and tokenizer."""
