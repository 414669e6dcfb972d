"""A toy hybrid architecture, `ToyHybridForCausalLM`, loaded the way `--custom-architectures`
modules are (this file's ARCHITECTURES): the Llama decoder whose layers marked "recurrent" in
config.json's `toy_layers` are a small linear recurrence on graphs/recurrent.py's causal_conv +
scan_rows (a Mamba2-like mixer: a short convolution over x|B|C, a per-head decay, a state of
ssm_state_dim x ssm_head_dim a head) in place of attention. It keeps graphs/state.py RECURRENT
state per request, so the engine's request-state plumbing is tested before the real hybrid
families. `write_toy_hybrid` writes a random checkpoint of it."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import decoder, layers as L, quant, sharding
from maxjax.graphs.arch import Architecture, base_config
from maxjax.graphs.recurrent import causal_conv, scan_rows
from maxjax.graphs.sharding import ArraySpec
from maxjax.graphs.state import RECURRENT, conv_channels, pool_layer

NAME = "ToyHybridForCausalLM"
MIXER = "model.layers.{i}.mixer."
NAMES = {"w_in": [MIXER + "in_proj.weight"], "conv": [MIXER + "conv1d.weight"],
         "w_decay": [MIXER + "decay_proj.weight"], "w_out": [MIXER + "out_proj.weight"]}


def config_from_hf(hf: dict):
    return base_config(hf, state_layers=tuple(t == "recurrent" for t in hf["toy_layers"]),
                       ssm_heads=hf["ssm_heads"], ssm_head_dim=hf["ssm_head_dim"],
                       ssm_groups=hf["ssm_groups"], ssm_state_dim=hf["ssm_state_dim"],
                       ssm_conv_kernel=hf["ssm_conv_kernel"])


def param_specs(cfg) -> dict:
    specs = decoder.param_specs(cfg)
    D, C, H = cfg.hidden_size, conv_channels(cfg), cfg.ssm_heads
    for i, lay in enumerate(specs["layers"]):
        if cfg.state_layers[i]:
            specs["layers"][i] = {
                "attn_norm": lay["attn_norm"], "mlp_norm": lay["mlp_norm"],
                "w_gate_up": lay["w_gate_up"], "w_down": lay["w_down"],
                "w_in": ArraySpec((D, C), ("embed", "ssm")),
                "conv": ArraySpec((C, cfg.ssm_conv_kernel), ("ssm", "ssm")),
                "w_decay": ArraySpec((D, H), ("embed", "ssm")),
                "w_out": ArraySpec((H * cfg.ssm_head_dim, D), ("ssm", "embed"))}
    return specs


def params_from_hf(cfg, get, dtype, progress=None, quantizer=None):
    return decoder.params_from_hf(cfg, get, dtype, progress, quantizer, moe_names=NAMES,
                                  shapes=sharding.shapes(param_specs(cfg)))


def _mixer(cfg, step, at: int, h, conv_pool, rec_pool, p):
    """The recurrent layer's mixer and its residual add; state layer `at`'s pools updated."""
    T = h.shape[0]
    G, N, H, P = cfg.ssm_groups, cfg.ssm_state_dim, cfg.ssm_heads, cfg.ssm_head_dim
    x = L.rms_norm(h, p["attn_norm"], cfg.rms_norm_eps)
    y, conv = causal_conv(L.linear(x, p["w_in"]), p["conv"], None, conv_pool[at], step)
    y = jax.nn.silu(y)
    b = jnp.repeat(y[:, :G * N].reshape(T, G, N), H // G, axis=1)
    c = jnp.repeat(y[:, G * N:2 * G * N].reshape(T, G, N), H // G, axis=1)
    v = y[:, 2 * G * N:].reshape(T, H, P)
    decay = jax.nn.sigmoid(L.linear(x, p["w_decay"]).astype(jnp.float32))

    def update(state, inp):              # state [H, N, P]
        a_t, b_t, c_t, v_t = inp
        state = a_t[:, None, None] * state + b_t[:, :, None] * v_t[:, None, :]
        return state, jnp.einsum("hn,hnp->hp", c_t, state)
    outs, rec = scan_rows(update, (decay, b, c, v), rec_pool[at], step)
    h = h + L.linear(outs.reshape(T, H * P).astype(h.dtype), p["w_out"])
    return h, conv_pool.at[at].set(conv), rec_pool.at[at].set(rec)


def hidden_states(cfg, params, kv, step):
    k_pool, v_pool, conv_pool, rec_pool = kv
    h = quant.embed(params["embed"], step.token_ids)
    inv = L.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    cs = L.rope_cos_sin(step.positions, inv)
    rope = (cs, cs)
    for i, p in enumerate(params["layers"]):
        if cfg.state_layers[i]:
            h, conv_pool, rec_pool = _mixer(cfg, step, pool_layer(cfg, i), h, conv_pool,
                                            rec_pool, p)
            x = L.rms_norm(h, p["mlp_norm"], cfg.rms_norm_eps)
            h = h + L.gated_mlp(x, p["w_gate_up"], p["w_down"], cfg.hidden_act)
        else:       # the attention layers come first: their pool index is their own
            assert pool_layer(cfg, i) == i
            h, (k_pool, v_pool) = decoder._layer(cfg, step, rope, i, h, (k_pool, v_pool), p)
    h = L.rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    return h, (k_pool, v_pool, conv_pool, rec_pool)


def forward(cfg, params, kv, step):
    h, kv = hidden_states(cfg, params, kv, step)
    return decoder.lm_logits(cfg, params, h[step.sample_idx]), kv


ARCHITECTURES = [Architecture(NAME, config_from_hf, forward=forward, hidden_states=hidden_states,
                              param_specs=param_specs, params_from_hf=params_from_hf,
                              description="a toy hybrid (tests/toy_hybrid.py)",
                              request_state=RECURRENT.name)]

# attention first, then two recurrent layers
LAYER_TYPES = ["attention", "recurrent", "recurrent"]
SSM = dict(ssm_heads=4, ssm_head_dim=8, ssm_groups=2, ssm_state_dim=8, ssm_conv_kernel=4)


def write_toy_hybrid(path, vocab_size: int = 256) -> str:
    """A random ToyHybridForCausalLM checkpoint (config.json, safetensors, word tokenizer)."""
    from safetensors.numpy import save_file
    from tiny_llama import write_word_tokenizer
    os.makedirs(path, exist_ok=True)
    V, D, I, NH, KV, HD = vocab_size, 64, 128, 4, 2, 16
    H, P, G, N, K = (SSM[k] for k in ("ssm_heads", "ssm_head_dim", "ssm_groups",
                                      "ssm_state_dim", "ssm_conv_kernel"))
    C = 2 * G * N + H * P
    cfg = {"architectures": [NAME], "model_type": "toy_hybrid", "vocab_size": V,
           "hidden_size": D, "intermediate_size": I, "num_hidden_layers": len(LAYER_TYPES),
           "num_attention_heads": NH, "num_key_value_heads": KV, "head_dim": HD,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
           "hidden_act": "silu", "torch_dtype": "float32", "toy_layers": LAYER_TYPES, **SSM}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    rng = np.random.default_rng(0)

    def w(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    t = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": np.ones(D, np.float32)}
    for i, kind in enumerate(LAYER_TYPES):
        p = f"model.layers.{i}."
        t.update({p + "mlp.gate_proj.weight": w(I, D), p + "mlp.up_proj.weight": w(I, D),
                  p + "mlp.down_proj.weight": w(D, I),
                  p + "input_layernorm.weight": np.ones(D, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(D, np.float32)})
        if kind == "attention":
            a = p + "self_attn."
            t.update({a + "q_proj.weight": w(NH * HD, D), a + "k_proj.weight": w(KV * HD, D),
                      a + "v_proj.weight": w(KV * HD, D), a + "o_proj.weight": w(D, NH * HD)})
        else:     # stored as the fusion transposes them: [out, in]; the conv as [K, C]
            m = MIXER.format(i=i)
            t.update({m + "in_proj.weight": w(C, D), m + "conv1d.weight": w(K, C, scale=0.5),
                      m + "decay_proj.weight": w(H, D), m + "out_proj.weight": w(D, H * P)})
    save_file(t, os.path.join(path, "model.safetensors"))
    write_word_tokenizer(path, V)
    return str(path)


def register() -> str:
    """Register the toy as a custom architecture (as --custom-architectures does), once; returns
    this file's path, what --custom-architectures takes."""
    from maxjax.models import registry
    if NAME not in registry.architectures():
        registry.register_custom(__file__)
    return __file__
