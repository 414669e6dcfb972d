"""GraniteForCausalLM (Granite 3 dense): Llama with four scalar multipliers.

From transformers' modeling_granite: embeddings times embedding_multiplier, attention scale
attention_multiplier (not head_dim**-0.5), each block's output times residual_multiplier before
the residual add, logits divided by logits_scaling.
"""
from maxjax.graphs.arch import Architecture, base_config


def config_from_hf(hf: dict):
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            # transformers also puts these biases on o_proj / down_proj, which the decoder lacks.
            raise ValueError(f"Granite with {key}=true is not supported")
    return base_config(
        hf,
        embed_scale=float(hf.get("embedding_multiplier", 1.0)),
        attn_scale=float(hf.get("attention_multiplier", 1.0)),
        residual_scale=float(hf.get("residual_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
    )


def gguf_config(hf: dict, get, tensors) -> None:
    # convert_hf_to_gguf GraniteModel writes the four multipliers; llama.cpp's defaults when
    # absent: 1, and 1/sqrt(head_dim) for the attention scale.
    for key, field in (("embedding_scale", "embedding_multiplier"),
                       ("residual_scale", "residual_multiplier"),
                       ("logit_scale", "logits_scaling")):
        hf[field] = float(get(key, 1.0))
    hf["attention_multiplier"] = float(get("attention.scale", hf["head_dim"] ** -0.5))


ARCHITECTURE = Architecture("GraniteForCausalLM", config_from_hf, gguf_archs=("granite",),
                            gguf_config=gguf_config, gguf_permuted_qk=True,
                            description="Granite 3 dense (embedding/residual/attention/logit "
                                        "multipliers)")
