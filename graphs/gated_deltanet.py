"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5 (graphs/qwen3_next.py),
as transformers' Qwen3NextGatedDeltaNet computes it; per request it keeps a fixed-size state
(graphs/state.py RECURRENT), carried from step to step by graphs/recurrent.py.

x [T, D] -> one fused projection q|k|v|z|b|a (`w_in`): q and k of `ssm_groups` key heads of
`ssm_state_dim`, v and z of `ssm_heads` value heads of `ssm_head_dim`, b and a one per value
head. q|k|v (the conv channels, graphs/state.py `conv_channels`) go through the depthwise
causal convolution (`conv_w` [C, K], no bias) and SiLU; q and k are L2-normalised per head and
q scaled by ssm_state_dim^-0.5; each key head serves ssm_heads / ssm_groups consecutive value
heads. Per value head, with beta = sigmoid(b) and the decay g = -exp(A_log) softplus(a + dt_bias),
the state S [k_dim, v_dim] goes token by token through the delta rule
  S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   out = S^T q
and the output through the gated RMSNorm (weight `gdn_norm`, no +1) times silu(z), then `w_out`.

The recurrence here runs one token at a time (`delta_step` under recurrent.scan_rows), for
prefill as for decode. transformers prefills in chunks of 64 (the UT transform); a chunked form
can replace the scan for prefill with `delta_step` kept for decode.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from maxjax.graphs import layers as L
from maxjax.graphs import recurrent
from maxjax.graphs.sharding import ArraySpec
from maxjax.graphs.state import conv_channels

L2_EPS = 1e-6         # transformers' l2norm (the FLA library's)


def in_sizes(cfg) -> tuple[int, ...]:
    """The parts of `w_in`'s output, in order: q, k, v, z, b, a."""
    qk = cfg.ssm_groups * cfg.ssm_state_dim
    v = cfg.ssm_heads * cfg.ssm_head_dim
    return qk, qk, v, v, cfg.ssm_heads, cfg.ssm_heads


def layer_specs(cfg) -> dict:
    """A Gated DeltaNet layer's parameters (beside its norms and MLP)."""
    D, C, K = cfg.hidden_size, conv_channels(cfg), cfg.ssm_conv_kernel
    heads = ArraySpec((cfg.ssm_heads,), ("ssm",))
    return {"w_in": ArraySpec((D, sum(in_sizes(cfg))), ("embed", "ssm")),
            "conv_w": ArraySpec((C, K), ("ssm", "ssm")),
            "A_log": heads, "dt_bias": heads,
            "gdn_norm": ArraySpec((cfg.ssm_head_dim,), ("ssm",)),
            "w_out": ArraySpec((cfg.ssm_heads * cfg.ssm_head_dim, D), ("ssm", "embed"))}


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def delta_step(state, inputs):
    """One token of every value head: state [heads, k_dim, v_dim] float32; inputs (q, k
    [heads, k_dim], v [heads, v_dim], decay exp(g) and beta [heads]) -> (state, out [heads,
    v_dim])."""
    q, k, v, decay, beta = inputs
    state = state * decay[:, None, None]
    remembered = jnp.einsum("hkv,hk->hv", state, k)
    delta = (v - remembered) * beta[:, None]
    state = state + k[:, :, None] * delta[:, None, :]
    return state, jnp.einsum("hkv,hk->hv", state, q)


def gated_deltanet(cfg, step, x, conv_pool, state_pool, p, live):
    """x [T, D] (normed) through the layer: (out [T, D], conv_pool, state_pool), the pools
    this layer's [slots, ...] of graphs/state.py RECURRENT, each row's state read and written
    back at its slot (graphs/recurrent.py)."""
    T = x.shape[0]
    H, G, dk, dv = cfg.ssm_heads, cfg.ssm_groups, cfg.ssm_state_dim, cfg.ssm_head_dim
    qk, _, nv, _, _, _ = in_sizes(cfg)
    proj = L.linear(x, p["w_in"], live=live)
    mixed, z, b, a = jnp.split(proj, [2 * qk + nv, 2 * qk + 2 * nv, 2 * qk + 2 * nv + H],
                               axis=-1)
    y, conv_pool = recurrent.causal_conv(mixed, p["conv_w"], None, conv_pool, step)
    y = jax.nn.silu(y)                                              # float32
    q = _l2norm(y[:, :qk].reshape(T, G, dk)) * dk ** -0.5
    k = _l2norm(y[:, qk:2 * qk].reshape(T, G, dk))
    q, k = jnp.repeat(q, H // G, axis=1), jnp.repeat(k, H // G, axis=1)
    v = y[:, 2 * qk:].reshape(T, H, dv)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
    out, state_pool = recurrent.scan_rows(delta_step, (q, k, v, jnp.exp(g), beta), state_pool,
                                          step)
    out = L.rms_norm(out, p["gdn_norm"], cfg.rms_norm_eps).astype(jnp.float32)
    out = out * jax.nn.silu(z.astype(jnp.float32).reshape(T, H, dv))
    return L.linear(out.reshape(T, H * dv).astype(x.dtype), p["w_out"], live=live), \
        conv_pool, state_pool
