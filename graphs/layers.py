"""Layers shared by the architectures: norms, rotary embedding, MLP, attention over KV pages."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


NEG_INF = -1e30


def rms_norm(x, w, eps: float, plus_one: bool = False):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    scale = (1.0 + w.astype(jnp.float32)) if plus_one else w.astype(jnp.float32)
    return (xf * scale).astype(x.dtype)


def activation(name: str):
    if name == "silu":
        return jax.nn.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: jax.nn.gelu(x, approximate=True)
    if name == "gelu":
        return lambda x: jax.nn.gelu(x, approximate=False)
    raise ValueError(f"unsupported activation {name!r} (supported: silu, gelu, gelu_pytorch_tanh)")


def gated_mlp(x, w_gate_up, w_down, act: str):
    gate_up = x @ w_gate_up
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return (activation(act)(gate) * up) @ w_down


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple | None):
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    kind = scaling[0]
    if kind == "linear":
        return inv / scaling[1]
    if kind == "llama3":
        factor, low, high, orig = scaling[1:5]
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        out = jnp.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(mid, smoothed, out)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3)")


def rope_cos_sin(positions, inv_freq):
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [T, heads, head_dim]; HF's rotate-half layout."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).astype(x.dtype)


def write_kv(pool, layer, slots, new, page_size: int):
    """pool [L, N, KV, page, hd]; new [T, KV, hd] written at flat slots (in place when donated)."""
    return pool.at[layer, slots // page_size, :, slots % page_size].set(new.astype(pool.dtype))


def paged_attention(q, k_pool, v_pool, layer: int, step, window: int, scale: float, softcap=None):
    """Causal attention of each token over its request's KV pages, one page at a time.

    q [T, H, hd]; pools [L, N, KV, page, hd], already holding this step's keys. Queries are
    regrouped into the step's attention blocks (B tokens of one row, `graphs/step.py`), so each
    page is gathered once per block and both products are batched matmuls of (B x group) queries
    against a contiguous [page, hd] block, with no transposes of K or V. `window` is the layer's
    sliding window (0: none). An online softmax over pages keeps memory at O(T x page); the loop
    stops after the last page any token of the step can see.
    """
    T, H, hd = q.shape
    KV, page_size = k_pool.shape[2], k_pool.shape[3]
    G = H // KV
    NB, B = step.block_tokens.shape
    M = B * G
    qb = (q.astype(jnp.float32) * scale)[step.block_tokens]            # [NB, B, H, hd]
    qb = qb.reshape(NB, B, KV, G, hd).transpose(0, 2, 1, 3, 4).reshape(NB, KV, M, hd)
    qpos = step.block_pos[:, None, :, None, None]                       # [NB, 1, B, 1, 1]
    pages = step.page_table[step.block_row]                             # [NB, P]
    num_pages = jnp.minimum(jnp.max(step.block_pos) // page_size + 1, pages.shape[1])
    offsets = jnp.arange(page_size, dtype=jnp.int32)

    def body(j, carry):
        m, l, acc = carry
        ids = pages[:, j]
        k = k_pool[layer, ids].astype(jnp.float32)                      # [NB, KV, page, hd]
        v = v_pool[layer, ids].astype(jnp.float32)
        s = jnp.einsum("nkmd,nkpd->nkmp", qb, k)
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        kpos = j * page_size + offsets
        visible = kpos <= qpos
        if window:
            visible &= kpos > qpos - window
        s = jnp.where(visible, s.reshape(NB, KV, B, G, page_size), -jnp.inf).reshape(NB, KV, M, page_size)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("nkmp,nkpd->nkmd", p, v)
        return m_new, l, acc

    init = (jnp.full((NB, KV, M), NEG_INF, jnp.float32), jnp.zeros((NB, KV, M), jnp.float32),
            jnp.zeros((NB, KV, M, hd), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_pages, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]                     # padding queries: l == 0
    out = out.reshape(NB, KV, B, G, hd).transpose(0, 2, 1, 3, 4).reshape(NB * B, H, hd)
    return out[step.token_block].astype(q.dtype)
