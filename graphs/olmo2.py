"""Olmo2ForCausalLM (OLMo 2): no norms before attention and MLP, RMSNorm after each instead
(post_attention_layernorm, post_feedforward_layernorm), and q/k RMSNorm over the whole q and k
projections (all heads at once) before rope (transformers' modeling_olmo2)."""
from maxjax.graphs.arch import POST_NORM_GGUF_NAMES, Architecture, base_config


def config_from_hf(hf: dict):
    if hf.get("attention_bias"):
        # transformers puts a bias on o_proj too, which the shared decoder does not carry.
        raise ValueError("OLMo 2 with attention_bias=true is not supported")
    return base_config(hf, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), qk_norm=True,
                       qk_norm_full=True, pre_norms=False, post_norms=True)


ARCHITECTURE = Architecture("Olmo2ForCausalLM", config_from_hf, gguf_archs=("olmo2",),
                            gguf_layer_names={**POST_NORM_GGUF_NAMES,
                                              "input_layernorm.weight": None},
                            description="OLMo 2 (post-norms, q/k norm over all heads)")
