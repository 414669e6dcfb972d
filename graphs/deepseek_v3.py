"""DeepseekV3ForCausalLM (DeepSeek-V3, and Kimi-K2's config, which names this architecture):
multi-head latent attention (MLA) with the latent kept in pages, and routed MLPs with a shared
expert after `first_k_dense_replace` dense layers.

transformers' DeepseekV3Attention: q is x -> q_a_proj -> RMSNorm -> q_b_proj (or one q_proj when
q_lora_rank is None), per head qk_nope_head_dim dims without rope and qk_rope_head_dim with;
kv_a_proj_with_mqa gives a latent c (kv_lora_rank, RMSNormed) and one roped key k_pe shared by
every head; kv_b_proj expands c into each head's k_nope and v. Here the pool keeps only
[c | k_pe] a token a layer (graphs/state.py LATENT) and attention never expands it: with
kv_b_proj's per-head blocks W_uk [nope, r] and W_uv [v, r],
  q_nope . k_nope = (W_uk^T q_nope) . c        the query folded into the latent space,
  sum_j p_j v_j   = W_uv (sum_j p_j c_j)        the output taken out of it,
so the scores are those of the query [W_uk^T q_nope | q_pe] against the latent [c | k_pe] as one
KV head of kv_lora_rank + qk_rope_head_dim dims (graphs/attention.py, any backend), and the
values are the latent's first kv_lora_rank dims. The softmax scale is qk_head_dim^-0.5 times
YaRN's mscale(factor, mscale_all_dim) squared (transformers' yarn_apply_mscale); with
`rope_interleave` the rope dims are pairs (x0, x1), (x2, x3) ..., the same rotation as the
rotate-half one on (x0, x2, ... | x1, x3, ...), which is what is stored.

Routing is graphs/moe.py `route_grouped` (sigmoid, group-limited top-k, correction bias, routed
scaling factor); every routed layer adds its shared expert's MLP (moe_intermediate_size x
n_shared_experts wide). The MTP layers (num_nextn_predict_layers, stored as the layers after
the last) draft for --speculative-method mtp: graphs/mtp.py.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import attention, decoder, moe, quant
from maxjax.graphs import layers as L
from maxjax.graphs.arch import Architecture, base_config, rope_params
from maxjax.graphs.config import ModelConfig
from maxjax.graphs.sharding import ArraySpec
from maxjax.graphs.state import LATENT

A, M = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
NAMES = {"attn_norm": ["model.layers.{i}.input_layernorm.weight"],
         "mlp_norm": ["model.layers.{i}.post_attention_layernorm.weight"],
         "wq": [A + "q_proj.weight"], "wq_a": [A + "q_a_proj.weight"],
         "q_a_norm": [A + "q_a_layernorm.weight"], "wq_b": [A + "q_b_proj.weight"],
         "wkv_a": [A + "kv_a_proj_with_mqa.weight"], "kv_a_norm": [A + "kv_a_layernorm.weight"],
         "w_uk": [A + "kv_b_proj.weight:uk"], "w_uv": [A + "kv_b_proj.weight:uv"],
         "wo": [A + "o_proj.weight"],
         "router": [M + "gate.weight"], "router_correction": [M + "gate.e_score_correction_bias"],
         "experts_gate_up": [M + "experts.{j}.gate_proj.weight", M + "experts.{j}.up_proj.weight"],
         "experts_down": [M + "experts.{j}.down_proj.weight"],
         "shared_gate_up": [M + "shared_experts.gate_proj.weight",
                            M + "shared_experts.up_proj.weight"],
         "shared_down": [M + "shared_experts.down_proj.weight"]}


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def config_from_hf(hf: dict) -> ModelConfig:
    """A missing field takes transformers' DeepseekV3Config default."""
    quant_method = (hf.get("quantization_config") or {}).get("quant_method")
    if quant_method:
        raise ValueError(f"config.json quantization_config quant_method {quant_method}: "
                         "quantized DeepSeek-V3 weights are not supported (a bf16 checkpoint "
                         "serves)")
    if hf.get("attention_bias"):
        raise ValueError("DeepSeek-V3 with attention_bias=true is not supported")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"scoring_func {hf['scoring_func']!r} is not supported (sigmoid)")
    heads = int(hf.get("num_attention_heads", 128))   # num_key_value_heads: MLA has its latent
    nope, rope = int(hf.get("qk_nope_head_dim", 128)), int(hf.get("qk_rope_head_dim", 64))
    rank = int(hf.get("kv_lora_rank", 512))
    routing = moe.grouped_routing_config(
        hf, experts=int(hf.get("num_local_experts", 256) or 0), first_dense=3, expert_f=2048,
        scaling=2.5)
    scale = (nope + rope) ** -0.5
    _, scaling = rope_params(hf)
    raw = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if scaling is not None and raw.get("mscale_all_dim"):
        scale *= _mscale(float(raw["factor"]), float(raw["mscale_all_dim"])) ** 2
    return base_config(
        {**hf, "num_attention_heads": heads, "intermediate_size": hf.get("intermediate_size",
                                                                         18432)},
        num_kv_heads=1, head_dim=rank + rope, attn_scale=scale, paged_state=LATENT.name,
        attention_bias=False, attention_out_bias=False,
        q_lora_rank=int(hf.get("q_lora_rank", 1536) or 0), kv_lora_rank=rank,
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(hf.get("v_head_dim", 128)),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        num_mtp_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0),
        **routing)


def param_specs(cfg: ModelConfig) -> dict:
    D, H, F = cfg.hidden_size, cfg.num_heads, cfg.intermediate_size
    r, qk = cfg.kv_lora_rank, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    norm = ArraySpec((D,), ("embed",))
    lay = {"attn_norm": norm, "mlp_norm": norm,
           "wkv_a": ArraySpec((D, r + cfg.qk_rope_head_dim), ("embed", "head_dim")),
           "kv_a_norm": ArraySpec((r,), ("head_dim",)),
           "w_uk": ArraySpec((H * cfg.qk_nope_head_dim, r), ("heads", "head_dim")),
           "w_uv": ArraySpec((r, H * cfg.v_head_dim), ("head_dim", "heads")),
           "wo": ArraySpec((H * cfg.v_head_dim, D), ("heads", "embed")),
           "w_gate_up": ArraySpec((D, 2 * F), ("embed", "gate_up")),
           "w_down": ArraySpec((F, D), ("mlp", "embed"))}
    if cfg.q_lora_rank:
        lay["wq_a"] = ArraySpec((D, cfg.q_lora_rank), ("embed", "head_dim"))
        lay["q_a_norm"] = ArraySpec((cfg.q_lora_rank,), ("head_dim",))
        lay["wq_b"] = ArraySpec((cfg.q_lora_rank, H * qk), ("head_dim", "heads"))
    else:
        lay["wq"] = ArraySpec((D, H * qk), ("embed", "heads"))

    def layer(i):
        if not moe.is_moe(cfg, i):
            return dict(lay)
        return moe.layer_specs(cfg, lay)
    return decoder.model_specs(cfg, [layer(i) for i in range(cfg.num_layers)])


def _deinterleaved(x):
    """Rope pairs (x0, x1), (x2, x3) ... as the rotate-half layout (x0, x2, ... | x1, x3, ...)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _attention(cfg: ModelConfig, step, rope, layer: int, x, pool, p, live):
    """MLA of x [T, D] over the paged latent, the step's latents written first -> [T, D]."""
    T, H, eps = x.shape[0], cfg.num_heads, cfg.rms_norm_eps
    nope, rd, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if "wq_a" in p:
        q = L.linear(L.rms_norm(L.linear(x, p["wq_a"], live=live), p["q_a_norm"], eps),
                     p["wq_b"], live=live)
    else:
        q = L.linear(x, p["wq"], live=live)
    q = q.reshape(T, H, nope + rd)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    kv = L.linear(x, p["wkv_a"], live=live)
    c = L.rms_norm(kv[:, :r], p["kv_a_norm"], eps)
    k_pe = kv[:, None, r:]
    if cfg.rope_interleave:
        q_pe, k_pe = _deinterleaved(q_pe), _deinterleaved(k_pe)
    cos, sin = rope
    q_pe, k_pe = L.apply_rope(q_pe, cos, sin), L.apply_rope(k_pe, cos, sin)
    latent = jnp.concatenate([c[:, None, :], k_pe.astype(c.dtype)], axis=-1)    # [T, 1, r+rd]
    pool = attention.write_kv(pool, layer, step, latent.astype(pool.dtype), pool.shape[3])
    w_uk = p["w_uk"].reshape(H, nope, r)
    q_lat = jnp.einsum("thn,hnr->thr", q_nope, w_uk.astype(q_nope.dtype))
    query = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1)      # [T, H, r+rd]
    out = attention.attend(query, pool, pool, layer, step, 0, cfg.attn_scale)[..., :r]
    w_uv = p["w_uv"].reshape(r, H, cfg.v_head_dim)
    o = jnp.einsum("thr,rhv->thv", out, w_uv.astype(out.dtype)).reshape(T, -1)
    return L.linear(o, p["wo"], live=live), pool


def _mlp(cfg: ModelConfig, x, p, live):
    if "router" not in p:
        return L.gated_mlp(x, p["w_gate_up"], p["w_down"], cfg.hidden_act, cfg.gate_up_shards,
                           live)
    return moe.routed_mlp(cfg, x, p, live)


def hidden_states(cfg: ModelConfig, params: dict, kv, step):
    """Final-normed hidden states of every token slot [T, hidden], and the updated pool."""
    (pool,) = kv
    eps = cfg.rms_norm_eps
    h = quant.embed(params["embed"], step.token_ids)
    inv = L.rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    rope = L.rope_cos_sin(step.positions, inv, L.rope_attention_factor(cfg.rope_scaling))
    live = step.live_tokens()
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            with jax.named_scope("attention"):
                out, pool = _attention(cfg, step, rope, i, L.rms_norm(h, p["attn_norm"], eps),
                                       pool, p, live)
                h = h + out
            with jax.named_scope("mlp"):
                h = h + _mlp(cfg, L.rms_norm(h, p["mlp_norm"], eps), p, live)
    return L.rms_norm(h, params["final_norm"], eps), (pool,)


def forward(cfg: ModelConfig, params: dict, kv, step):
    """One engine step: (float32 logits [R, vocab] at step.sample_idx, updated pool)."""
    h, kv = hidden_states(cfg, params, kv, step)
    return decoder.lm_logits(cfg, params, h[step.sample_idx]), kv


def params_from_hf(cfg: ModelConfig, get, dtype, progress=None, quantizer=None) -> dict:
    """graphs/decoder.py params_from_hf with DeepSeek's names; kv_b_proj [H*(nope+v), r] split
    per head into W_uk (stored [H*nope, r]) and W_uv (stored [r, H*v])."""
    H, nope, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim

    def split(name):
        base, _, part = name.partition(":")
        if not part:
            return get(name)
        w = np.asarray(get(base), np.float32).reshape(H, nope + v, -1)
        if part == "uk":      # returned [out, in] as every HF weight: transposed on loading
            return w[:, :nope].reshape(H * nope, -1).T
        return w[:, nope:].reshape(H * v, -1)
    if hasattr(get, "names"):
        split.names = get.names
    return decoder.params_from_hf(cfg, split, dtype, progress, quantizer, moe_names=NAMES,
                                  shapes=ARCHITECTURE.param_shapes(cfg))


ARCHITECTURE = Architecture(
    "DeepseekV3ForCausalLM", config_from_hf, forward=forward, hidden_states=hidden_states,
    lm_logits=decoder.lm_logits, param_specs=param_specs, params_from_hf=params_from_hf,
    state=LATENT.name,
    description="DeepSeek-V3, Kimi-K2 (MLA with the latent in pages; sigmoid group-limited "
                "routing with shared experts; bf16 weights, not FP8)")
