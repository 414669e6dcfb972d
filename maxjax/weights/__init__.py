"""Checkpoint readers: HF directories (safetensors) and GGUF files, into HF-named tensors."""
