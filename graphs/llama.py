"""LlamaForCausalLM (Llama 2/3, SmolLM2): the plain decoder, with Llama-3 rope scaling."""
from maxjax.graphs.arch import Architecture, base_config


def config_from_hf(hf: dict):
    return base_config(hf)


ARCHITECTURE = Architecture("LlamaForCausalLM", config_from_hf, gguf_archs=("llama",),
                            gguf_permuted_qk=True, gguf_tokenizer="TokenizersBackend",
                            description="Llama 2/3, SmolLM2 (rope scaling: llama3, linear)")
