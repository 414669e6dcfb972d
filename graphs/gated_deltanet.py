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

Decode runs the recurrence a token at a time (`delta_step` under recurrent.scan_rows); a
prefill bucket runs it in chunks of CHUNK a row (`chunk_delta` under recurrent.scan_chunks), as
transformers' torch_chunk_gated_delta_rule and the FLA library do: in a chunk, with gc the
cumulative log decay from its start and G[i, j] = exp(gc_i - gc_j) for j <= i,
  A = (beta k k^T) * G below the diagonal,  (I + A) [u | w] = [beta v | beta exp(gc) k]
(a unit lower-triangular inverse, `unit_lower_inverse`); then from the chunk's initial state S
  d = u - w S,  out = exp(gc) q S + ((q k^T) * G) d,  S <- exp(gc_C) S + (exp(gc_C - gc) k)^T d.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from maxjax.graphs import layers as L
from maxjax.graphs import recurrent
from maxjax.graphs.sharding import ArraySpec
from maxjax.graphs.state import conv_channels

L2_EPS = 1e-6         # transformers' l2norm (the FLA library's)
CHUNK = 64            # transformers' chunk size


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


def unit_lower_inverse(a):
    """(I + a)^-1 of strictly lower-triangular a [..., C, C] (C a power of two), by doubling
    inverted diagonal blocks: [[X1, 0], [A21, X2]]^-1 = [[X1^-1, 0], [-X2^-1 A21 X1^-1, X2^-1]]
    (batched matmuls only; XLA's triangular solve runs far slower on the CPU)."""
    *lead, C, _ = a.shape
    if C & (C - 1):
        raise ValueError(f"chunk size {C}: a power of two")
    inv = jnp.ones((*lead, C, 1, 1), a.dtype)                 # the inverted b x b blocks
    b = 1
    while b < C:
        P = C // (2 * b)
        below = a.reshape(*lead, P, 2, b, P, 2, b)[..., :, 1, :, :, 0, :]
        a21 = jnp.moveaxis(jnp.diagonal(below, axis1=-4, axis2=-2), -1, -3)    # [.., P, b, b]
        x1, x2 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        l21 = -(x2 @ a21 @ x1)
        zero = jnp.zeros_like(x1)
        inv = jnp.concatenate([jnp.concatenate([x1, zero], -1),
                               jnp.concatenate([l21, x2], -1)], -2)
        b *= 2
    return inv[..., 0, :, :]


def chunk_delta(q, k, v, g, beta, state_pool, step, size: int = CHUNK):
    """The delta rule over a prefill step in chunks (module docstring): q, k [T, heads, k_dim],
    v [T, heads, v_dim], the log decay g and beta [T, heads] -> (out [T, heads, v_dim], the
    updated state_pool)."""
    lay = recurrent.chunk_layout(step, size)
    q, k, v, g, beta = (jnp.swapaxes(recurrent.to_chunks(lay, a), 1, 2)      # [N, H, C, ...]
                        for a in (q, k, v, g, beta))
    gc = jnp.cumsum(g, axis=-1)
    below = jnp.tril(jnp.ones((size, size), bool))
    gap = jnp.exp(jnp.where(below, gc[..., :, None] - gc[..., None, :], -jnp.inf))
    kb = k * beta[..., None]
    a = jnp.einsum("nhik,nhjk->nhij", kb, k) * gap * ~jnp.eye(size, dtype=bool)
    rhs = jnp.concatenate([v * beta[..., None], kb * jnp.exp(gc)[..., None]], axis=-1)
    uw = jnp.einsum("nhij,nhjd->nhid", unit_lower_inverse(a), rhs)
    u, w = uw[..., :v.shape[-1]], uw[..., v.shape[-1]:]
    qk = jnp.einsum("nhik,nhjk->nhij", q, k) * gap
    qg = q * jnp.exp(gc)[..., None]
    kd = k * jnp.exp(gc[..., -1:] - gc)[..., None]
    total = jnp.exp(gc[..., -1])

    def update(state, inp):                                   # state [H, k_dim, v_dim]
        u, w, qk, qg, kd, total = inp
        d = u - jnp.einsum("hck,hkv->hcv", w, state)
        out = jnp.einsum("hck,hkv->hcv", qg, state) + jnp.einsum("hij,hjv->hiv", qk, d)
        state = total[:, None, None] * state + jnp.einsum("hck,hcv->hkv", kd, d)
        return state, jnp.swapaxes(out, 0, 1)

    return recurrent.scan_chunks(update, (u, w, qk, qg, kd, total), state_pool, lay)


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
    out, state_pool = recurrent.token_or_chunks(
        step, CHUNK, lambda: chunk_delta(q, k, v, g, beta, state_pool, step),
        lambda: recurrent.scan_rows(delta_step, (q, k, v, jnp.exp(g), beta), state_pool, step))
    out = L.rms_norm(out, p["gdn_norm"], cfg.rms_norm_eps).astype(jnp.float32)
    out = out * jax.nn.silu(z.astype(jnp.float32).reshape(T, H, dv))
    return L.linear(out.reshape(T, H * dv).astype(x.dtype), p["w_out"], live=live), \
        conv_pool, state_pool
