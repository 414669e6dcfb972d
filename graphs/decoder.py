"""The decoder-only transformer every built-in architecture runs, as pure functions.

Parameters are one pytree; `params["layers"]` is a list with one dict of arrays per layer and the
layer loop is unrolled. A `lax.scan` over stacked layers compiles faster, but XLA:CPU then copies
each layer's weights out of the stack before every matmul (a dynamic-slice it cannot fuse into a
dot), which triples the memory traffic of a memory-bound decode step. Projections are fused
(q|k|v and gate|up) to give XLA bigger matmuls. Architecture differences are fields of
`ModelConfig`; the architecture files only translate configs and checkpoint names.
"""
from __future__ import annotations

import math

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs.config import ModelConfig
from maxjax.graphs import attention
from maxjax.graphs import layers as L
from maxjax.graphs import lora
from maxjax.graphs import moe
from maxjax.graphs import quant
from maxjax.graphs import sharding
from maxjax.graphs.mrope import mrope_cos_sin
from maxjax.graphs.sharding import ArraySpec
from maxjax.graphs.state import paged_layers, pool_layer, request_state_of, state_of
from maxjax.graphs.step import StepInputs

# (k_pool, v_pool), each [paged layers, pages, kv_heads, page_size, head_dim]; MLA: (latent,);
# a hybrid model's request-state pools after them (graphs/state.py RECURRENT)
KV = tuple


def param_specs(cfg: ModelConfig) -> dict:
    """Every parameter's shape and logical axes (graphs/sharding.py names them); the one place
    the pytree layout is spelled out."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    norm = ArraySpec((D,), ("embed",))
    lay = {"attn_norm": norm, "wqkv": ArraySpec((D, qkv), ("embed", "qkv")),
           "wo": ArraySpec((cfg.q_size, D), ("q_heads", "embed")), "mlp_norm": norm,
           "w_gate_up": ArraySpec((D, 2 * F), ("embed", "gate_up")),
           "w_down": ArraySpec((F, D), ("mlp", "embed"))}
    if cfg.attention_bias:
        lay["bqkv"] = ArraySpec((qkv,), ("qkv",))
    if cfg.attention_out_bias:
        lay["bo"] = ArraySpec((D,), ("embed",))
    if cfg.attention_sinks:
        lay["sinks"] = ArraySpec((cfg.num_heads,), ("heads",))
    if cfg.qk_norm and cfg.qk_norm_full:
        lay["q_norm"] = ArraySpec((cfg.q_size,), ("q_heads",))
        lay["k_norm"] = ArraySpec((cfg.kv_size,), ("kv_heads",))
    elif cfg.qk_norm:
        lay["q_norm"] = lay["k_norm"] = ArraySpec((cfg.head_dim,), ("head_dim",))
    if cfg.post_norms:
        lay["post_attn_norm"] = lay["post_mlp_norm"] = norm
    if not cfg.pre_norms:
        del lay["attn_norm"], lay["mlp_norm"]
    return model_specs(cfg, [moe.layer_specs(cfg, lay) if moe.is_moe(cfg, i) else dict(lay)
                             for i in range(cfg.num_layers)])


def model_specs(cfg: ModelConfig, layers: list) -> dict:
    """The whole pytree's specs around the layers' own: the embedding table, the final norm and
    the LM head (the table itself when the embeddings are tied)."""
    norm = ArraySpec((cfg.hidden_size,), ("embed",))
    table = ArraySpec((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), out_axis=0)
    specs = {"embed": table, "final_norm": norm, "layers": layers}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = table
    return specs


def param_shapes(cfg: ModelConfig) -> dict:
    """The shape of every parameter, from `param_specs`."""
    return sharding.shapes(param_specs(cfg))


def abstract_params(cfg: ModelConfig, dtype) -> dict:
    return sharding.abstract(param_specs(cfg), dtype)


def kv_pool_specs(cfg: ModelConfig, num_pages: int, page_size: int,
                  state_slots: int = 0) -> KV:
    """The KV pool's shapes and logical axes, one spec per pool of the model's state kind
    (graphs/state.py: K and V, or MLA's one latent), then a hybrid model's request-state pools
    of `state_slots` slots (slot 0 scratch)."""
    paged = tuple(ArraySpec((len(paged_layers(cfg)), num_pages, heads, page_size, dim),
                            ("layers", "pages", "kv_heads", "page", "head_dim"))
                  for heads, dim in state_of(cfg).pools(cfg))
    rs = request_state_of(cfg)
    if rs is None:
        return paged
    if state_slots < 2:
        raise ValueError("a hybrid model's pool needs state_slots (the scratch slot and one more)")
    n = sum(cfg.state_layers)
    return paged + tuple(ArraySpec((n, state_slots, *shape),
                                   ("layers", "slots") + ("ssm",) * len(shape))
                         for shape in rs.arrays(cfg))


def kv_pool_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple:
    return kv_pool_specs(cfg, num_pages, page_size, 2)[0].shape


def kv_specs(cfg: ModelConfig, num_pages: int, page_size: int, dtype, state_slots: int = 0,
             state_dtype=None) -> KV:
    """The KV pool's ShapeDtypeStructs (nothing allocated); request-state pools in
    `state_dtype` (default: dtype)."""
    specs = kv_pool_specs(cfg, num_pages, page_size, state_slots)
    n = len(state_of(cfg).pools(cfg))
    return (sharding.abstract(specs[:n], dtype)
            + sharding.abstract(specs[n:], state_dtype or dtype))


def init_kv(cfg: ModelConfig, num_pages: int, page_size: int, dtype, state_slots: int = 0,
            state_dtype=None) -> KV:
    # filled flat: XLA:CPU's 1-D fill runs ~4x faster than its 5-D broadcast (a 2.8 GB pool)
    return tuple(jnp.zeros((math.prod(s.shape),), s.dtype).reshape(s.shape)
                 for s in kv_specs(cfg, num_pages, page_size, dtype, state_slots, state_dtype))


def _layer(cfg: ModelConfig, step: StepInputs, rope, layer: int, h, kv, p):
    h, kv = attention_block(cfg, step, rope, layer, h, kv, p)
    return mlp_block(cfg, h, p, step.live_tokens()), kv


def attention_block(cfg: ModelConfig, step: StepInputs, rope, layer: int, h, kv, p):
    """Layer `layer`'s attention and its residual add: (h, kv) with its K and V written at
    the layer's place among the paged layers (graphs/state.py `pool_layer`)."""
    k_pool, v_pool = kv
    T = h.shape[0]
    eps, plus1 = cfg.rms_norm_eps, cfg.norm_plus_one
    page_size = k_pool.shape[3]
    live = step.live_tokens()
    at = pool_layer(cfg, layer)
    with jax.named_scope("attention"):
        x = L.rms_norm(h, p["attn_norm"], eps, plus1) if cfg.pre_norms else h
        qkv = L.linear(x, p["wqkv"], live=live)
        if "bqkv" in p:
            qkv = qkv + p["bqkv"]
        q, k, v = L.split_fused(qkv, (cfg.q_size, cfg.kv_size, cfg.kv_size), cfg.qkv_shards)
        if cfg.qk_norm_full:
            q = L.rms_norm(q, p["q_norm"], eps, plus1)
            k = L.rms_norm(k, p["k_norm"], eps, plus1)
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        if "q_norm" in p and not cfg.qk_norm_full:
            q = L.rms_norm(q, p["q_norm"], eps, plus1)
            k = L.rms_norm(k, p["k_norm"], eps, plus1)
        cos, sin = rope[1] if cfg.layer_local_rope[layer] else rope[0]
        q, k = L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin)
        k_pool = attention.write_kv(k_pool, at, step, k, page_size)
        v_pool = attention.write_kv(v_pool, at, step, v, page_size)
        scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        attn = attention.attend(q, k_pool, v_pool, at, step, cfg.layer_windows[layer], scale,
                                cfg.attn_logit_softcap, p.get("sinks"))
        out = L.linear(attn.reshape(T, cfg.q_size), p["wo"], live=live)
        if "bo" in p:
            out = out + p["bo"]
        if "post_attn_norm" in p:
            out = L.rms_norm(out, p["post_attn_norm"], eps, plus1)
        h = _residual(cfg, h, out)
    return h, (k_pool, v_pool)


def mlp_block(cfg: ModelConfig, h, p, live):
    """A layer's MLP (dense, or routed where the layer has a router) and its residual add."""
    eps, plus1 = cfg.rms_norm_eps, cfg.norm_plus_one
    with jax.named_scope("mlp"):
        x = L.rms_norm(h, p["mlp_norm"], eps, plus1) if cfg.pre_norms else h
        if "router" in p:
            out = moe.routed_mlp(cfg, x, p, live)
        else:
            out = L.gated_mlp(x, p["w_gate_up"], p["w_down"], cfg.hidden_act,
                              cfg.gate_up_shards, live)
        if "post_mlp_norm" in p:
            out = L.rms_norm(out, p["post_mlp_norm"], eps, plus1)
        return _residual(cfg, h, out)


def _residual(cfg: ModelConfig, h, out):
    if cfg.residual_scale is not None:
        out = out * cfg.residual_scale
    return h + out


def forward(cfg: ModelConfig, params: dict, kv: KV, step: StepInputs):
    """One engine step: returns (float32 logits [R, vocab] at step.sample_idx, updated kv)."""
    h, kv = hidden_states(cfg, params, kv, step)
    return lm_logits(cfg, params, h[step.sample_idx]), kv


def hidden_states(cfg: ModelConfig, params: dict, kv: KV, step: StepInputs):
    """Final-normed hidden states of every token slot [T, hidden], and the updated kv."""
    h = quant.embed(params["embed"], step.token_ids)
    if cfg.embed_scale is not None:
        h = h * jnp.asarray(cfg.embed_scale, jnp.float32).astype(h.dtype)
    if step.embeds is not None:       # image embeddings at their placeholder tokens
        h = jnp.where(step.embed_mask[:, None], step.embeds.astype(h.dtype), h)
    rot_dim = cfg.rotary_dim or cfg.head_dim
    inv_g = L.rope_inv_freq(rot_dim, cfg.rope_theta, cfg.rope_scaling)
    local_theta = cfg.rope_local_theta or cfg.rope_theta
    inv_l = L.rope_inv_freq(rot_dim, local_theta, None)
    if cfg.mrope_section:             # Qwen2.5-VL: images' tokens turn by their grid place
        mrope = mrope_cos_sin(step.rope_positions, inv_g, cfg.mrope_section)
        rope = (mrope, mrope)
    else:
        rope = (L.rope_cos_sin(step.positions, inv_g, L.rope_attention_factor(cfg.rope_scaling)),
                L.rope_cos_sin(step.positions, inv_l))
    adapters = params.get("lora")     # present when the engine serves LoRA (graphs/lora.py)
    if adapters:
        onehot = lora.slot_onehot(step.lora_slot, adapters[0]["wo"]["a"].shape[1], h.dtype)
    for i, p in enumerate(params["layers"]):
        if adapters:
            p = lora.with_adapters(p, adapters[i], onehot)
        with jax.named_scope(f"layer{i}"):
            h, kv = _layer(cfg, step, rope, i, h, kv, p)
    return L.rms_norm(h, params["final_norm"], cfg.rms_norm_eps, cfg.norm_plus_one), kv


def lm_logits(cfg: ModelConfig, params: dict, h):
    """float32 logits [N, vocab] of final hidden states h [N, hidden]."""
    head = params.get("lm_head", params["embed"])
    logits = L.linear(h, head, transposed=True, out_dtype=jnp.float32)
    if cfg.logits_scaling is not None:
        logits = logits / cfg.logits_scaling
    if cfg.final_logit_softcap is not None:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits


# --- checkpoint conversion -------------------------------------------------------------------

def hf_layer_names(post_norms: bool) -> dict:
    """HF tensor names (with {i} for the layer) feeding each stacked parameter, in fusion order."""
    a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    names = {
        "wqkv": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
        "bqkv": [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"],
        "q_norm": [a + "q_norm.weight"], "k_norm": [a + "k_norm.weight"],
        "wo": [a + "o_proj.weight"], "bo": [a + "o_proj.bias"], "sinks": [a + "sinks"],
        "w_gate_up": [m + "gate_proj.weight", m + "up_proj.weight"],
        "w_down": [m + "down_proj.weight"],
        "attn_norm": ["model.layers.{i}.input_layernorm.weight"],
    }
    if post_norms:
        names["post_attn_norm"] = ["model.layers.{i}.post_attention_layernorm.weight"]
        names["mlp_norm"] = ["model.layers.{i}.pre_feedforward_layernorm.weight"]
        names["post_mlp_norm"] = ["model.layers.{i}.post_feedforward_layernorm.weight"]
    else:
        names["mlp_norm"] = ["model.layers.{i}.post_attention_layernorm.weight"]
    return names


def params_from_hf(cfg: ModelConfig, get: Callable[[str], np.ndarray], dtype,
                   progress: Callable[[int], None] | None = None, quantizer=None,
                   moe_names: dict | None = None, shapes: dict | None = None) -> dict:
    """Build the parameter pytree from HF-named tensors. `get(name)` returns a numpy array
    (any float dtype); linear weights are transposed to [in, out] and fused. `quantizer`
    (maxjax/models/quantize.py): the matrices and embedding tables as QuantizedWeights.
    `moe_names`: a routed layer's names (graphs/moe.py keys; {j}: the expert), or any key's
    names over the shared ones; `shapes`: the architecture's param shapes (default: this
    decoder's)."""
    shapes = shapes or param_shapes(cfg)
    names = {**hf_layer_names(cfg.post_norms), **(moe_names or {})}

    def put(x):   # on the host and device_put: jnp.asarray compiles a copy per bf16 shape
        return jax.device_put(np.asarray(x, np.float32).astype(jnp.dtype(dtype)))

    def table(name):
        return quantizer.table(name) if quantizer else put(get(name))

    layers = []
    for i, layer_shapes in enumerate(shapes["layers"]):
        layer = {}
        for key, shape in layer_shapes.items():
            if key in moe.EXPERT_KEYS:     # stacked experts [E, in, out], their biases [E, out]
                layer[key] = moe.stacked_experts(
                    get, [n.format(i=i, j="{j}") for n in names[key]], shape[0], put,
                    quantizer if len(shape) == 3 else None)
                continue
            if quantizer and len(shape) == 2 and key not in moe.FLOAT_MATRICES:
                layer[key] = quantizer.matrix([n.format(i=i) for n in names[key]])
                continue
            parts = [np.asarray(get(n.format(i=i)), np.float32) for n in names[key]]
            if parts[0].ndim == 2:
                parts = [p.T for p in parts]
            layer[key] = put(np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0])
        layers.append(layer)
        if progress:
            progress(1)
    params = {"embed": table("model.embed_tokens.weight"),
              "final_norm": put(get("model.norm.weight")), "layers": layers}
    if "lm_head" in shapes:
        params["lm_head"] = table("lm_head.weight")
    got = jax.tree.map(lambda a: tuple(a.shape), params,
                       is_leaf=lambda a: isinstance(a, quant.QuantizedWeight))
    if got != shapes:
        raise ValueError(f"checkpoint shapes do not match the config: {got} vs {shapes}")
    return params
