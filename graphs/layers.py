"""Layers shared by the architectures: norms, rotary embedding, MLP, attention over KV pages."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


NEG_INF = -1e30
# Query tokens per chunk of attention blocks: best of 4-32 on the CPU (tools/bench_attention.py).
_CHUNK_QUERIES = 8


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
    against a contiguous [page, hd] block, with no transposes of K or V. Blocks are visited in
    chunks of a few (`_CHUNK_QUERIES`): each chunk loops only over the pages its own queries can
    see (from the first page inside `window`, the layer's sliding window, 0: none), and chunks
    holding only padding are skipped. An online softmax over pages keeps memory at O(T x page).
    """
    T, H, hd = q.shape
    KV, page_size = k_pool.shape[2], k_pool.shape[3]
    G = H // KV
    NB, B = step.block_tokens.shape
    M = B * G
    C = min(NB, max(2, _CHUNK_QUERIES // B))
    n_chunks = -(-NB // C)
    pad = n_chunks * C - NB
    qb = (q.astype(jnp.float32) * scale)[step.block_tokens]            # [NB, B, H, hd]
    qb = qb.reshape(NB, B, KV, G, hd).transpose(0, 2, 1, 3, 4).reshape(NB, KV, M, hd)
    qb = jnp.pad(qb, ((0, pad), (0, 0), (0, 0), (0, 0)))
    pages = jnp.pad(step.page_table[step.block_row], ((0, pad), (0, 0)))   # [NB + pad, P]
    pos = jnp.pad(step.block_pos, ((0, pad), (0, 0)), constant_values=-1)   # -1: padding
    chunk_pos = pos.reshape(n_chunks, C * B)
    last = chunk_pos.max(-1)
    first = jnp.where(chunk_pos >= 0, chunk_pos, jnp.iinfo(jnp.int32).max).min(-1)
    offsets = jnp.arange(page_size, dtype=jnp.int32)

    def chunk(c, out):
        qc = jax.lax.dynamic_slice_in_dim(qb, c * C, C)
        pc = jax.lax.dynamic_slice_in_dim(pages, c * C, C)
        qpos = jax.lax.dynamic_slice_in_dim(pos, c * C, C)[:, None, :, None, None]

        def body(j, carry):
            m, l, acc = carry
            ids = pc[:, j]
            k = k_pool[layer, ids].astype(jnp.float32)                  # [C, KV, page, hd]
            v = v_pool[layer, ids].astype(jnp.float32)
            s = jnp.einsum("nkmd,nkpd->nkmp", qc, k)
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            kpos = j * page_size + offsets
            visible = kpos <= qpos
            if window:
                visible &= kpos > qpos - window
            s = jnp.where(visible, s.reshape(C, KV, B, G, page_size), -jnp.inf)
            s = s.reshape(C, KV, M, page_size)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            l = l * corr + p.sum(-1)
            acc = acc * corr[..., None] + jnp.einsum("nkmp,nkpd->nkmd", p, v)
            return m_new, l, acc

        init = (jnp.full((C, KV, M), NEG_INF, jnp.float32), jnp.zeros((C, KV, M), jnp.float32),
                jnp.zeros((C, KV, M, hd), jnp.float32))
        start = jnp.maximum(first[c] - window + 1, 0) // page_size if window else 0
        stop = jnp.minimum(last[c] // page_size + 1, pages.shape[1])
        _, l, acc = jax.lax.fori_loop(start, stop, body, init)
        acc = acc / jnp.where(l > 0, l, 1.0)[..., None]                 # padding queries: l == 0
        return jax.lax.dynamic_update_slice_in_dim(out, acc, c * C, 0)

    # Blocks of real tokens come first, so the chunks holding any are a prefix.
    if n_chunks == 1:
        out = chunk(0, jnp.zeros_like(qb))
    else:
        out = jax.lax.fori_loop(0, jnp.sum(last >= 0), chunk, jnp.zeros_like(qb))
    out = out[:NB].reshape(NB, KV, B, G, hd).transpose(0, 2, 1, 3, 4).reshape(NB * B, H, hd)
    return out[step.token_block].astype(q.dtype)
