"""GraniteMoeHybridForCausalLM (Granite 4): Mamba2 layers interleaved with attention layers,
each followed by a routed MLP plus a shared MLP (the shared MLP alone when num_local_experts is
0), with Granite 3's four multipliers (graphs/granite.py).

From transformers' modeling_granitemoehybrid (its torch path): a Mamba2 layer ("mamba" or
"linear_attention" in layer_types) projects x to gate | x B C | dt; x B C goes through a
depthwise causal convolution (with bias) and the activation; per head h of group
g = h // (heads / groups), with dt = softplus(dt + dt_bias) and A = -exp(A_log),
  state_h = exp(dt A) state_h + dt B_g x_h^T      (here [state, head_dim] a head: graphs/state.py)
  y_h     = C_g . state_h + D_h x_h
then y * silu(gate) is RMS-normed in `groups` groups (norm after the gate) and projected out.
The conv window and state live in the request-state pools (graphs/recurrent.py); decode runs
the recurrence a token at a time, a prefill bucket in chunks (`chunk_ssd`, SSD's quadratic form
in a chunk, the state carried between chunks). Attention
layers are the decoder's, their K/V at their place among the attention layers; rope only where
position_embedding_type is "rope" (otherwise none: `rotary_dim` 0). Routing is a softmax over
the top k router logits (graphs/moe.py `route` renormalised).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import decoder, quant, recurrent, sharding
from maxjax.graphs import layers as L
from maxjax.graphs.arch import Architecture, base_config
from maxjax.graphs.config import ModelConfig
from maxjax.graphs.recurrent import causal_conv, scan_rows
from maxjax.graphs.sharding import ArraySpec
from maxjax.graphs.state import RECURRENT, conv_channels, pool_layer, state_of

S, B = "model.layers.{i}.mamba.", "model.layers.{i}.block_sparse_moe."
NAMES = {"w_in": [S + "in_proj.weight"], "conv_w": [S + "conv1d.weight:squeeze"],
         "conv_bias": [S + "conv1d.bias"], "dt_bias": [S + "dt_bias"],
         "A_log": [S + "A_log"], "D": [S + "D"], "ssm_norm": [S + "norm.weight"],
         "w_out": [S + "out_proj.weight"],
         "router": [B + "router.layer.weight"],
         "experts_gate_up": [B + "input_linear.weight:T"],
         "experts_down": [B + "output_linear.weight:T"],
         "shared_gate_up": ["model.layers.{i}.shared_mlp.input_linear.weight"],
         "shared_down": ["model.layers.{i}.shared_mlp.output_linear.weight"],
         "w_gate_up": ["model.layers.{i}.shared_mlp.input_linear.weight"],
         "w_down": ["model.layers.{i}.shared_mlp.output_linear.weight"]}
STATE_TYPES = ("mamba", "linear_attention")
ATTENTION_KEYS = ("wqkv", "bqkv", "wo", "bo")


def _float(v) -> float:
    return float(v["__float__"]) if isinstance(v, dict) else float(v)


def config_from_hf(hf: dict) -> ModelConfig:
    """A missing field takes transformers' GraniteMoeHybridConfig default."""
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * n
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    if hf.get("mamba_proj_bias"):
        raise ValueError("Granite 4 with mamba_proj_bias=true is not supported")
    if not hf.get("mamba_conv_bias", True):
        raise ValueError("Granite 4 with mamba_conv_bias=false is not supported")
    limit = tuple(_float(v) for v in (hf.get("time_step_limit") or (0.0, math.inf)))
    if limit != (0.0, math.inf):
        # transformers clamps dt to it in its chunked prefill only, not when it decodes
        raise ValueError(f"time_step_limit {list(limit)} is not supported (0, inf)")
    if hf.get("position_embedding_type") not in (None, "rope"):
        raise ValueError(f"position_embedding_type {hf['position_embedding_type']!r}: "
                         "rope or none")
    D, heads = int(hf["hidden_size"]), int(hf.get("mamba_n_heads", 128))
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = int(hf.get("mamba_expand", 2)) * D // heads if head_dim == "auto" else int(head_dim)
    experts = int(hf.get("num_local_experts", 8) or 0)
    shared = int(hf.get("shared_intermediate_size", 1024))
    routed = dict(moe_layers=(True,) * n, num_experts=experts,
                  experts_per_token=int(hf.get("num_experts_per_tok", 2)),
                  expert_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
                  shared_expert_intermediate_size=shared) if experts else {}
    return base_config(
        {**hf, "intermediate_size": shared, "bos_token_id": hf.get("bos_token_id", 1),
         "eos_token_id": hf.get("eos_token_id", 2)},
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rotary_dim=None if hf.get("position_embedding_type") == "rope" else 0,
        embed_scale=float(hf.get("embedding_multiplier", 1.0)),
        attn_scale=float(hf.get("attention_multiplier", 1.0)),
        residual_scale=float(hf.get("residual_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
        state_layers=tuple(t in STATE_TYPES for t in types), ssm_heads=heads,
        ssm_head_dim=head_dim, ssm_groups=int(hf.get("mamba_n_groups", 1)),
        ssm_state_dim=int(hf.get("mamba_d_state", 256)),
        ssm_conv_kernel=int(hf.get("mamba_d_conv", 4)), **routed)


def param_specs(cfg: ModelConfig) -> dict:
    """The decoder's, with a Mamba2 mixer in place of attention in the state layers."""
    specs = decoder.param_specs(cfg)
    D, H, inner = cfg.hidden_size, cfg.ssm_heads, cfg.ssm_heads * cfg.ssm_head_dim
    C, heads = conv_channels(cfg), ArraySpec((H,), ("ssm",))
    mixer = {"w_in": ArraySpec((D, inner + C + H), ("embed", "ssm")),
             "conv_w": ArraySpec((C, cfg.ssm_conv_kernel), ("ssm", "ssm")),
             "conv_bias": ArraySpec((C,), ("ssm",)), "dt_bias": heads, "A_log": heads,
             "D": heads, "ssm_norm": ArraySpec((inner,), ("ssm",)),
             "w_out": ArraySpec((inner, D), ("ssm", "embed"))}
    for i, lay in enumerate(specs["layers"]):
        if cfg.state_layers[i]:
            specs["layers"][i] = {**{k: v for k, v in lay.items() if k not in ATTENTION_KEYS},
                                  **mixer}
    return specs


CHUNK = 64


def ssd_step(state, inp):
    """One token of every head: state [heads, state_dim, head_dim] float32; inp (x [heads,
    head_dim], B, C [heads, state_dim], decay exp(dt A) and dt [heads]) -> (state, y)."""
    x_t, b_t, c_t, decay_t, dt_t = inp
    state = decay_t[:, None, None] * state + (dt_t[:, None] * b_t)[:, :, None] * x_t[:, None, :]
    return state, jnp.einsum("hn,hnp->hp", c_t, state)


def chunk_ssd(xs, b, c, log_decay, dt, pool, step, size: int = CHUNK):
    """The Mamba2 recurrence over a prefill step in chunks: in a chunk, with ac the cumulative
    log decay from its start and G[i, j] = exp(ac_i - ac_j) for j <= i, from its initial state S
      y = ((C B^T) * G * dt_j) x + exp(ac) C S,   S <- exp(ac_C) S + (exp(ac_C - ac) dt B)^T x.
    xs [T, heads, head_dim], b, c [T, heads, state_dim], log_decay, dt [T, heads] -> (y [T,
    heads, head_dim], the updated pool)."""
    lay = recurrent.chunk_layout(step, size)
    xs, b, c, ac, dt = (jnp.swapaxes(recurrent.to_chunks(lay, a), 1, 2)      # [N, H, C, ...]
                        for a in (xs, b, c, log_decay, dt))
    ac = jnp.cumsum(ac, axis=-1)
    below = jnp.tril(jnp.ones((size, size), bool))
    gap = jnp.exp(jnp.where(below, ac[..., :, None] - ac[..., None, :], -jnp.inf))
    scores = jnp.einsum("zhin,zhjn->zhij", c, b) * gap * dt[..., None, :]
    inner = jnp.einsum("nhij,nhjp->nhip", scores, xs)
    cg = c * jnp.exp(ac)[..., None]
    bd = b * (dt * jnp.exp(ac[..., -1:] - ac))[..., None]
    total = jnp.exp(ac[..., -1])

    def update(state, inp):                                   # state [H, state_dim, head_dim]
        inner, cg, bd, x, total = inp
        y = inner + jnp.einsum("hcn,hnp->hcp", cg, state)
        state = total[:, None, None] * state + jnp.einsum("hcn,hcp->hnp", bd, x)
        return state, jnp.swapaxes(y, 0, 1)

    return recurrent.scan_chunks(update, (inner, cg, bd, xs, total), pool, lay)


def mamba2(cfg: ModelConfig, step, x, conv_pool, ssm_pool, p, live):
    """The Mamba2 mixer of x [T, D] -> ([T, D], conv_pool, ssm_pool), the pools one layer's
    [slots, ...] (graphs/state.py RECURRENT)."""
    T = x.shape[0]
    H, P, G, N = cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_groups, cfg.ssm_state_dim
    inner = H * P
    proj = L.linear(x, p["w_in"], live=live)
    gate, xbc, dt = jnp.split(proj, [inner, inner + conv_channels(cfg)], axis=-1)
    xbc, conv_pool = causal_conv(xbc, p["conv_w"], p["conv_bias"], conv_pool, step)
    xbc = L.activation(cfg.hidden_act)(xbc)
    xs, b, c = jnp.split(xbc, [inner, inner + G * N], axis=-1)
    xs = xs.reshape(T, H, P)
    b = jnp.repeat(b.reshape(T, G, N), H // G, axis=1)              # [T, H, N] a head's group
    c = jnp.repeat(c.reshape(T, G, N), H // G, axis=1)
    dt = jax.nn.softplus(dt.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
    log_decay = dt * -jnp.exp(p["A_log"].astype(jnp.float32))        # [T, H]
    y, ssm_pool = recurrent.token_or_chunks(
        step, CHUNK, lambda: chunk_ssd(xs, b, c, log_decay, dt, ssm_pool, step),
        lambda: scan_rows(ssd_step, (xs, b, c, jnp.exp(log_decay), dt), ssm_pool, step))
    y = (y + p["D"].astype(jnp.float32)[:, None] * xs).reshape(T, inner)
    y = y * jax.nn.silu(gate.astype(jnp.float32))
    y = L.rms_norm(y.reshape(T, G, inner // G), jnp.ones((inner // G,), jnp.float32),
                   cfg.rms_norm_eps).reshape(T, inner) * p["ssm_norm"].astype(jnp.float32)
    return L.linear(y.astype(x.dtype), p["w_out"], live=live), conv_pool, ssm_pool


def _rope(cfg: ModelConfig, positions):
    """The decoder's (cos, sin) for every layer; none (no dims) at rotary_dim 0."""
    if cfg.rotary_dim == 0:
        none = jnp.zeros((positions.shape[0], 0), jnp.float32)
        return (none, none), (none, none)
    inv = L.rope_inv_freq(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    cs = L.rope_cos_sin(positions, inv, L.rope_attention_factor(cfg.rope_scaling))
    return cs, cs


def hidden_states(cfg: ModelConfig, params: dict, kv, step):
    """Final-normed hidden states of every token slot [T, hidden], and the updated pools."""
    n = len(state_of(cfg).pools(cfg))
    paged, (conv, ssm) = kv[:n], kv[n:]
    eps, live = cfg.rms_norm_eps, step.live_tokens()
    h = quant.embed(params["embed"], step.token_ids)
    h = h * jnp.asarray(cfg.embed_scale, jnp.float32).astype(h.dtype)
    rope = _rope(cfg, step.positions)
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            if not cfg.state_layers[i]:
                h, paged = decoder.attention_block(cfg, step, rope, i, h, paged, p)
            else:
                with jax.named_scope("mamba"):
                    j = pool_layer(cfg, i)
                    out, cj, sj = mamba2(cfg, step, L.rms_norm(h, p["attn_norm"], eps),
                                         conv[j], ssm[j], p, live)
                    conv, ssm = conv.at[j].set(cj), ssm.at[j].set(sj)
                    h = decoder._residual(cfg, h, out)
            h = decoder.mlp_block(cfg, h, p, live)
    return L.rms_norm(h, params["final_norm"], eps), (*paged, conv, ssm)


def forward(cfg: ModelConfig, params: dict, kv, step):
    """One engine step: (float32 logits [R, vocab] at step.sample_idx, updated pools)."""
    h, kv = hidden_states(cfg, params, kv, step)
    return decoder.lm_logits(cfg, params, h[step.sample_idx]), kv


def params_from_hf(cfg: ModelConfig, get, dtype, progress=None, quantizer=None,
                   names: dict | None = None) -> dict:
    """graphs/decoder.py params_from_hf with Granite 4's names (`names`: another family's); the
    conv weight [C, 1, K] read as [C, K], whole expert stacks [E, out, in] as [E, in, out]."""
    def read(name):
        base, _, how = name.partition(":")
        w = get(base)
        if how == "squeeze":
            return np.asarray(w, np.float32)[:, 0, :].T    # transposed back on loading
        if how == "T":
            return np.asarray(w, np.float32).transpose(0, 2, 1)
        return w
    if hasattr(get, "names"):
        read.names = get.names
    return decoder.params_from_hf(cfg, read, dtype, progress, quantizer,
                                  moe_names=names or NAMES,
                                  shapes=sharding.shapes(param_specs(cfg)))


# --- GGUF (convert_hf_to_gguf's GraniteHybridModel: Mamba2Model's and GraniteMoeModel's) ----

def gguf_config(hf: dict, get, tensors) -> None:
    """Mamba2's sizes from the ssm.* keys, the attention layers from their tensors, Granite's
    multipliers; rope only where rope.scaling.finetuned says (the converter clears it for
    Granite 4, which has none)."""
    from maxjax.graphs.granite import gguf_config as granite_config
    n = hf["num_hidden_layers"]
    hf["layer_types"] = ["attention" if f"blk.{i}.attn_q.weight" in tensors else "mamba"
                         for i in range(n)]
    granite_config(hf, get, tensors)
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    experts = int(get("expert_count", 0))
    hf.update(mamba_n_heads=heads, mamba_d_head=inner // heads,
              mamba_n_groups=int(get("ssm.group_count")),
              mamba_d_state=int(get("ssm.state_size")), mamba_d_conv=int(get("ssm.conv_kernel")),
              num_local_experts=experts, num_experts_per_tok=int(get("expert_used_count", 0)),
              position_embedding_type="rope" if get("rope.scaling.finetuned") else None)
    shared = get("expert_shared_feed_forward_length")
    hf["shared_intermediate_size"] = int(shared or hf["intermediate_size"])


def _gate_up(gate: str, up: str):
    return lambda read, hf: np.concatenate([read(gate), read(up)], axis=-2)


def _shared(down: bool):
    """The shared MLP: ffn_*_shexp beside experts, the dense ffn_* without."""
    def make(read, hf):
        if down:
            w = read("ffn_down_shexp.weight")
            return read("ffn_down.weight") if w is None else w
        if read("ffn_gate_shexp.weight") is None:
            return _gate_up("ffn_gate.weight", "ffn_up.weight")(read, hf)
        return _gate_up("ffn_gate_shexp.weight", "ffn_up_shexp.weight")(read, hf)
    return make


# llama.cpp stores -exp(A_log) and D as [H, 1], the conv taps [C, K], the gated norm's weight
# [groups, C / groups], gate and up apart.
GGUF_TENSORS = {
    "mamba.A_log": (("ssm_a",), lambda read, hf: np.log(-read("ssm_a")).reshape(-1)),
    "mamba.D": (("ssm_d",), lambda read, hf: read("ssm_d").reshape(-1)),
    "mamba.dt_bias": (("ssm_dt.bias",), lambda read, hf: read("ssm_dt.bias")),
    "mamba.norm.weight": (("ssm_norm.weight",),
                          lambda read, hf: read("ssm_norm.weight").reshape(-1)),
    "mamba.conv1d.weight": (("ssm_conv1d.weight",),
                            lambda read, hf: read("ssm_conv1d.weight")[:, None, :]),
    "block_sparse_moe.input_linear.weight": (("ffn_gate_exps.weight",),
                                             _gate_up("ffn_gate_exps.weight", "ffn_up_exps.weight")),
    "shared_mlp.input_linear.weight": (("ffn_gate_shexp.weight", "ffn_gate.weight"),
                                       _shared(False)),
    "shared_mlp.output_linear.weight": (("ffn_down_shexp.weight", "ffn_down.weight"),
                                        _shared(True)),
}
GGUF_LAYER_NAMES = {"mamba.in_proj.weight": "ssm_in.weight",
                    "mamba.conv1d.bias": "ssm_conv1d.bias",
                    "mamba.out_proj.weight": "ssm_out.weight",
                    "block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight",
                    "block_sparse_moe.output_linear.weight": "ffn_down_exps.weight"}

ARCHITECTURE = Architecture(
    "GraniteMoeHybridForCausalLM", config_from_hf, forward=forward, hidden_states=hidden_states,
    lm_logits=decoder.lm_logits, param_specs=param_specs, params_from_hf=params_from_hf,
    request_state=RECURRENT.name, gguf_archs=("granitehybrid",), gguf_config=gguf_config,
    gguf_layer_names=GGUF_LAYER_NAMES, gguf_tensors=GGUF_TENSORS, gguf_permuted_qk=True,
    description="Granite 4 (Mamba2 layers with attention; routed and shared MLPs; Granite "
                "multipliers)")
