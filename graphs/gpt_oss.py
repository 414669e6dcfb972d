"""GptOssForCausalLM (gpt-oss): every MLP routed (graphs/moe.py), with what no other family has.

transformers' GptOssDecoderLayer: attention with q/k/v/o biases and attention sinks (a learned
logit per head in the softmax's denominator: graphs/attention.py, so only a backend that
`takes_sinks` runs it), sliding-window and full layers alternating (`layer_types`), YaRN rope;
a router with a bias whose top k logits are softmaxed (`norm_topk_prob`: the same weights), and
experts with biases through the clamped SwiGLU (graphs/layers.py `glu`). The experts are stored
stacked, [E, D, 2F] with gate and up interleaved (gate the even columns, up the odd): they load
as moe.py's [gate | up]. MXFP4 checkpoints (the released ones: `*_blocks` / `*_scales` expert
tensors) are refused; a bf16 one serves.
"""
from __future__ import annotations

import numpy as np

from maxjax.errors import UserError
from maxjax.graphs import decoder
from maxjax.graphs.arch import Architecture, base_config, layer_windows

M = "model.layers.{i}.mlp."
MOE_NAMES = {"router": [M + "router.weight"], "router_bias": [M + "router.bias"],
             "experts_gate_up": [M + "experts.gate_up_proj"],
             "experts_gate_up_bias": [M + "experts.gate_up_proj_bias"],
             "experts_down": [M + "experts.down_proj"],
             "experts_down_bias": [M + "experts.down_proj_bias"]}
INTERLEAVED = ("experts.gate_up_proj", "experts.gate_up_proj_bias")
MXFP4 = "MXFP4 weights are not supported yet (a bf16 gpt-oss checkpoint serves)"


def config_from_hf(hf: dict):
    """A missing field takes transformers' GptOssConfig default."""
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if quant == "mxfp4":
        raise ValueError(f"config.json quantization_config quant_method mxfp4: {MXFP4}")
    if quant:
        raise ValueError(f"quantization_config quant_method {quant!r} is not supported")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(n)]
    return base_config(hf, head_dim=int(hf.get("head_dim") or 64),
                       rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                       attention_bias=bool(hf.get("attention_bias", True)),
                       attention_out_bias=bool(hf.get("attention_bias", True)),
                       attention_sinks=True,
                       layer_windows=layer_windows(types, hf.get("sliding_window", 128)),
                       moe_layers=(True,) * n, num_experts=int(hf.get("num_local_experts", 128)),
                       experts_per_token=int(hf.get("num_experts_per_tok", 4)),
                       expert_intermediate_size=int(hf["intermediate_size"]),
                       norm_topk_prob=True, moe_bias=True,
                       clamped_swiglu=(float(hf.get("swiglu_alpha", 1.702)),
                                       float(hf.get("swiglu_limit", 7.0))))


def params_from_hf(cfg, get, dtype, progress=None, quantizer=None):
    """decoder.params_from_hf with gpt-oss's names; gate|up de-interleaved as they load."""
    names = get.names() if hasattr(get, "names") else []
    blocks = next((n for n in names if n.endswith(("_blocks", "_scales"))), None)
    if blocks:
        raise UserError(f"checkpoint tensor {blocks}: {MXFP4}")

    def deinterleaved(name):
        w = get(name)
        if name.endswith(INTERLEAVED):
            return np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1)
        return w
    return decoder.params_from_hf(cfg, deinterleaved, dtype, progress, quantizer,
                                  moe_names=MOE_NAMES)


ARCHITECTURE = Architecture("GptOssForCausalLM", config_from_hf, params_from_hf=params_from_hf,
                            description="gpt-oss mixture of experts (attention sinks, YaRN; "
                                        "bf16 weights, not MXFP4)")
