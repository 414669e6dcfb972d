"""Qwen3NextForCausalLM (Qwen3-Next), and the pieces Qwen3.5 (graphs/qwen3_5.py) shares: a hybrid
of Gated DeltaNet layers (graphs/gated_deltanet.py; a fixed-size state a request, graphs/state.py
RECURRENT) and gated full attention, `layer_types` saying which (by default every
`full_attention_interval`-th layer attends).

transformers' Qwen3NextAttention: q_proj gives each head its query and an output gate (per head
[q | gate], split at load time into `wqkv`'s q and `w_gate`); q and k RMSNormed per head; rope on
the first partial_rotary_factor of each head; the attention output times sigmoid(gate) before
o_proj. Every RMSNorm but the DeltaNet's gated one scales by (1 + w) (GemmaRMSNorm). MLPs:
Qwen2-MoE's routed block (softmax top-k) with a shared expert scaled by sigmoid(x .
shared_expert_gate) on the layers `mlp_only_layers` / `decoder_sparse_step` route, dense ones
elsewhere. The paged K/V pools hold the attention layers only (graphs/state.py `pool_layer`);
the conv and recurrent pools after them hold the DeltaNet layers'. MTP layers are not loaded.
"""
from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import attention, decoder, moe, quant
from maxjax.graphs import layers as L
from maxjax.graphs.arch import Architecture, base_config
from maxjax.graphs.config import ModelConfig
from maxjax.graphs.gated_deltanet import gated_deltanet, layer_specs as gdn_specs
from maxjax.graphs.sharding import ArraySpec
from maxjax.graphs.state import RECURRENT, pool_layer

A, G, M = "model.layers.{i}.self_attn.", "model.layers.{i}.linear_attn.", "model.layers.{i}.mlp."
# A checkpoint's names (graphs/decoder.py params_from_hf); "name:part" is a part of a tensor
# split or reshaped by `_split` below.
NAMES = {"attn_norm": ["model.layers.{i}.input_layernorm.weight"],
         "mlp_norm": ["model.layers.{i}.post_attention_layernorm.weight"],
         "wqkv": [A + "q_proj.weight:q", A + "k_proj.weight", A + "v_proj.weight"],
         "w_gate": [A + "q_proj.weight:gate"],
         "q_norm": [A + "q_norm.weight"], "k_norm": [A + "k_norm.weight"],
         "wo": [A + "o_proj.weight"],
         "w_in": [G + "in_proj_qkvz.weight:q", G + "in_proj_qkvz.weight:k",
                  G + "in_proj_qkvz.weight:v", G + "in_proj_qkvz.weight:z",
                  G + "in_proj_ba.weight:b", G + "in_proj_ba.weight:a"],
         "conv_w": [G + "conv1d.weight:taps"], "A_log": [G + "A_log"],
         "dt_bias": [G + "dt_bias"], "gdn_norm": [G + "norm.weight"],
         "w_out": [G + "out_proj.weight"],
         "router": [M + "gate.weight"],
         "experts_gate_up": [M + "experts.{j}.gate_proj.weight", M + "experts.{j}.up_proj.weight"],
         "experts_down": [M + "experts.{j}.down_proj.weight"],
         "shared_gate_up": [M + "shared_expert.gate_proj.weight",
                            M + "shared_expert.up_proj.weight"],
         "shared_down": [M + "shared_expert.down_proj.weight"],
         "shared_gate": [M + "shared_expert_gate.weight"]}
# Experts stored as stacks [E, out, in] (as transformers 5 holds them) rather than one by one.
FUSED_EXPERTS = {"experts_gate_up": [M + "experts.gate_up_proj:stack"],
                 "experts_down": [M + "experts.down_proj:stack"]}


def hybrid_config(hf: dict, moe_layers: tuple[bool, ...], **overrides) -> ModelConfig:
    """The config Qwen3-Next and Qwen3.5 share; `moe_layers`: which layers are routed."""
    if hf.get("attention_bias"):
        raise ValueError(f"{hf['architectures'][0]} with attention_bias=true is not supported")
    quant_method = (hf.get("quantization_config") or {}).get("quant_method")
    if quant_method:
        raise ValueError(f"config.json quantization_config quant_method {quant_method}: "
                         "quantized weights of this family are not supported (a bf16 "
                         "checkpoint serves)")
    n = int(hf["num_hidden_layers"])
    interval = int(hf.get("full_attention_interval", 4))
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % interval == 0
                                      else "linear_attention" for i in range(n)]
    unknown = set(types) - {"full_attention", "linear_attention"}
    if len(types) != n or unknown:
        raise ValueError(f"layer_types: {n} of full_attention or linear_attention "
                         f"(got {sorted(unknown) or len(types)})")
    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    rp = hf.get("rope_parameters") or {}
    factor = float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    rotary = int(head_dim * factor)
    wrapper = hf.get("multimodal_config") or {}
    tie = hf.get("tie_word_embeddings", wrapper.get("tie_word_embeddings", False))
    experts = int(hf.get("num_experts", 0) or 0)
    routed = dict(moe_layers=moe_layers, num_experts=experts,
                  experts_per_token=int(hf.get("num_experts_per_tok", 10)),
                  expert_intermediate_size=int(hf.get("moe_intermediate_size", 512)),
                  shared_expert_intermediate_size=int(
                      hf.get("shared_expert_intermediate_size", 0) or 0),
                  norm_topk_prob=bool(hf.get("norm_topk_prob", True))) if any(moe_layers) else {}
    fields = dict(
        head_dim=head_dim, qk_norm=True, norm_plus_one=True, tie_word_embeddings=bool(tie),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rotary_dim=rotary if rotary < head_dim else None,
        state_layers=tuple(t == "linear_attention" for t in types),
        ssm_heads=int(hf.get("linear_num_value_heads", 32)),
        ssm_head_dim=int(hf.get("linear_value_head_dim", 128)),
        ssm_groups=int(hf.get("linear_num_key_heads", 16)),
        ssm_state_dim=int(hf.get("linear_key_head_dim", 128)),
        ssm_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)), **routed)
    fields.update(overrides)
    return base_config({**hf, "intermediate_size": hf.get("intermediate_size", 0)}, **fields)


def config_from_hf(hf: dict) -> ModelConfig:
    """A missing field takes transformers' Qwen3NextConfig default."""
    n = int(hf["num_hidden_layers"])
    experts = int(hf.get("num_experts", 512) or 0)
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    routed = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))
    return hybrid_config({**hf, "num_experts": experts}, routed if any(routed) else ())


def param_specs(cfg: ModelConfig) -> dict:
    D, F = cfg.hidden_size, cfg.intermediate_size
    norm = ArraySpec((D,), ("embed",))
    mlp = {"w_gate_up": ArraySpec((D, 2 * F), ("embed", "gate_up")),
           "w_down": ArraySpec((F, D), ("mlp", "embed"))}
    attn = {"wqkv": ArraySpec((D, cfg.q_size + 2 * cfg.kv_size), ("embed", "qkv")),
            "w_gate": ArraySpec((D, cfg.q_size), ("embed", "q_heads")),
            "q_norm": ArraySpec((cfg.head_dim,), ("head_dim",)),
            "k_norm": ArraySpec((cfg.head_dim,), ("head_dim",)),
            "wo": ArraySpec((cfg.q_size, D), ("q_heads", "embed"))}

    def layer(i):
        lay = {"attn_norm": norm, "mlp_norm": norm,
               **(gdn_specs(cfg) if cfg.state_layers[i] else attn), **mlp}
        if not moe.is_moe(cfg, i):
            return lay
        lay = moe.layer_specs(cfg, lay)
        if cfg.shared_expert_intermediate_size:
            lay["shared_gate"] = ArraySpec((D, 1), ("embed", "router"))
        return lay
    return decoder.model_specs(cfg, [layer(i) for i in range(cfg.num_layers)])


def _attention(cfg: ModelConfig, step, rope, at: int, x, k_pool, v_pool, p, live):
    """Gated full attention of x [T, D] at paged layer `at`: (out [T, D], k_pool, v_pool)."""
    T, eps = x.shape[0], cfg.rms_norm_eps
    qkv = L.linear(x, p["wqkv"], live=live)
    q, k, v = L.split_fused(qkv, (cfg.q_size, cfg.kv_size, cfg.kv_size), cfg.qkv_shards)
    q = L.rms_norm(q.reshape(T, cfg.num_heads, cfg.head_dim), p["q_norm"], eps, True)
    k = L.rms_norm(k.reshape(T, cfg.num_kv_heads, cfg.head_dim), p["k_norm"], eps, True)
    v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    cos, sin = rope
    q, k = L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin)
    page_size = k_pool.shape[3]
    k_pool = attention.write_kv(k_pool, at, step, k, page_size)
    v_pool = attention.write_kv(v_pool, at, step, v, page_size)
    out = attention.attend(q, k_pool, v_pool, at, step, 0, cfg.head_dim ** -0.5)
    gate = jax.nn.sigmoid(L.linear(x, p["w_gate"], live=live).astype(jnp.float32))
    out = (out.reshape(T, cfg.q_size).astype(jnp.float32) * gate).astype(x.dtype)
    return L.linear(out, p["wo"], live=live), k_pool, v_pool


def hidden_states(cfg: ModelConfig, params: dict, kv, step):
    """Final-normed hidden states of every token slot [T, hidden], and the updated pools
    (K, V of the attention layers; conv, recurrent of the DeltaNet layers)."""
    k_pool, v_pool, conv_pool, rec_pool = kv
    eps = cfg.rms_norm_eps
    h = quant.embed(params["embed"], step.token_ids)
    inv = L.rope_inv_freq(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    rope = L.rope_cos_sin(step.positions, inv, L.rope_attention_factor(cfg.rope_scaling))
    live = step.live_tokens()
    for i, p in enumerate(params["layers"]):
        at = pool_layer(cfg, i)
        with jax.named_scope(f"layer{i}"):
            x = L.rms_norm(h, p["attn_norm"], eps, True)
            if cfg.state_layers[i]:
                with jax.named_scope("gated_deltanet"):
                    out, conv, rec = gated_deltanet(cfg, step, x, conv_pool[at], rec_pool[at],
                                                    p, live)
                    conv_pool, rec_pool = conv_pool.at[at].set(conv), rec_pool.at[at].set(rec)
            else:
                with jax.named_scope("attention"):
                    out, k_pool, v_pool = _attention(cfg, step, rope, at, x, k_pool, v_pool, p,
                                                     live)
            h = decoder.mlp_block(cfg, h + out, p, live)
    h = L.rms_norm(h, params["final_norm"], eps, True)
    return h, (k_pool, v_pool, conv_pool, rec_pool)


def forward(cfg: ModelConfig, params: dict, kv, step):
    """One engine step: (float32 logits [R, vocab] at step.sample_idx, updated pools)."""
    h, kv = hidden_states(cfg, params, kv, step)
    return decoder.lm_logits(cfg, params, h[step.sample_idx]), kv


# --- checkpoint conversion -------------------------------------------------------------------

def _splitter(cfg: ModelConfig, get):
    """`get` with the "name:part" tensors of NAMES: q_proj's per-head [q | gate] halves,
    Qwen3-Next's in_proj_qkvz / in_proj_ba grouped per key head (each key head's q, k, then its
    value heads' v and z; b then a) taken apart, the conv taps [C, 1, K] as [K, C], expert
    stacks [E, out, in] as [E, in, out]. Every 2-D result is [out, in] as HF's weights are."""
    H, hd = cfg.num_heads, cfg.head_dim
    G, dk = cfg.ssm_groups, cfg.ssm_state_dim
    r, dv = cfg.ssm_heads // max(G, 1), cfg.ssm_head_dim

    def split(name):
        base, _, part = name.partition(":")
        if not part:
            return get(name)
        w = np.asarray(get(base), np.float32)
        if part in ("q", "gate") and "q_proj" in base:
            return w.reshape(H, 2, hd, -1)[:, int(part == "gate")].reshape(H * hd, -1)
        if part == "taps":
            return w[:, 0, :].T
        if part == "stack":
            return w.transpose(0, 2, 1)
        if "in_proj_qkvz" in base:
            w = w.reshape(G, 2 * dk + 2 * r * dv, -1)
            at = {"q": (0, dk), "k": (dk, 2 * dk), "v": (2 * dk, 2 * dk + r * dv),
                  "z": (2 * dk + r * dv, 2 * dk + 2 * r * dv)}[part]
            return w[:, at[0]:at[1]].reshape(-1, w.shape[-1])
        w = w.reshape(G, 2 * r, -1)                                # in_proj_ba
        return (w[:, :r] if part == "b" else w[:, r:]).reshape(-1, w.shape[-1])
    return split


def load_params(cfg: ModelConfig, get, dtype, progress=None, quantizer=None,
                names: dict | None = None) -> dict:
    """graphs/decoder.py params_from_hf with this family's names (`names` over NAMES), the
    tensors split as `_splitter` says; experts one by one or as stacks, as the checkpoint
    holds them."""
    split = _splitter(cfg, get)
    names = {**NAMES, **(names or {})}
    held = get.names() if hasattr(get, "names") else ()
    if any(n.endswith("mlp.experts.gate_up_proj") for n in held):
        names.update(FUSED_EXPERTS)
    if quantizer is not None:          # it reads the split tensors too
        quantizer = copy.copy(quantizer)
        quantizer.get = split
    return decoder.params_from_hf(cfg, split, dtype, progress, quantizer, moe_names=names,
                                  shapes=ARCHITECTURE.param_shapes(cfg))


# --- GGUF (llama.cpp's convert_hf_to_gguf Qwen3NextModel; gguf-py's qwen3next names) --------

def gguf_config(hf: dict, get, tensors) -> None:
    """The DeltaNet's sizes from the ssm.* keys, which layers attend and which route from the
    tensors present (a DeltaNet layer has ssm_a, a routed one ffn_gate_inp)."""
    n = hf["num_hidden_layers"]
    linear = [f"blk.{i}.ssm_a" in tensors for i in range(n)]
    hf["layer_types"] = ["linear_attention" if x else "full_attention" for x in linear]
    attn = [i for i in range(n) if not linear[i]]
    if attn:     # rope.dimension_count is the rotary part; a head is as wide as its k norm
        head_dim = int(tensors[f"blk.{attn[0]}.attn_k_norm.weight"][1][-1])
        hf["head_dim"] = head_dim
        hf["partial_rotary_factor"] = int(get("rope.dimension_count") or head_dim) / head_dim
    value_heads = int(get("ssm.time_step_rank"))
    hf.update(linear_conv_kernel_dim=int(get("ssm.conv_kernel")),
              linear_key_head_dim=int(get("ssm.state_size")),
              linear_num_key_heads=int(get("ssm.group_count")),
              linear_num_value_heads=value_heads,
              linear_value_head_dim=int(get("ssm.inner_size")) // value_heads,
              num_experts=int(get("expert_count", 0)),
              num_experts_per_tok=int(get("expert_used_count", 0)),
              moe_intermediate_size=int(get("expert_feed_forward_length", 0)),
              shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)),
              norm_topk_prob=bool(get("expert_weights_norm", True)),
              mlp_only_layers=[i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
              decoder_sparse_step=1)


def _same(name: str):
    return (name,), lambda read, hf: read(name)


def _qkvz(read, hf):
    """in_proj_qkvz grouped per key head (q, k, v, z of each) from attn_qkv (all q, all k, all
    v) and attn_gate (z)."""
    G, dk = hf["linear_num_key_heads"], hf["linear_key_head_dim"]
    qkv, z = read("attn_qkv.weight"), read("attn_gate.weight")
    D = qkv.shape[-1]
    q, k = qkv[:G * dk].reshape(G, dk, D), qkv[G * dk:2 * G * dk].reshape(G, dk, D)
    v = qkv[2 * G * dk:].reshape(G, -1, D)
    return np.concatenate([q, k, v, z.reshape(G, -1, D)], axis=1).reshape(-1, D)


# llama.cpp stores -exp(A_log), the conv taps [C, K], the routed experts as stacks [E, out, in]
# (gate and up apart), the shared expert's gate as [D]; its norms carry GemmaRMSNorm's +1 but
# the DeltaNet's own gated norm.
GGUF_MOE = {
    "mlp.experts.gate_up_proj": (("ffn_gate_exps.weight", "ffn_up_exps.weight"),
                                 lambda read, hf: np.concatenate(
                                     [read("ffn_gate_exps.weight"), read("ffn_up_exps.weight")],
                                     axis=1)),
    "mlp.shared_expert_gate.weight": (("ffn_gate_inp_shexp.weight",),
                                      lambda read, hf: read("ffn_gate_inp_shexp.weight")
                                      .reshape(1, -1)),
    "linear_attn.A_log": (("ssm_a",), lambda read, hf: np.log(-read("ssm_a"))),
    "linear_attn.conv1d.weight": (("ssm_conv1d.weight",),
                                  lambda read, hf: read("ssm_conv1d.weight")[:, None, :]),
    "linear_attn.dt_bias": _same("ssm_dt.bias"),
    "linear_attn.norm.weight": _same("ssm_norm.weight"),
}
GGUF_TENSORS = GGUF_MOE | {"linear_attn.in_proj_qkvz.weight": (("attn_qkv.weight",), _qkvz)}
GGUF_LAYER_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    **{f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight"
       for p in ("gate", "up", "down")}}


def hybrid_architecture(name: str, config_from_hf, params_from_hf, description: str,
                        **gguf):
    return Architecture(name, config_from_hf, forward=forward, hidden_states=hidden_states,
                        lm_logits=decoder.lm_logits, param_specs=param_specs,
                        params_from_hf=params_from_hf, description=description,
                        request_state=RECURRENT.name, **gguf)


ARCHITECTURE = hybrid_architecture(
    "Qwen3NextForCausalLM", config_from_hf, load_params,
    "Qwen3-Next (Gated DeltaNet + gated attention, a recurrent state a request; routed MLPs "
    "with a gated shared expert)",
    gguf_archs=("qwen3next",), gguf_config=gguf_config, gguf_layer_names=GGUF_LAYER_NAMES,
    gguf_tensors=GGUF_TENSORS, gguf_norm_plus_one=True, gguf_tokenizer="Qwen2Tokenizer")
