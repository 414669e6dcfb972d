"""DeepSeek-V3's multi-token prediction (MTP) layer as a draft graph (--speculative-method mtp;
transformers' MtpLayer / MtpModel in modeling_layers.py, generate(..., use_mtp=True)).

The layer predicts token i+2 from the target's final-normed hidden state h_i and the embedding of
token i+1: x = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)]), one full decoder layer (MLA and a
routed MLP: transformers builds it with first_k_dense_replace 0) at rope position i+1, then
shared_head.norm and the target's lm_head. Its latent for entry i is kept in a one-layer pool
indexed by the target's pages (maxjax/engine/mtp.py), so entry i attends to entries 0..i as the
transformers MTP cache does. The checkpoint stores layer k as `model.layers.{num_hidden_layers +
k}.`: enorm, hnorm, eh_proj, shared_head.norm and the decoder layer's usual names (its
shared_head.head and embed_tokens are the target's and are not read).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import decoder, deepseek_v3, quant
from maxjax.graphs import layers as L
from maxjax.graphs.config import ModelConfig

EXTRA = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight",
         "post_norm": "shared_head.norm.weight"}


def with_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """`cfg` with `n` layers: its first n, or its layers and more like its last (an MTP layer
    is routed when the model routes any: transformers builds it so)."""
    def resized(v):
        return (v + v[-1:] * n)[:n] if n > len(v) else v[-n:]
    per_layer = {f.name: resized(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                 if isinstance(getattr(cfg, f.name), tuple)
                 and len(getattr(cfg, f.name)) == cfg.num_layers}
    return dataclasses.replace(cfg, num_layers=n, **per_layer)


def layer_config(cfg: ModelConfig) -> ModelConfig:
    """The MTP decoder layer's config: one layer."""
    return dataclasses.replace(with_layers(cfg, 1), num_mtp_layers=0)


def prefix(cfg: ModelConfig, k: int = 0) -> str:
    return f"model.layers.{cfg.num_layers + k}."


def params_from_hf(cfg: ModelConfig, get, dtype) -> dict:
    """MTP layer 0's params from HF-named tensors `get(name)` (float)."""
    mc, pre = layer_config(cfg), prefix(cfg)

    def get_layer(name):     # the one-layer model's layer 0 is the checkpoint's layer N
        return get(pre + name[len("model.layers.0."):] if name.startswith("model.layers.0.")
                   else name)
    if hasattr(get, "names"):
        get_layer.names = get.names
    layer = deepseek_v3.params_from_hf(mc, get_layer, dtype)["layers"][0]

    def put(x):
        return jax.device_put(np.asarray(x, np.float32).astype(jnp.dtype(dtype)))
    out = {k: put(get(pre + n)) for k, n in EXTRA.items()}
    out["eh_proj"] = put(np.asarray(get(pre + EXTRA["eh_proj"]), np.float32).T)   # [2D, D]
    return {**out, "layer": layer}


def pool_specs(cfg: ModelConfig, num_pages: int, page_size: int, dtype):
    """The MTP layer's latent pool: the target's pool shape with one layer."""
    return decoder.kv_specs(layer_config(cfg), num_pages, page_size, dtype)


def draft_logits(cfg: ModelConfig, params: dict, mtp: dict, kv, step, src, h):
    """float32 logits [S, vocab] of the MTP layer at step.sample_idx, and its updated pool.
    `step`: entry i's token slots (token_ids: t_{i+1}, positions: i, slots: the target's page
    slots of position i); `src` int32[T]: each slot's row in `h` [T', hidden], the target
    step's final-normed hidden states."""
    (pool,) = kv
    eps, mc = cfg.rms_norm_eps, layer_config(cfg)
    e = quant.embed(params["embed"], step.token_ids)
    hs = h[src].astype(e.dtype)
    x = L.linear(jnp.concatenate([L.rms_norm(e, mtp["enorm"], eps),
                                  L.rms_norm(hs, mtp["hnorm"], eps)], axis=-1), mtp["eh_proj"])
    inv = L.rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    rope = L.rope_cos_sin(step.positions + 1, inv, L.rope_attention_factor(cfg.rope_scaling))
    live = step.live_tokens()
    p = mtp["layer"]
    out, pool = deepseek_v3._attention(mc, step, rope, 0, L.rms_norm(x, p["attn_norm"], eps),
                                       pool, p, live)
    x = x + out
    x = x + deepseek_v3._mlp(mc, L.rms_norm(x, p["mlp_norm"], eps), p, live)
    x = L.rms_norm(x, mtp["post_norm"], eps)
    return decoder.lm_logits(cfg, params, x[step.sample_idx]).astype(jnp.float32), (pool,)


def draft_program(cfg: ModelConfig, params, mtp, kv, step, src, h):
    """The compiled MTP step: each sample slot's greedy draft token int32[S], and the pool."""
    logits, kv = draft_logits(cfg, params, mtp, kv, step, src, h)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), kv
